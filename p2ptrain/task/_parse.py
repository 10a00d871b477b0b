"""Reading a task: strict parsing of the TOML a person writes and of the canonical JSON bytes stored
by CID, into the :class:`~p2ptrain.task._spec.Task` of _spec.py, and the canonical bytes back.

Parsing is strict (unknown keys, wrong types and out-of-range values are errors that name the field)
because a task comes from another peer: it must not be able to smuggle in anything we did not plan
for, and a typo must not silently fall back to a default. Canonical bytes fill in every default and
sort keys, so the same task always has the same bytes and therefore the same CID on every peer.

Both decoders, :func:`load_task` (TOML) and :func:`task_from_bytes` (JSON by CID), raise one error,
:class:`TaskError`, for anything they refuse: text over :data:`MAX_TASK_BYTES`, nesting deeper than
:data:`MAX_TASK_DEPTH`, integers beyond ``task_fields.MAX_NUMBER`` (TOML and JSON both carry integers
of any size, and a float check of ``10**400`` overflows) and every field out of its range (checks: task_fields).
"""

from __future__ import annotations

import tomllib
from dataclasses import asdict
from typing import Any

from p2ptrain.base import boundedjson
from p2ptrain.models import (builds_by_piece, check_hf_config, check_model, HF_MODEL, MAX_PARAMETERS,
                             MAX_PIPELINED_PARAMETERS, MissingBuilder, ModelError, PartitionError, stage_sizes)
from p2ptrain.task import _fields as fields
from p2ptrain.task._fields import TaskError
from p2ptrain.task._spec import (
    ACTIVATIONS, BALANCES,
    MAX_PEER_ID_LEN,
    MAX_STAGES,
    ADMISSION,
    DEVICES,
    MAX_ALLOWED,
    MAX_PEERS,
    MAX_TASK_BYTES,
    MAX_TASK_DEPTH,
    MODES,
    OPTIMIZERS,
    OUTER_LR,
    OUTER_MOMENTUM,
    OUTER_OPTIMIZERS,
    OUTER_WAIT_S,
    ROBUST,
    SCHEDULES,
    STAGE_SUMS,
    VALUES,
    CompressionSpec,
    DatasetSpec,
    ModelSpec,
    OptimizerSpec,
    OuterSpec,
    PeersSpec,
    PipelineSpec,
    Requirements,
    ScheduleSpec,
    Task,
    TrainingSpec,
)


