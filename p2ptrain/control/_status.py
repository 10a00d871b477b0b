"""What a node reports about itself and its runs: the phases of a run and the typed status objects.

The node builds them (:meth:`~p2ptrain.run.TaskRun.status`, ``Node.status``); the CLI,
the metrics exporter and :mod:`p2ptrain.testing` read them. The control socket still carries JSON:
``to_json`` is the one place the ``--json`` keys are spelled (a contract: keys are added, never
renamed), ``from_json`` the one place a client turns them back into an object. This module imports
nothing heavy, so the CLI can read a status without torch or libp2p.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum, StrEnum
from typing import Any

from p2ptrain.base import HistogramSnapshot


class Phase(StrEnum):
    """Where one member's run of a task is (``task status``, key ``state``). String-valued: the JSON
    carries the same text it always has."""

    STARTING = "starting"
    FETCHING = "fetching data"
    TRAINING = "training"
    RESYNCING = "resyncing"
    RESUMING = "resuming"  # from the chain on its home, after a stop (run/_resume.py)
    DONE = "done"
    CANCELLED = "cancelled"  # by the task's publisher
    FAILED = "failed"
    STOPPED = "stopped"  # the node stopped while the run was under way


# A run in one of these phases is over: it acts on no head, and its node answers head requests for it.
FINISHED = frozenset({Phase.DONE, Phase.CANCELLED, Phase.FAILED, Phase.STOPPED})


def _plain(value: Any) -> Any:
    """A field's value as JSON has it: tuples are lists, nested status objects their ``to_json``."""
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, ChainEntry):
        return value.to_json()
    if isinstance(value, Enum):  # a Phase: its plain text
        return value.value
    return value


# Which keys a task's status carries (field metadata "shape"): every status, a member's run only,
# a task only heard of, or none (in-process only, never on the control socket).
_BOTH, _MEMBER, _HEARD, _LOCAL = "both", "member", "heard", "local"


def _member(default: Any = None) -> Any:
    return field(default=default, metadata={"shape": _MEMBER})


def _member_dict() -> Any:
    return field(default_factory=dict, metadata={"shape": _MEMBER})


def _heard(default: Any = None) -> Any:
    return field(default=default, metadata={"shape": _HEARD})


@dataclass(frozen=True)
class ChainEntry:
    """One confirmed model of a run, as ``task status`` lists it (key ``chain``)."""

    version: int
    model_cid: str
    round: int
    step: int
    metrics: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "model_cid": self.model_cid, "round": self.round, "step": self.step,
                "metrics": dict(self.metrics)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ChainEntry:
        return cls(version=data["version"], model_cid=data["model_cid"], round=data["round"], step=data["step"],
                   metrics=dict(data.get("metrics") or {}))


