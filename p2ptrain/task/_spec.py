"""The task spec: what to train, on what data, how, and with how many peers.

A task is written as TOML by a person and travels as canonical JSON bytes stored by CID; _parse.py
reads both into the frozen dataclasses here (every field checked there), which the protocol and the
training read; the checks of a peer against a task's requirements live here too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


from p2ptrain.wire import Capabilities

# A base58 peer ID of an Ed25519 key is 52 characters; 128 leaves room for other key types.
MAX_PEER_ID_LEN = 128
# A task is a few hundred bytes; 64 KiB bounds both the TOML a person writes and the JSON we fetch.
MAX_TASK_BYTES = 64 * 1024
# A task nests three levels (task > model > kwargs > a list); eight refuse any bomb before parsing.
MAX_TASK_DEPTH = 8
# A coordinator's heartbeat carries a quorum of signed votes; 128 members keep it far below the wire cap.
MAX_PEERS = 128

OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "warmup", "cosine")
DEVICES = ("any", "cpu", "cuda")
ADMISSION = ("open", "allowlist")  # peers.admission
# An allowlist names at most this many peers (8x MAX_PEERS: room to rotate machines in and out).
MAX_ALLOWED = 1024
ROBUST = ("none", "clip")  # compression.robust: the plain mean, or each contribution's norm clipped to the median
MODES = ("sync", "local_sgd")  # training.mode: one all-reduce per optimizer step, or DiLoCo-style outer steps
OUTER_OPTIMIZERS = ("nesterov", "average")  # outer.optimizer
VALUES = ("fp32", "fp16", "int8", "2bit")  # compression.values: how the sent values travel
# DiLoCo's outer Nesterov defaults (Douillard et al. 2023): learning rate 0.7, momentum 0.9.
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9
# How long the outer all-reduce waits for the members' inner loops by default: members compute H
# steps each, at different speeds; a member later than this past the first is left out of the round
# (the retry goes on without it). 60 s is 4x sync mode's 15 s start timeout: the gap between the
# fastest and slowest member grows with H. Tasks with minutes-long inner loops set their own
# outer.wait_s (node/tasks/stdlib-lm.toml: 120 s for 50 steps of 1.6-2.1 s on a loaded CPU core).
OUTER_WAIT_S = 60.0


# [model] name of a run of the user's own module (p2ptrain.Optimizer, p2ptrain.train): no builder
# here; every member brings its module, and the task names its architecture card by CID.
USER_MODEL = "user"


@dataclass(frozen=True)
class ModelSpec:
    """A builder from :mod:`p2ptrain.models._registry` and its keyword arguments (JSON scalars/lists),
    or, for a run of the user's own module (``name = "user"``), the CID of its architecture card
    (:mod:`p2ptrain.models._fingerprint`: every tensor, the optimizer, the run's options)."""

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    architecture: str | None = None  # name = "user" only
    config: dict[str, Any] | None = None  # name = "hf" only: the transformers config (models._hf)

    @property
    def user(self) -> bool:
        """Whether the members bring the module themselves (no builder of ours makes it)."""
        return self.name == USER_MODEL

    @property
    def arguments(self) -> dict[str, Any]:
        """What the registry's builder takes: the kwargs, or an hf model's config."""
        return self.config if self.config is not None else self.kwargs


@dataclass(frozen=True)
class DatasetSpec:
    """A dataset manifest stored by CID and the names of its train and test splits."""

    manifest: str
    train_split: str = "train"
    test_split: str = "test"


@dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer every member runs, identically, on the averaged gradient."""

    name: str
    lr: float
    weight_decay: float = 0.0
    momentum: float | None = None  # sgd only
    beta1: float | None = None  # adam/adamw only, like beta2 and eps
    beta2: float | None = None
    eps: float | None = None


@dataclass(frozen=True)
class ScheduleSpec:
    """Learning-rate schedule over optimizer steps: constant, linear warmup, or warmup + cosine decay."""

    name: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0


@dataclass(frozen=True)
class TrainingSpec:
    """How long and how often: one round = ``sync_interval`` local batches, one all-reduce, one step.

    Exactly one of ``total_steps`` (optimizer steps, i.e. rounds) and ``epochs`` is set.

    ``mode = "local_sgd"`` (stored as ``mode``; sync mode is stored as no field at all, so the bytes
    and CIDs of tasks written before the option existed do not change): a round is ``inner_steps``
    local optimizer steps, then one all-reduce of the pseudo-gradient and one outer step
    (:mod:`p2ptrain.training._outer`); ``total_steps`` then counts outer steps.
    """

    batch_size: int
    sync_interval: int = 1
    total_steps: int | None = None
    epochs: float | None = None
    checkpoint_interval: int = 10
    eval_batch_size: int = 256
    mode: str | None = None  # None: "sync"
    inner_steps: int | None = None  # local_sgd only
    # True: a span's checkpoint is stored, recorded and attested while the next span trains
    # (training.rounds); None (stored as no field, like ``mode``): the next span waits for it.
    overlap_checkpoints: bool | None = None

    @property
    def local_sgd(self) -> bool:
        return self.mode == "local_sgd"

    @property
    def steps_per_round(self) -> int:
        """Local optimizer steps per round: ``inner_steps`` in local-SGD mode, else one."""
        return self.inner_steps if self.inner_steps is not None else 1


@dataclass(frozen=True)
class OuterSpec:
    """The outer optimizer of local-SGD mode, run identically by every member on the averaged
    pseudo-gradient: ``nesterov`` (SGD with Nesterov momentum, DiLoCo's choice) or ``average``
    (the members' mean model, federated averaging's; no lr or momentum)."""

    optimizer: str = "nesterov"
    lr: float | None = OUTER_LR
    momentum: float | None = OUTER_MOMENTUM
    # Seconds the outer all-reduce waits for the slowest member's inner loop (the slow-peer rule:
    # a deadline, not a weighted contribution; docs/training.md).
    wait_s: float = OUTER_WAIT_S


@dataclass(frozen=True)
class CompressionSpec:
    """Top-k sparsification of the gradient all-reduce (density 1.0 means dense).

    ``robust = "clip"`` defends the average against Byzantine members (scaled or sign-flipped
    contributions): whoever reduces a part clips every member's contribution to the median of their
    norms (docs/collective.md, "Byzantine members").
    """

    density: float = 0.01
    error_feedback: bool = True
    fp16_values: bool = False
    robust: str = "none"
    # "int8" or "2bit": the values travel quantized with a scale per chunk (wire/quantization.py).
    # None: as fp16_values says (``values = "fp16"`` is stored as fp16_values, "fp32" as neither,
    # so older tasks keep their bytes).
    values: str | None = None
    # Under robust = "clip": the share of chunks a verifier recomputes each round, drawn after the
    # owner signed its result (docs/collective.md, "Sampled verification"). None: every chunk (1.0).
    check_fraction: float | None = None


ACTIVATIONS = ("fp32", "fp16", "int8")  # pipeline.activations: how a stage boundary's tensors travel
STAGE_SUMS = ("dense", "sparse")  # pipeline.stage_sum: how a stage's replicas sum their gradients
# pipeline.balance: what the plans weigh each stage's replicas by ("recut": measured, and the cut moved by it too)
BALANCES = ("parameters", "measured", "recut")
MAX_STAGES = 64  # pipeline.stages: at most half of MAX_PEERS, so that every stage can have two replicas


@dataclass(frozen=True)
class PipelineSpec:
    """``[pipeline]``: the model cut into ``stages`` contiguous stages across the members, each member
    serving one (docs/pipeline.md). A task without the section has none (stored as no field at all,
    so the bytes and CIDs of data-parallel tasks do not change).

    ``activations``: how the tensors crossing a stage boundary travel (``wire.activations``: fp16
    halves them, int8 with a scale per 128 values quarters them). ``microbatch_size``: samples per
    microbatch; a stage-0 member drives its ``training.batch_size`` samples of a step as that many
    microbatches through the stages. ``check_fraction``: the share of microbatches that also go
    through a second replica of every later stage, whose outputs must be equal bit for bit (0 in
    local-SGD mode, where a stage's replicas differ between outer steps: docs/pipeline.md).
    ``copies``: how many of the following stages' checkpoint files each member keeps a copy of
    (run/_stage_copies.py), so that a run survives that many adjacent stages losing every replica
    between two checkpoints; None (absent from the task's bytes, as before it existed) is 1.
    ``stage_sum``: how the replicas of a stage sum their gradients at the end of a step: None (the
    default, ``"dense"``, absent from the task's bytes so that tasks written before the option keep
    their CID) the exact dense sum; ``"sparse"`` the data-parallel rounds' top-k with error feedback
    at the task's ``[compression]`` density (docs/pipeline.md, "A sparse stage sum").
    ``balance``: what the plans weigh a stage's need of replicas by: None (the default,
    ``"parameters"``, absent from the task's bytes) its parameter count; ``"measured"`` its step
    time as the drivers measured it, each driver's in its signed step summary entry and the median
    over drivers taken (docs/pipeline.md, "Replicas by measured time"); ``"recut"`` the same, and
    the plans may also move the cut itself by those times at a checkpoint (docs/pipeline.md,
    "Re-cutting by measured time").
    """

    stages: int
    microbatch_size: int
    activations: str = "fp16"
    check_fraction: float = 0.05
    copies: int | None = None
    stage_sum: str | None = None
    balance: str | None = None

    @property
    def sparse_sum(self) -> bool:
        """Whether a stage's replicas sum their gradients sparsely (``stage_sum = "sparse"``)."""
        return self.stage_sum == "sparse"

    @property
    def measured_balance(self) -> bool:
        """Whether the plans weigh stages by their measured step times (``balance = "measured"`` or
        ``"recut"``): the drivers' step summary entries then carry their times."""
        return self.balance in ("measured", "recut")

    @property
    def recut(self) -> bool:
        """Whether the plans may move the cut by the measured times (``balance = "recut"``)."""
        return self.balance == "recut"

    @property
    def stage_copies(self) -> int:
        """How many following stages' files a member keeps (``copies``, 1 when the task is silent)."""
        return 1 if self.copies is None else self.copies


@dataclass(frozen=True)
class PeersSpec:
    """How many members a round needs (``min``) and admits (``max``), and who may be one.

    ``admission = "allowlist"`` (with ``allow``, the peer IDs that may be members) closes the run:
    no other identity is planned, elected, counted in a quorum or believed in a chain, so made-up
    identities (Sybils) cannot outvote the members. ``"open"`` (stored as no field, so the bytes of
    tasks written before the option stay the same) admits any peer that meets the requirements;
    docs/security.md says what a quorum of open members proves and what it does not.
    """

    min: int = 1
    max: int = 64
    admission: str | None = None  # None: "open"
    allow: tuple[str, ...] | None = None  # admission = "allowlist" only

    def admits(self, peer: str) -> bool:
        """Whether ``peer`` may be a member of the run."""
        return self.allow is None or peer in self.allow


@dataclass(frozen=True)
class Requirements:
    """Where members train and what memory they need (MiB of RAM, or of GPU memory for CUDA).

    ``cpu`` (the default) runs every member on CPU, which any peer can; ``cuda`` admits CUDA peers
    only; ``any`` lets each member pick. Members that hold bitwise-identical weights must compute the
    optimizer step on the same kind of device, so ``any`` can make attestations fail between a CPU and
    a GPU member.
    """

    device: str = "cpu"
    min_memory_mb: int = 0


@dataclass(frozen=True)
class Task:
    """A validated task; build it with :func:`parse_task` / :func:`load_task` / :func:`task_from_bytes`."""

    name: str
    model: ModelSpec
    # None: each member trains on its own data (a run of the user's own module and loop).
    dataset: DatasetSpec | None
    # None for a run of the user's own module: its optimizer is the members' own, described in the
    # architecture card the model names.
    optimizer: OptimizerSpec | None
    training: TrainingSpec
    schedule: ScheduleSpec = ScheduleSpec()
    compression: CompressionSpec = CompressionSpec()
    peers: PeersSpec = PeersSpec()
    requirements: Requirements = Requirements()
    seed: int = 0
    initial_model: str | None = None
    outer: OuterSpec | None = None  # local-SGD mode only
    # The peer ID of the node that published the task (`task publish` fills it in when the file
    # leaves it out): the one key whose `task cancel` members obey. Part of the task's bytes, so
    # every member learns it from the task it fetched by CID, not from who happened to announce it.
    publisher: str | None = None
    pipeline: PipelineSpec | None = None  # None: every member holds the whole model (data parallel)


def unmet_requirement(task: Task, caps: Capabilities) -> str | None:
    """Why a peer with ``caps`` may not join ``task``, or None when it may."""
    req = task.requirements
    if task.pipeline is not None and req.device == "cuda":
        # The stage protocol carries CPU tensors (run/_stage_trainer.py): the stages train on the CPU.
        return f"it is cut into {task.pipeline.stages} pipeline stages, which this version trains on the CPU only"
    if req.device == "cuda" and caps.device != "cuda":
        return f"task needs a CUDA device, peer has {caps.device}"
    if req.device == "cuda" or (req.device == "any" and caps.device == "cuda"):
        memory, what = caps.gpu_memory_bytes or 0, "GPU memory"
    else:
        memory, what = caps.free_ram_bytes, "free RAM"
    if memory < req.min_memory_mb * 1024 * 1024:
        return f"task needs {req.min_memory_mb} MiB of {what}, peer has {memory // (1024 * 1024)} MiB"
    return None


def member_device(task: Task, option: str) -> str:
    """Where a member trains ``task``, given its node's ``--device`` (``auto``, ``cpu``, ``cuda``,
    ``cuda:N``): a ``cpu`` task on the CPU whatever the node would prefer (its members attest each
    other's bits, and a GPU's optimizer kernels round differently from the CPU's), a ``cuda`` task
    on the node's GPU (``auto``: the first; a node told ``cpu`` stays on the CPU and must not
    join it), an ``any`` task where the node says."""
    req = task.requirements.device
    if req == "cpu":
        return "cpu"
    if req == "cuda" and option == "auto":
        return "cuda"
    return option


def meets_requirements(task: Task, caps: Capabilities) -> bool:
    """Whether a peer with ``caps`` may join ``task`` (see :func:`unmet_requirement` for why not)."""
    return unmet_requirement(task, caps) is None


def total_steps(task: Task, train_samples: int, peers: int) -> int:
    """Rounds the task runs (optimizer steps; outer steps in local-SGD mode): ``total_steps`` or
    ``epochs`` worth of rounds over ``peers``."""
    if task.training.total_steps is not None:
        return task.training.total_steps
    per_round = task.training.batch_size * task.training.sync_interval * task.training.steps_per_round * max(1, peers)
    assert task.training.epochs is not None
    return max(1, math.ceil(task.training.epochs * train_samples / per_round))