def parse_task(data: dict[str, Any]) -> Task:
    """Validate a task from its TOML/JSON table form; raise :class:`TaskError` naming the bad field."""
    if not isinstance(data, dict):
        raise TaskError("task: must be a table")
    fields.only(data, {"name", "seed", "initial_model", "publisher", "model", "dataset", "optimizer", "schedule",
                       "training", "outer", "compression", "peers", "requirements", "pipeline"}, "")
    name = fields.text(data, "name", "")
    seed = fields.integer(data, "seed", "", 0, 0, 2**32 - 1)
    initial_model = fields.cid(data, "initial_model", "", None)
    publisher = fields.text(data, "publisher", "", None, max_len=MAX_PEER_ID_LEN)

    try:
        model, unbuildable = _model(fields.table(data, "model", "", True), pipelined="pipeline" in data), None
    except NoBuilder as exc:  # the rest is checked all the same: the task may be sound
        model, unbuildable = exc.model, exc
    dataset = _dataset(data, required=not model.user)
    optimizer = _optimizer(data) if not model.user else None
    if model.user and "optimizer" in data:
        raise TaskError('optimizer: a run of the members\' own model ([model] name = "user") uses their own '
                        "optimizer, described in its architecture card")

    s = fields.table(data, "schedule", "", False)
    fields.only(s, {"name", "warmup_steps", "min_lr_ratio"}, "schedule.")
    schedule = ScheduleSpec(
        name=fields.choice(s, "name", "schedule.", SCHEDULES, "constant"),
        warmup_steps=fields.integer(s, "warmup_steps", "schedule.", 0, 0, 10**9),
        min_lr_ratio=fields.number(s, "min_lr_ratio", "schedule.", 0.0, 0.0, 1.0),
    )
    if schedule.name == "constant" and schedule.warmup_steps:
        raise TaskError("schedule.warmup_steps: a constant schedule has no warmup (use name = \"warmup\")")

    t = fields.table(data, "training", "", True)
    fields.only(t, {"batch_size", "sync_interval", "total_steps", "epochs", "checkpoint_interval",
              "eval_batch_size", "mode", "inner_steps", "overlap_checkpoints"}, "training.")
    mode = fields.choice(t, "mode", "training.", MODES, "sync")
    if mode == "local_sgd":
        inner_steps = fields.integer(t, "inner_steps", "training.", ..., 1, 10000)
    elif "inner_steps" in t:
        raise TaskError('training.inner_steps: only for mode = "local_sgd"')
    else:
        inner_steps = None
    training = TrainingSpec(
        batch_size=fields.integer(t, "batch_size", "training.", lo=1, hi=65536),
        sync_interval=fields.integer(t, "sync_interval", "training.", 1, 1, 10000),
        total_steps=fields.integer(t, "total_steps", "training.", None, 1, 10**9),
        epochs=fields.number(t, "epochs", "training.", None, 0.0, 10000.0, lo_open=True),
        checkpoint_interval=fields.integer(t, "checkpoint_interval", "training.", 10, 1, 10**6),
        eval_batch_size=fields.integer(t, "eval_batch_size", "training.", 256, 1, 65536),
        mode="local_sgd" if mode == "local_sgd" else None,
        inner_steps=inner_steps,
        overlap_checkpoints=fields.boolean(t, "overlap_checkpoints", "training.", False) or None,
    )
    outer = _outer(data, training)
    if (training.total_steps is None) == (training.epochs is None):
        raise TaskError("training.total_steps: set exactly one of training.total_steps and training.epochs")
    # The schedule runs over optimizer steps: in local-SGD mode the inner ones, H per outer step.
    if training.total_steps is not None and schedule.warmup_steps > training.total_steps * training.steps_per_round:
        raise TaskError("schedule.warmup_steps: longer than training.total_steps"
                        + (" x training.inner_steps" if training.local_sgd else ""))

    c = fields.table(data, "compression", "", False)
    fields.only(c, {"check_fraction", "density", "error_feedback", "fp16_values", "robust", "values"}, "compression.")
    compression = _compression(c)

    peers = _peers(fields.table(data, "peers", "", False))

    r = fields.table(data, "requirements", "", False)
    fields.only(r, {"device", "min_memory_mb"}, "requirements.")
    requirements = Requirements(
        device=fields.choice(r, "device", "requirements.", DEVICES, "cpu"),
        min_memory_mb=fields.integer(r, "min_memory_mb", "requirements.", 0, 0, 2**40),
    )
    pipeline = _pipeline(data, model, training, peers, compression, check_cut=unbuildable is None)
    task = Task(
        name=name, model=model, dataset=dataset, optimizer=optimizer, training=training,
        schedule=schedule, compression=compression, peers=peers, requirements=requirements,
        seed=seed, initial_model=initial_model, publisher=publisher, outer=outer, pipeline=pipeline,
    )
    if unbuildable is not None:
        unbuildable.task = task
        raise unbuildable
    return task


class NoBuilder(TaskError):
    """The task names a builder this node does not have (no installed package provides it): the task
    may be sound, this node just cannot build its model. ``line`` says what to install; ``task`` is
    the task with its model unchecked (set once the rest of it parsed), for what a node reads of a
    task it does not train: its chain's rules, its name, what its home keeps."""

    def __init__(self, missing: MissingBuilder, model: ModelSpec) -> None:
        super().__init__(str(missing))
        self.builder = missing.name
        self.line = missing.line
        self.model = model
        self.task: Task | None = None


