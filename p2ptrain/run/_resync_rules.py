"""What a member that does not hold the run's state does next, and saying what it waits for.

Pure: the resync loop (run/_resync.py) passes what it holds and heard, and the time.

A member that is not synced loads a head only when one names a version past its own chain. Before,
it waited for a head in every other case, also holding a confirmed chain past v0 whose last record
names the very checkpoint to load: with no head past v0 heard (all heard while it knew no
coordinator, or none since it fell out of step: the coordinator was itself, and a member that is not
synced does not stand), nothing ever woke it, and it stayed ``resyncing`` for good without a line in
the log. That is the v1-and-later twin of a member going back to the run's root at v0
(:func:`restarts_at_root`). Now it loads its own chain's last checkpoint,
through the same boundary as a head. And a member that stays unsynced says so (:class:`WaitNotes`):
what it waits for, from :data:`NOTE_AFTER_S` on, at doubling intervals, so that the next run stuck
there tells why (tests/pipeline/test_stalling_replica.py once kept two members ``resyncing`` for
150 s, at v1 with their steps 0 and 1, with no line to say what they were waiting for).
"""

from __future__ import annotations

from enum import Enum

from p2ptrain.base import short_id
from p2ptrain.wire import TaskHead

# A member unsynced this long says what it waits for (a resync takes a look or two, ~1 s each), then
# at each doubling of the wait: a few lines for a wait of minutes, each with its reason.
NOTE_AFTER_S = 15.0
# A catch-up or a look of the resync loop that took this long is said too: each of its waits is
# bounded (a fetch 60 s, the trainer's hold 30 s), but no look happens meanwhile, and the members
# of a plan it catches up to wait for it.
SLOW_STEP_S = 10.0


def restarts_at_root(version: int, head: TaskHead | None, *, pending: bool, was_synced: bool) -> bool:
    """Whether a member that does not hold the run's state goes back to the run's initial state
    (:meth:`Resync.load_root`) rather than wait for a head: only while its own chain (``version``)
    has no confirmed record, so its state has no confirmed progress to lose, whatever any head says;
    not while a head names a later version (that one is loaded instead: the run went on without
    it), nor while a record is ``pending`` (it may yet be confirmed here). Only a member that held
    the run's state before (``was_synced``): a joiner that heard the first span under way waits for
    its checkpoint, as it always did (docs/training.md, "Join")."""
    return was_synced and version == 0 and (head is None or head.version == 0) and not pending


class Unsynced(Enum):
    """What the resync loop does at a look, for a member that does not hold the run's state."""

    LOAD_HEAD = "load the head"  # a head names a version past its chain
    LOAD_OWN = "load its chain's last checkpoint"  # no head past its chain, its state is another step's
    SYNCED = "hold the run's state"  # no head past its chain, and its state is at the chain's head step
    WAIT = "wait for a head"  # at v0, no head past it: the first checkpoint (or its head) comes first


def unsynced_action(version: int, head_step: int, step: int, head: TaskHead | None) -> Unsynced:
    """For a member not synced, holding confirmed chain ``version`` whose last record is at
    ``head_step``, its own state at ``step``, the latest head heard ``head`` (None: none): load that
    head only when it names a later version; else, past v0, go to its own chain's head (its state
    when at that step, else that checkpoint by CID); at v0 wait (a joiner waits for the run's first
    checkpoint: docs/training.md, "Join"; one that held the run's state went back to the root
    before this is asked, :func:`restarts_at_root`)."""
    if head is not None and head.version > version:
        return Unsynced.LOAD_HEAD
    if version == 0:
        return Unsynced.WAIT
    return Unsynced.SYNCED if step == head_step else Unsynced.LOAD_OWN


def head_wanted(head: TaskHead | None, coordinator: str | None, term: int) -> str:
    """What a member at v0 with no head past it (:attr:`Unsynced.WAIT`) waits for, in words."""
    heard = "none heard" if head is None else f"the latest heard is v{head.version}"
    source = "no coordinator known" if coordinator is None else f"from {short_id(coordinator)}, coordinator of term {term}"
    return f"a head past model v0 ({heard}; {source})"


class WaitNotes:
    """When a member that stays unsynced says what it waits for: once it has been so for
    NOTE_AFTER_S, then each time that wait doubles; counting starts again once it is synced."""

    def __init__(self) -> None:
        self._since: float | None = None  # when this member was first seen unsynced, this time
        self._next = NOTE_AFTER_S  # how long unsynced at the next note

    def note(self, now: float, synced: bool, waiting: str | None) -> str | None:
        """The line to log at this look (None: none), given whether the member is ``synced`` and
        what it ``waiting`` for (None: it acted at this look)."""
        if synced:
            self._since, self._next = None, NOTE_AFTER_S
            return None
        if self._since is None:
            self._since = now
        held = now - self._since
        if waiting is None or held < self._next:
            return None
        while self._next <= held:
            self._next *= 2
        return f"not synced for {held:.0f} s: waiting for {waiting}"


def slow_step(took: float, doing: str) -> str | None:
    """The line to log when ``doing`` (a catch-up, a look) took ``took`` seconds (None: not long)."""
    return f"{doing} took {took:.0f} s" if took >= SLOW_STEP_S else None


def after_load(failure: str | None) -> str | None:
    """What a member whose load failed (``failure``; None: it loaded) waits for, in words."""
    return None if failure is None else f"a state it can load (the last try: {failure})"
