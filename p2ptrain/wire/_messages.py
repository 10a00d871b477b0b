"""The schemas of every message that travels on pubsub, registered by type name.

A message is a frozen dataclass checked by :mod:`p2ptrain.wire._schema`. Adding a type means adding
a class here with ``@message("name")``, which registers it in :data:`MESSAGES`; a receiver drops any
type its registry does not know. The decoder and the router are handed a registry (default:
:data:`MESSAGES`), so a test or an extension that needs types of its own builds its own registry
(``MESSAGES.copy()`` plus ``@message("x", into=registry)``) instead of adding to the package's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, TypeVar

from p2ptrain.wire._limits import MAX_ADDR_LEN, MAX_BUILDER_NAME_LEN, MAX_BUILDERS

M = TypeVar("M")


class MessageRegistry:
    """Message type names and the dataclass each one is decoded into: what a decoder accepts."""

    def __init__(self, types: dict[str, type] | None = None) -> None:
        self._types: dict[str, type] = dict(types or {})

    def add(self, name: str, cls: type) -> None:
        """Accept messages of type ``name`` as ``cls`` (whose ``TYPE`` must be ``name``)."""
        if name in self._types:
            raise ValueError(f"message type {name!r} registered twice")
        self._types[name] = cls

    def get(self, name: str) -> type | None:
        """The schema of type ``name``, or None if this registry does not know it."""
        return self._types.get(name)

    def knows(self, cls: type) -> bool:
        """Whether ``cls`` is the registered schema of its type name."""
        return self._types.get(getattr(cls, "TYPE", None)) is cls  # type: ignore[arg-type]

    def copy(self) -> MessageRegistry:
        """A registry of the same types, to extend without touching this one."""
        return MessageRegistry(self._types)

    def names(self) -> list[str]:
        return sorted(self._types)


MESSAGES = MessageRegistry()
"""The package's message types (filled by the ``@message`` classes below): the default of every
decoder and router."""


def message(name: str, into: MessageRegistry = MESSAGES) -> Callable[[type[M]], type[M]]:
    """Name a dataclass message type ``name`` and register it in ``into`` (default :data:`MESSAGES`)."""

    def register(cls: type[M]) -> type[M]:
        into.add(name, cls)
        cls.TYPE = name  # type: ignore[attr-defined]
        return cls

    return register


def type_name(msg: Any) -> str:
    """The registered type name of a message instance."""
    return type(msg).TYPE  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Capabilities:
    """What a peer offers, so tasks can pick peers that fit their requirements."""

    # Newer versions may add optional fields; this one skips them (p2ptrain.wire._schema).
    EXTENSIBLE: ClassVar[bool] = True

    device: str = field(metadata={"max_len": 16, "printable": True})  # "cpu" or "cuda"
    cpu_count: int
    free_ram_bytes: int
    version: str = field(metadata={"max_len": 64, "printable": True})
    gpu_name: str | None = field(default=None, metadata={"max_len": 128, "printable": True})
    gpu_memory_bytes: int | None = None
    # The model builders this peer has (p2ptrain.models.builders: built-in and from installed packages),
    # so a publisher can see who can build a task's model (``node peers``). Added in issue 30 with a default: a peer
    # without it decodes as advertising none, and an older peer skips it.
    builders: tuple[str, ...] = field(default=(), metadata={"max_items": MAX_BUILDERS, "max_len": MAX_BUILDER_NAME_LEN})
    # The arithmetic its steps use (p2ptrain.base.arithmetic_of: the torch release and the CPU kernel
    # set or the GPU), known once the node's torch probe ran: members of one run must compute the
    # same bits (docs/deploy.md, "Which machines compute the same bits"). Added with a default, as
    # ``builders``: informational, never a rule of a check.
    arithmetic: str | None = field(default=None, metadata={"max_len": 128, "printable": True})


@message("heartbeat")
@dataclass(frozen=True)
class Heartbeat:
    """Sent every heartbeat interval on the membership topic: 'I am alive, here is how to reach me'.

    Extensible: a newer version may add optional fields, which this one skips (p2ptrain.wire._schema),
    so a field added to heartbeats does not split a mesh of mixed versions.
    """

    EXTENSIBLE: ClassVar[bool] = True

    addrs: tuple[str, ...] = field(metadata={"max_items": 16, "max_len": MAX_ADDR_LEN})
    caps: Capabilities
    tasks: tuple[str, ...] = field(default=(), metadata={"max_items": 64, "max_len": 128})
    # Whether others can dial the sender (p2ptrain.net._reachability): "public", "private" or
    # "unknown"; any other value is read as "unknown". Added in issue 20 with a default, so a
    # heartbeat without it (an older sender) decodes as "unknown".
    reachability: str = field(default="unknown", metadata={"max_len": 16})


@message("goodbye")
@dataclass(frozen=True)
class Goodbye:
    """Sent on clean shutdown so peers mark us gone at once instead of after the liveness timeout."""

    reason: str = field(default="", metadata={"max_len": 256, "printable": True})  # logged: "peer X left (reason)"


# --- training: tasks, rounds, elections, model records --------------------------------------------
# Bodies that must stay verifiable outside pubsub (stored records, vote certificates) are nested
# dataclasses carrying a detached Ed25519 signature; see p2ptrain.protocol.signing.

_CID = {"max_len": 128}
_PEER = {"max_len": 128}
_SIG = {"max_len": 128}  # hex of a 64-byte Ed25519 signature


@message("task_announce")
@dataclass(frozen=True)
class TaskAnnounce:
    """A task's canonical bytes are stored by ``task_cid``; peers that meet its requirements may join."""

    task_cid: str = field(metadata=_CID)
    name: str = field(metadata={"max_len": 128, "printable": True})  # shown by `task list`