def _model(m: dict[str, Any], pipelined: bool) -> ModelSpec:
    """``[model]``: a registry builder and its checked kwargs, or ``name = "user"`` with its
    ``architecture`` card's CID. A ``pipelined`` task's model built by piece may outgrow one member
    (its stages may not: :func:`_pipeline`)."""
    fields.only(m, {"name", "kwargs", "architecture", "config"}, "model.")
    kwargs_t = fields.table(m, "kwargs", "model.", False)
    if len(kwargs_t) > 32:
        raise TaskError("model.kwargs: more than 32 arguments")
    name = fields.text(m, "name", "model.")
    missing: MissingBuilder | None = None
    config = None
    if name == HF_MODEL:
        try:
            config = _hf_config(m)
        except MissingBuilder as exc:  # no transformers here: the table as it is, for reading only
            config, missing = dict(sorted(fields.table(m, "config", "model.", True).items())), exc
    if config is None and "config" in m:
        raise TaskError(f'model.config: only for name = "{HF_MODEL}" (other builders take model.kwargs)')
    model = ModelSpec(
        name=name,
        kwargs={k: fields.kwarg_value(v, f"model.kwargs.{k}") for k, v in sorted(kwargs_t.items())},
        architecture=fields.cid(m, "architecture", "model.", None),
        config=config,
    )
    if model.user:
        if model.architecture is None:
            raise TaskError('model.architecture: a run of the members\' own model ([model] name = "user") names '
                            "its architecture card by CID")
        if model.kwargs:
            raise TaskError('model.kwargs: not for name = "user" (the members build their own module)')
        return model
    if model.architecture is not None:
        raise TaskError('model.architecture: only for name = "user"')
    if config is not None and model.kwargs:
        raise TaskError(f'model.kwargs: not for name = "{HF_MODEL}" (its settings go in model.config)')
    if missing is not None:
        raise NoBuilder(missing, model)
    try:
        by_piece = pipelined and builds_by_piece(model.name)
        check_model(model.name, model.arguments, MAX_PIPELINED_PARAMETERS if by_piece else MAX_PARAMETERS)
    except MissingBuilder as exc:
        raise NoBuilder(exc, model) from None
    except ModelError as exc:
        raise TaskError(str(exc)) from None
    return model


def _hf_config(m: dict[str, Any]) -> dict[str, Any]:
    """``[model] config`` of an hf model: a table of scalars and short lists, checked for what it
    names by :func:`p2ptrain.models.check_model` (models._hf)."""
    config = fields.table(m, "config", "model.", True)
    try:
        return check_hf_config(config)
    except MissingBuilder:
        raise  # no transformers here: the caller keeps the task readable
    except ModelError as exc:
        raise TaskError(str(exc)) from None


def _dataset(data: dict[str, Any], required: bool) -> DatasetSpec | None:
    """``[dataset]``: a manifest by CID and its split names; only a run of the user's own model may
    have none (each member trains on its own data)."""
    if not required and "dataset" not in data:
        return None
    d = fields.table(data, "dataset", "", True)
    fields.only(d, {"manifest", "train_split", "test_split"}, "dataset.")
    return DatasetSpec(
        manifest=fields.cid(d, "manifest", "dataset."),
        train_split=fields.text(d, "train_split", "dataset.", "train"),
        test_split=fields.text(d, "test_split", "dataset.", "test"),
    )