@dataclass(frozen=True)
class TaskStatus:
    """``p2ptrain task status``: a member's run of a task (``member`` true, every field) or a task
    this node only heard of (its head's numbers, who announced it, why it was not joined).

    A new key is one field here: its metadata says which status carries it (:func:`_member`,
    :func:`_heard`; no metadata: both).
    """

    task_cid: str
    name: str
    # A Phase for a member's run; "announced", "running" or "done" (from its head) for a task only heard of.
    state: str
    member: bool
    error: str | None = _member()
    cancel_reason: str | None = _member()
    # "waiting for N more peers since T": N, and the seconds waited so far (None: not waiting)
    waiting_for_peers: int = _member(0)
    waiting_s: float | None = _member()
    synced: bool = _member(False)
    announced_by: str | None = _heard()
    refused: str | None = _heard()  # why this node did not join it
    # The builder the task names that this node lacks (refused then says what to install); added in issue 30.
    missing_builder: str | None = _heard()
    # The CID of the chain this node verified for a task it is no member of (what version and
    # latest_model_cid then come from): `model verify` reads it through a running node.
    chain_cid: str | None = _heard()
    round: int | None = None
    step: int = 0
    total_steps: int | None = None
    members: tuple[str, ...] = ()
    coordinator: str | None = _member()
    term: int = _member(0)
    version: int = 0
    latest_model_cid: str | None = None
    chain: tuple[ChainEntry, ...] = _member(())
    loss: float | None = _member()  # this member's training loss in its last round
    accuracy: float | None = _member()  # the latest confirmed model's test accuracy and loss
    test_loss: float | None = _member()
    bytes_sent: int = _member(0)
    bytes_received: int = _member(0)
    rounds_done: int = _member(0)
    compute_s: float = _member(0.0)
    sync_s: float = _member(0.0)
    apply_s: float = _member(0.0)
    rejected: dict[str, int] = _member_dict()  # heads, chains, resyncs refused, by kind
    # The confirmed record this run resumed from after a stop ({"version", "step"}); None for a fresh start.
    resumed_from: dict[str, int] | None = _member()
    # The last round this member completed and the step after it (None before the first round).
    last_round: int | None = _member()
    last_step: int | None = _member()
    # Local-SGD mode: H, and the inner step under way (1 to H; None between inner loops); None in sync mode.
    inner_steps: int | None = _member()
    inner_step: int | None = _member()
    is_coordinator: bool = _member(False)
    # A pipelined task (issue 31): this member's stage in the latest plan (from 0), and every stage's
    # {"stage", "replicas" (peer IDs, in the plan's order), "parameters"} (and, under balance =
    # "measured", "microseconds": the drivers' median time of a microbatch there); None for any other task.
    stage: int | None = _member()
    stages: tuple[dict[str, Any], ...] | None = _member()
    # A pipelined task: the replicas convicted of sending altered activations (outvoted by a third
    # opinion, accused by a majority of the drivers), each {"peer", "stage", "times", "step" (the
    # last)}; left out of plans as a misbehaving member is. None for any other task.
    stage_suspects: tuple[dict[str, Any], ...] | None = _member()
    # ... and, as a driver, the disagreements of two replicas nobody could decide (a stage of two, or
    # three different answers): {"stage", "peers" (the two), "times"}; nobody is left out on them.
    stage_disagreements: tuple[dict[str, Any], ...] | None = _member()
    # The last time a stage lost every replica (issue 31): {"stages": the stages left empty, "moved":
    # [{"peer", "from", "to"}], "step" and "version": the confirmed checkpoint the run went back to,
    # "redone": the steps this member had trained past it}; None when it never happened.
    stage_recovery: dict[str, Any] | None = _member()
    # The live peers this member sees left out of the run's plans for their arithmetic (its steps
    # would round to other bits: docs/deploy.md), each {"peer", "arithmetic" (what it advertises,
    # None: nothing)}, this member itself among them when it is one; and the run's class of
    # arithmetic (None: no live peer advertises one). Added with the planner's classes.
    arithmetic_left_out: tuple[dict[str, Any], ...] = _member(())
    arithmetic_run: str | None = _member()
    # Before a run's first plan: the classes of arithmetic whose peers count for nothing now, each
    # {"class", "lapses" (how often its candidates failed to lead the fresh run)}: Sybils of
    # another arithmetic voting early, or honest peers too loaded to win (protocol/_class_claims.py);
    # empty once a plan is taken.
    arithmetic_barred: tuple[dict[str, Any], ...] = _member(())
    # In-process only (the metrics exporter): each completed round's compute / sync / apply times.
    round_seconds: dict[str, HistogramSnapshot] | None = field(default=None, metadata={"shape": _LOCAL},
                                                              compare=False)

    def to_json(self) -> dict[str, Any]:
        """What ``task status --json`` prints: the keys of this status's kind, in field order."""
        shapes = (_BOTH, _MEMBER) if self.member else (_BOTH, _HEARD)
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)
                if f.metadata.get("shape", _BOTH) in shapes}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TaskStatus:
        """The status a node sent (``to_json``'s keys); keys this version does not know are ignored."""
        known = {f.name: f for f in fields(cls) if f.metadata.get("shape") != _LOCAL}
        values: dict[str, Any] = {}
        for name, value in data.items():
            if name not in known:
                continue
            if name == "chain":
                value = tuple(ChainEntry.from_json(entry) for entry in value or ())
            elif name == "members":
                value = tuple(value or ())
            elif name in ("stages", "stage_suspects", "stage_disagreements", "arithmetic_left_out",
                          "arithmetic_barred") \
                    and value is not None:
                value = tuple(dict(entry) for entry in value)
            elif name == "rejected":
                value = dict(value or {})
            values[name] = value
        return cls(**values)


@dataclass(frozen=True)
class NodeStatus:
    """``p2ptrain node status``: the peer, its addresses, connections, the peers it hears, counters.

    ``peer_id``, ``addrs`` and ``peers`` (and ``reachability``) are a contract. The sections that
    other modules report (``autonat``, ``relay``, ``discovery``, ``control``, ``messages``, each
    service under ``services``) stay the JSON objects their ``stats()`` give: those modules own them.
    """

    peer_id: str
    addrs: tuple[str, ...]
    reachability: str  # public / private / unknown (p2ptrain.net._reachability)
    autonat: dict[str, Any] | None
    relay: dict[str, Any] | None
    home: str
    version: str
    listening_at: float | None  # wall clock: listeners up, pubsub running
    started_at: float | None  # wall clock: mesh joined, services started
    connected: tuple[str, ...]
    topics: tuple[str, ...]
    mesh_topic: str
    heartbeat_interval_s: float
    caps: dict[str, Any] | None
    # At most STATUS_MAX_PEERS alive (the oldest) and gone (the latest); the totals count them all.
    peers: tuple[dict[str, Any], ...]
    gone: tuple[dict[str, Any], ...]
    peers_total: int
    gone_total: int
    membership: dict[str, Any]
    discovery: dict[str, Any] | None
    control: dict[str, Any]
    messages: dict[str, Any]
    services: dict[str, dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        """What ``node status --json`` prints."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NodeStatus:
        """The status a node sent; keys this version does not know are ignored."""
        values: dict[str, Any] = {f.name: data.get(f.name) for f in fields(cls)}
        for name in ("addrs", "connected", "topics", "peers", "gone"):
            values[name] = tuple(values[name] or ())
        for name in ("membership", "control", "messages", "services"):
            values[name] = dict(values[name] or {})
        return cls(**values)