@message("round_plan")
@dataclass(frozen=True)
class RoundPlan:
    """The coordinator's order for a span of ``rounds`` rounds (up to the next checkpoint): who takes
    part (rank = index in ``members``) from which state.

    ``step`` is the optimizer steps members must have taken before the first round; round
    ``round + i`` starts at step ``step + i``. ``base_cid``/``version`` name the latest confirmed
    model. A retry after a failure starts at the failed round with a higher ``attempt``.

    ``stages``, for a pipelined task only (``[pipeline]``): the stage each member serves, in the
    order of ``members`` (protocol/_plans.py checks it is what ``assign`` gives). Absent from the
    plans of every other task, whose bytes are as they were before it existed.

    ``cut``, for a pipelined task whose plans move the cut by measured time (``[pipeline] balance =
    "recut"``) only: the bounds of the stages (each stage's first piece, then the number of pieces).
    Absent: the cut by parameter count, so every other plan keeps its bytes (protocol/_recut.py
    checks it).
    """

    task_cid: str = field(metadata=_CID)
    term: int
    round: int
    attempt: int
    step: int
    rounds: int
    members: tuple[str, ...] = field(metadata={"max_items": 1024, **_PEER})
    base_cid: str = field(metadata=_CID)
    version: int
    stages: tuple[int, ...] | None = field(default=None, metadata={"max_items": 1024, "absent": True})
    cut: tuple[int, ...] | None = field(default=None, metadata={"max_items": 65, "absent": True})


@message("round_failed")
@dataclass(frozen=True)
class RoundFailed:
    """A member's all-reduce of ``round`` (of the plan ``term``/``attempt``) failed: it stopped there,
    at optimizer step ``step``. The coordinator answers with a retry plan."""

    task_cid: str = field(metadata=_CID)
    term: int
    round: int
    attempt: int
    step: int
    reason: str = field(default="", metadata={"max_len": 256, "printable": True})  # logged: "peer X left (reason)"


@dataclass(frozen=True)
class Vote:
    """A member's one vote in ``term``."""

    task_cid: str = field(metadata=_CID)
    term: int
    candidate: str = field(metadata=_PEER)
    voter: str = field(metadata=_PEER)


@message("vote")
@dataclass(frozen=True)
class SignedVote:
    vote: Vote
    signature: str = field(metadata=_SIG)

    @property
    def task_cid(self) -> str:
        """The task it is about, as every task message says (the run's router reads it)."""
        return self.vote.task_cid


@dataclass(frozen=True)
class ModelRecord:
    """One published global model: the unit of the run's history (a chain of confirmed records)."""

    task_cid: str = field(metadata=_CID)
    version: int
    parent: str = field(metadata=_CID)  # model CID of the previous confirmed record (or the initial model)
    round: int
    step: int
    members: tuple[str, ...] = field(metadata={"max_items": 1024})
    metrics: dict[str, float] = field(metadata={"max_items": 16})
    model_cid: str = field(metadata=_CID)
    optimizer_cid: str = field(metadata=_CID)  # optimizer state, so a late joiner resumes exactly
    term: int
    coordinator: str = field(metadata=_PEER)
    # The attempt of the span's plan (with ``term``): which of the span's plans, retries included,
    # its members are; a member that holds that plan checks them against it.
    attempt: int = 0