def _optimizer(data: dict[str, Any]) -> OptimizerSpec:
    """``[optimizer]``: the task's optimizer, which every member runs identically."""
    o = fields.table(data, "optimizer", "", True)
    fields.only(o, {"name", "lr", "momentum", "weight_decay", "beta1", "beta2", "eps"}, "optimizer.")
    opt_name = fields.choice(o, "name", "optimizer.", OPTIMIZERS)
    if opt_name == "sgd":
        extra = sorted({"beta1", "beta2", "eps"} & set(o))
        if extra:
            raise TaskError(f"optimizer.{extra[0]}: only for adam/adamw")
        return OptimizerSpec(
            name=opt_name,
            lr=fields.number(o, "lr", "optimizer.", lo=0.0, hi=10.0, lo_open=True),
            weight_decay=fields.number(o, "weight_decay", "optimizer.", 0.0, 0.0, 1.0),
            momentum=fields.number(o, "momentum", "optimizer.", 0.0, 0.0, 0.999),
        )
    if "momentum" in o:
        raise TaskError(f"optimizer.momentum: only for sgd ({opt_name} uses beta1/beta2)")
    return OptimizerSpec(
        name=opt_name,
        lr=fields.number(o, "lr", "optimizer.", lo=0.0, hi=10.0, lo_open=True),
        weight_decay=fields.number(o, "weight_decay", "optimizer.", 0.0, 0.0, 1.0),
        beta1=fields.number(o, "beta1", "optimizer.", 0.9, 0.0, 0.9999),
        beta2=fields.number(o, "beta2", "optimizer.", 0.999, 0.0, 0.99999),
        eps=fields.number(o, "eps", "optimizer.", 1e-8, 0.0, 1.0, lo_open=True),
    )


def _peers(p: dict[str, Any]) -> PeersSpec:
    """``[peers]``: the member bounds and, with ``admission = "allowlist"``, who may be a member."""
    fields.only(p, {"min", "max", "admission", "allow"}, "peers.")
    lo = fields.integer(p, "min", "peers.", 1, 1, MAX_PEERS)
    hi = fields.integer(p, "max", "peers.", 64, 1, MAX_PEERS)
    if hi < lo:
        raise TaskError(f"peers.max: must be >= peers.min ({lo})")
    admission = fields.choice(p, "admission", "peers.", ADMISSION, "open")
    if admission == "open":
        if "allow" in p:
            raise TaskError('peers.allow: only with admission = "allowlist"')
        return PeersSpec(min=lo, max=hi)
    allow = fields.peer_ids(p, "allow", "peers.", MAX_ALLOWED)
    if len(allow) < lo:
        raise TaskError(f"peers.allow: {len(allow)} peers can never make peers.min = {lo} members")
    return PeersSpec(min=lo, max=hi, admission=admission, allow=allow)


def _outer(data: dict[str, Any], training: TrainingSpec) -> OuterSpec | None:
    """``[outer]``: only in local-SGD mode, where it defaults to DiLoCo's Nesterov (0.7, 0.9)."""
    o = fields.table(data, "outer", "", False)
    if not training.local_sgd:
        if "outer" in data:
            raise TaskError('outer: only for training.mode = "local_sgd"')
        return None
    fields.only(o, {"optimizer", "lr", "momentum", "wait_s"}, "outer.")
    name = fields.choice(o, "optimizer", "outer.", OUTER_OPTIMIZERS, "nesterov")
    wait_s = fields.number(o, "wait_s", "outer.", OUTER_WAIT_S, 1.0, 3600.0)
    if name == "average":
        extra = sorted({"lr", "momentum"} & set(o))
        if extra:
            raise TaskError(f'outer.{extra[0]}: not for optimizer = "average" (the mean model is taken as is)')
        return OuterSpec(optimizer=name, lr=None, momentum=None, wait_s=wait_s)
    return OuterSpec(
        optimizer=name, wait_s=wait_s,
        lr=fields.number(o, "lr", "outer.", OUTER_LR, 0.0, 10.0, lo_open=True),
        momentum=fields.number(o, "momentum", "outer.", OUTER_MOMENTUM, 0.0, 0.999),
    )


