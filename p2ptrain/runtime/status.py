"""What a node reports about itself and its runs: the phases of a run and the typed status objects.

The node builds them (:meth:`~p2ptrain.runtime.task_run.TaskRun.status`, ``Node.status``); the CLI,
the metrics exporter and :mod:`p2ptrain.testing` read them. The control socket still carries JSON:
``to_json`` is the one place the ``--json`` keys are spelled (a contract: keys are added, never
renamed), ``from_json`` the one place a client turns them back into an object. This module imports
nothing heavy, so the CLI can read a status without torch or libp2p.
"""

from __future__ import annotations

from enum import StrEnum


class Phase(StrEnum):
    """Where one member's run of a task is (``task status``, key ``state``). String-valued: the JSON
    carries the same text it always has."""

    STARTING = "starting"
    FETCHING = "fetching data"
    TRAINING = "training"
    RESYNCING = "resyncing"
    DONE = "done"
    CANCELLED = "cancelled"  # by the task's publisher
    FAILED = "failed"
    STOPPED = "stopped"  # the node stopped while the run was under way


# A run in one of these phases is over: it acts on no head, and its node answers head requests for it.
FINISHED = frozenset({Phase.DONE, Phase.CANCELLED, Phase.FAILED, Phase.STOPPED})
