"""The protocol's idle waits, shortened for tests: in the test's own process (tests/conftest.py's
``quick_timers`` fixtures, with pytest's monkeypatch) and in the node processes and member scripts a
test forks (the fork server's child applies them before it runs the command, where the child's
environment has ``P2PTRAIN_TEST_QUICK_TIMERS=1``: :mod:`p2ptrain.testing._zygote`).

A run of real peers spends most of its wall time waiting for what may still come, not computing
(docs/testing.md, "Quick timers"); the run takes the same path whichever way each wait ends, so a
test's assertions stay the same and only the idle time changes. A process started fresh (not
forked: ``P2PTRAIN_TEST_FORK=0``, another interpreter, an ``env PYTHONPATH=...`` launcher)
keeps the production values, as the package itself always does: nothing outside the test harness
reads the variable.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

__all__ = ["JOIN_MARGINS", "QUICK_ENV", "QUICK_TIMERS", "apply_quick_timers", "quick_timers_off"]

# The variable that asks a forked child for the quick values (set by the ``quick_process_timers``
# fixtures of tests/conftest.py, or in a test's own ``env=``).
QUICK_ENV = "P2PTRAIN_TEST_QUICK_TIMERS"

# (module, name, value for tests); the production values are the modules' own. Each is a wait for
# peers that may still come or a message that may still arrive. Each 25-40% of production, and every
# one still several times loopback's round trip and a loaded 2-core box's scheduling delays (hundreds
# of ms). Measured: docs/testing.md, "Quick timers".
QUICK_TIMERS: tuple[tuple[str, str, float], ...] = (
    # The coordinator publishes the run's head every 2 s; a joiner listens 1.5 heads' worth (3 s)
    # before it takes step 0 as the run's state: every fresh join waited 3 s for a head nobody sends.
    ("p2ptrain.run._leading", "HEAD_EVERY_S", 0.5),
    ("p2ptrain.run._task_run", "HEAR_HEAD_S", 0.75),
    # A new coordinator's first plan waits 2 s for peers still joining (unless peers.max advertise).
    ("p2ptrain.protocol._planner", "FIRST_ROUND_GRACE_S", 0.5),
    # A resuming member hears its record's other members up to 20 s; a test's absent member is dead.
    ("p2ptrain.run._resume", "RESUME_WAIT_S", 5.0),
    # A round waits 15 s for every member of its plan to open its channel: for a member that was
    # stopped, a Sybil that never trains, a hostile one. Members in one process get a plan within
    # milliseconds of each other and had opened their channels within half a second in the logs
    # read (load ~1): 6 s leaves a loaded box seconds to spare, and a member that misses it is left
    # out of the retry for a while, not failed.
    ("p2ptrain.run._spans", "START_TIMEOUT_S", 6.0),
)

# The waits of QUICK_TIMERS that are also a margin for members that join late, not only idle time.
# The first plan's grace runs from the election: a member that starts advertising the task after it
# and gets the plan before the coordinator's next beat cannot follow it (a plan "not from the
# coordinator" of its term), round 0 fails and the retry leaves it out for about a minute
# (participation strikes). Peers whose joins spread over seconds (four to six pipelined trainers
# built in one process, under load) keep it: ``quick_timers_slow_joins`` (tests/conftest.py).
JOIN_MARGINS = frozenset({"FIRST_ROUND_GRACE_S"})


def quick_timers_off() -> bool:
    """``P2PTRAIN_TEST_QUICK=0``: every test and process keeps the production values (was a failure
    the timers? run it both ways)."""
    return os.environ.get("P2PTRAIN_TEST_QUICK", "1") == "0"


def apply_quick_timers(set_value: Callable[[object, str, float], None] = setattr, *, keep_margins: bool = False) -> None:
    """Set every QUICK_TIMERS value with ``set_value(module, name, value)`` (pytest's
    ``monkeypatch.setattr`` to undo it after a test; plain ``setattr`` in a forked child, whose
    modules die with it); ``keep_margins``: but those of JOIN_MARGINS."""
    # Every module imported before any is set: _task_run derives HEAR_HEAD_S from _leading's
    # HEAD_EVERY_S when it is first imported.
    targets = [(importlib.import_module(module), name, value) for module, name, value in QUICK_TIMERS
               if not (keep_margins and name in JOIN_MARGINS)]
    for target, name, value in targets:
        assert getattr(target, name) > value, f"{target.__name__}.{name} is already at or below its quick value"
        set_value(target, name, value)