@message("model_record")
@dataclass(frozen=True)
class SignedModelRecord:
    """A model record with the coordinator's detached signature over its canonical bytes, and the
    votes that elected the coordinator in the record's term (its certificate: each vote signed by
    its voter, so they need no signature of the coordinator's). Anyone can then check, without
    having seen the election, that a quorum of the record's members chose its signer
    (:mod:`p2ptrain.protocol._lineage`)."""

    record: ModelRecord
    signature: str = field(metadata=_SIG)
    votes: tuple[SignedVote, ...] = field(default=(), metadata={"max_items": 128})

    @property
    def task_cid(self) -> str:
        return self.record.task_cid


@dataclass(frozen=True)
class Attestation:
    """A member's statement: 'for record ``record_id`` my own weights hash to these CIDs'."""

    task_cid: str = field(metadata=_CID)
    version: int
    record_id: str = field(metadata={"max_len": 64})
    model_cid: str = field(metadata=_CID)
    optimizer_cid: str = field(metadata=_CID)
    attester: str = field(metadata=_PEER)


@message("attestation")
@dataclass(frozen=True)
class SignedAttestation:
    attestation: Attestation
    signature: str = field(metadata=_SIG)

    @property
    def task_cid(self) -> str:
        return self.attestation.task_cid


@dataclass(frozen=True)
class ConfirmedRecord:
    """A confirmed record as a chain keeps it (one line of ``chain.jsonl``, or of the chain a head
    names): the signed record and the matching attestations of a quorum of its members, so that
    whoever reads the chain later can check the confirmation instead of believing it."""

    signed: SignedModelRecord
    attestations: tuple[SignedAttestation, ...] = field(metadata={"max_items": 128})


@message("vote_request")
@dataclass(frozen=True)
class VoteRequest:
    """A candidate asks the task's members for their vote as coordinator of ``term``."""

    task_cid: str = field(metadata=_CID)
    term: int
    candidate: str = field(metadata=_PEER)


@message("coordinator")
@dataclass(frozen=True)
class CoordinatorBeat:
    """The coordinator's heartbeat for its term, with the votes that elected it (a quorum certificate)."""

    task_cid: str = field(metadata=_CID)
    term: int
    coordinator: str = field(metadata=_PEER)
    votes: tuple[SignedVote, ...] = field(metadata={"max_items": 128})


@message("task_head")
@dataclass(frozen=True)
class TaskHead:
    """The coordinator's periodic word on where a run stands, for late joiners and onlookers.

    ``chain_cid`` names the confirmed chain's bytes (JSON lines of signed records), from which a
    joiner rebuilds and re-verifies the history before loading the head model and optimizer state.
    """

    task_cid: str = field(metadata=_CID)
    term: int
    version: int
    step: int
    round: int
    total_steps: int
    chain_cid: str = field(metadata=_CID)
    model_cid: str = field(metadata=_CID)
    optimizer_cid: str = field(metadata=_CID)
    members: tuple[str, ...] = field(metadata={"max_items": 1024, **_PEER})
    done: bool = False


@message("task_cancel")
@dataclass(frozen=True)
class TaskCancel:
    """The task's publisher stops its run: members finish the span under way, keep the last
    confirmed model, plan no more and report the state ``cancelled``. Published on the tasks topic
    (the publisher need not be a member); members obey it only from the peer the task file names as
    ``publisher`` (the pubsub envelope is signed by the sender's key)."""

    task_cid: str = field(metadata=_CID)
    reason: str = field(default="", metadata={"max_len": 256, "printable": True})  # logged: "peer X left (reason)"


@message("task_head_request")
@dataclass(frozen=True)
class HeadRequest:
    """Who holds the confirmed chain of ``task_cid``? Published on the tasks topic by a fetcher
    (`model fetch --latest`); a node whose run of the task is over, or that holds its chain on
    disk, answers with a :class:`TaskHead` of its own (rate-limited per task). The fetcher
    verifies the chain the head names before it believes the model."""

    task_cid: str = field(metadata=_CID)


@message("model_served")
@dataclass(frozen=True)
class ModelServed:
    """The sender serves ``model_cid`` over HTTP/JSON at ``url`` (``p2ptrain model serve`` beside its
    node), published on the tasks topic every ``SERVED_EVERY_S`` while it does. Peers list it for
    ``model predict`` for a few periods (services/_served.py). A claim, not proof: a client checks
    that the answers name the CID it asked for, and trusts the outputs only as far as the peer."""

    model_cid: str = field(metadata=_CID)
    url: str = field(metadata={"max_len": 256})


@message("task_resume")
@dataclass(frozen=True)
class TaskResume:
    """The task's publisher continues a run it cancelled (``p2ptrain task resume``): members forget
    the cancel and resume the run from the confirmed chain on their homes. Published on the tasks
    topic; obeyed, like :class:`TaskCancel`, only from the peer the task file names as ``publisher``."""

    task_cid: str = field(metadata=_CID)