def _pipeline(
    data: dict[str, Any], model: ModelSpec, training: TrainingSpec, peers: PeersSpec, compression: CompressionSpec,
    check_cut: bool,
) -> PipelineSpec | None:
    """``[pipeline]``: the model cut into stages across the members (docs/pipeline.md), checked
    here: the model must be one that can be cut into that many stages (on the meta device, when this
    node has its builder: ``check_cut``), no stage may hold more than the ``MAX_PARAMETERS`` one
    member holds, every stage needs a member, and a step's samples split into whole microbatches."""
    if "pipeline" not in data:
        return None
    p = fields.table(data, "pipeline", "", True)
    fields.only(p, {"stages", "microbatch_size", "activations", "check_fraction", "copies", "stage_sum", "balance"}, "pipeline.")
    stages = fields.integer(p, "stages", "pipeline.", ..., 2, MAX_STAGES)
    spec = PipelineSpec(
        stages=stages,
        microbatch_size=fields.integer(p, "microbatch_size", "pipeline.", training.batch_size, 1, 65536),
        activations=fields.choice(p, "activations", "pipeline.", ACTIVATIONS, "fp16"),
        check_fraction=fields.number(p, "check_fraction", "pipeline.", 0.0 if training.local_sgd else 0.05, 0.0, 1.0),
        copies=fields.integer(p, "copies", "pipeline.", None, 1, stages - 1),
        # The defaults are stored as no field: a task that names one has the bytes of one silent on it.
        stage_sum="sparse" if fields.choice(p, "stage_sum", "pipeline.", STAGE_SUMS, "dense") == "sparse" else None,
        balance=None if (balance := fields.choice(p, "balance", "pipeline.", BALANCES, "parameters")) == "parameters"
        else balance,
    )
    if spec.sparse_sum and not (compression.error_feedback and compression.density < 1.0):
        raise TaskError('pipeline.stage_sum: "sparse" needs compression.error_feedback = true and compression.density '
                        "< 1 (what a replica does not send stays in its residual for its next step)")
    if training.batch_size % spec.microbatch_size:
        raise TaskError(f"pipeline.microbatch_size: {spec.microbatch_size} does not divide training.batch_size "
                        f"({training.batch_size}) into whole microbatches")
    if peers.min < spec.stages:
        raise TaskError(f"pipeline.stages: {spec.stages} stages need peers.min >= {spec.stages} (each member "
                        f"serves one stage; peers.min is {peers.min})")
    if model.user:
        raise TaskError('pipeline: not for a run of the members\' own model ([model] name = "user"): the cut is '
                        "checked from a registry model's builder")
    if training.local_sgd and spec.check_fraction > 0:
        raise TaskError('pipeline.check_fraction: 0 with training.mode = "local_sgd" (a second opinion compares two '
                        "replicas' answers bit for bit, and a stage's replicas hold the same weights only at outer steps)")
    if check_cut:
        try:
            sizes = stage_sizes(model.name, model.arguments, spec.stages)
        except PartitionError as exc:
            raise TaskError(f"pipeline.stages: {exc}") from None
        largest = max(sizes)
        if largest > MAX_PARAMETERS:  # what one member holds: the cap of a model no stage cuts
            raise TaskError(f"pipeline.stages: stage {sizes.index(largest)} would hold {largest:,} parameters, over "
                            f"the {MAX_PARAMETERS:,} one member holds (cut into more stages)")
    return spec


def _compression(c: dict[str, Any]) -> CompressionSpec:
    density = fields.number(c, "density", "compression.", 0.01, 0.0, 1.0, lo_open=True)
    error_feedback = fields.boolean(c, "error_feedback", "compression.", True)
    fp16 = fields.boolean(c, "fp16_values", "compression.", False)
    robust = fields.choice(c, "robust", "compression.", ROBUST, "none")
    values = fields.choice(c, "values", "compression.", VALUES, "fp16" if fp16 else "fp32")
    if fp16 and values != "fp16":
        raise TaskError(f'compression.values: "{values}" contradicts fp16_values = true')
    if values in ("int8", "2bit"):
        if density >= 1.0:
            raise TaskError(f'compression.values: "{values}" quantizes sparse values; it needs density < 1')
        if not error_feedback:
            raise TaskError(f'compression.values: "{values}" needs error_feedback = true (it keeps what '
                            "the quantization drops)")
    # Stored only below 1.0 (absent and 1.0 are every chunk), so tasks that check every chunk keep their bytes.
    check_fraction = fields.number(c, "check_fraction", "compression.", None, 0.0, 1.0, lo_open=True)
    if check_fraction == 1.0:
        check_fraction = None
    if check_fraction is not None and (robust != "clip" or values in ("int8", "2bit")):
        raise TaskError('compression.check_fraction: samples the chunks that owners reduce under robust = "clip"; '
                        "it needs that, and values that are not quantized (those have no owner)")
    return CompressionSpec(
        density=density, error_feedback=error_feedback, fp16_values=values == "fp16", robust=robust,
        values=values if values in ("int8", "2bit") else None, check_fraction=check_fraction,
    )


def load_task(text: str | bytes) -> Task:
    """Parse and validate a task from TOML text; :class:`TaskError` for anything we refuse."""
    size = len(text) if isinstance(text, bytes) else len(text.encode(errors="surrogatepass"))
    if size > MAX_TASK_BYTES:
        raise TaskError(f"task: {size} B is over the {MAX_TASK_BYTES} B limit")
    if isinstance(text, bytes):
        try:
            text = text.decode()
        except UnicodeDecodeError as exc:
            raise TaskError(f"task: not UTF-8 ({exc})") from None
    try:
        data = tomllib.loads(text)
    except ValueError as exc:  # TOMLDecodeError, and an integer of over 4,300 digits
        raise TaskError(f"task: not valid TOML ({exc})") from None
    except RecursionError:
        # tomllib recurses per nested array or inline table; within MAX_TASK_BYTES the recursion
        # ends at the interpreter's limit, cleanly, and the text is simply not a task.
        raise TaskError("task: nested too deeply") from None
    return parse_task(data)


def _plain(task: Task) -> dict[str, Any]:
    """The table form with every default filled in and absent optionals left out."""

    def drop_none(obj: Any) -> Any:
        if isinstance(obj, dict):
            return {k: drop_none(v) for k, v in obj.items() if v is not None}
        return obj

    return drop_none(asdict(task))  # type: ignore[no-any-return]


def task_bytes(task: Task) -> bytes:
    """Canonical JSON bytes of a task (sorted keys, defaults filled in): store these by CID."""
    return boundedjson.canonical(_plain(task)) + b"\n"


def task_from_bytes(data: bytes) -> Task:
    """Validate task bytes fetched by CID and insist they are canonical (one task, one CID)."""
    if len(data) > MAX_TASK_BYTES:
        raise TaskError(f"task: {len(data)} B is over the {MAX_TASK_BYTES} B limit")
    try:
        plain = boundedjson.loads(data, max_depth=MAX_TASK_DEPTH, what="task")
    except boundedjson.JSONBoundsError as exc:
        raise TaskError(str(exc)) from None
    try:
        task = parse_task(plain)
    except NoBuilder as exc:
        assert exc.task is not None
        if task_bytes(exc.task) != data:
            raise TaskError("task: bytes are not in canonical form") from None
        raise
    if task_bytes(task) != data:
        raise TaskError("task: bytes are not in canonical form")
    return task


def read_task(data: bytes) -> Task:
    """Task bytes fetched by CID, as :func:`task_from_bytes` checks them, also when this node lacks
    the task's builder (its model unchecked): for the readers that never build it (a chain's rules,
    `model verify`, what a home keeps). A node that trains the task uses :func:`task_from_bytes`."""
    try:
        return task_from_bytes(data)
    except NoBuilder as exc:
        assert exc.task is not None
        return exc.task
