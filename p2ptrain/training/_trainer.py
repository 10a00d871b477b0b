"""The local side of a round: local gradients in, one identical optimizer step out.

Choice: *gradient averaging with accumulation*, not DiLoCo-style model deltas. A round is
``sync_interval`` local forward/backward passes whose gradients are accumulated (mean), one all-reduce
of that flat gradient (the injected ``average``, in practice the sparse ring all-reduce with error
feedback), and one optimizer step with the averaged gradient. Why: the optimizer then runs on every
member with the same input from the same state, so every honest member holds bitwise-identical weights
and optimizer state after every round, which is what lets members attest a published model CID by
hashing their own weights, and lets a late joiner resume exactly from a checkpoint. Top-k with error
feedback is also analysed for gradients (Karimireddy et al. 2019), which keeps its guarantees here.
The cost is one all-reduce per optimizer step; ``sync_interval`` trades that against batch size.

The contract on ``average(flat, round_id)``: it returns the *mean* over the round's members, and the
very same tensor (bitwise) on every member. Anything non-finite is handled identically everywhere:
a member whose own gradient is not finite contributes zeros (and logs it); an averaged gradient that
is not finite is skipped by every member alike (the step counter still advances).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from p2ptrain.base import all_finite
from p2ptrain.training._batches import Batch, Metrics, evaluate_batches, loss_and_hits
from p2ptrain.training._trainer_error import DeviceError, TrainerError as TrainerError  # re-exported: callers catch it here
from p2ptrain.models import HEADER_PER_TENSOR, HEADER_SLACK, build_model, file_bytes_bound
from p2ptrain.training._optimizers import build_optimizer, lr_at
from p2ptrain.training._trainer_state import (OPTIMIZER_STATE_KEYS, StateSnapshot, optimizer_state,
                                             optimizer_tensors)
from p2ptrain.protocol import RecordError, model_bytes, model_tensors, read_tensors, tensors_bytes
from p2ptrain.task import Task

log = logging.getLogger(__name__)

Average = Callable[[torch.Tensor, int], Awaitable[torch.Tensor]]

PRECISIONS = ("fp32", "bf16", "fp16")
# fp16 autocast needs loss scaling to keep small gradients from flushing to zero. A fixed scale is
# used (not torch's dynamic GradScaler) because the scale must be the same on every member.
FP16_LOSS_SCALE = 1024.0
# A fresh classifier's cross-entropy is about log(num_classes) (uniform guesses); a local loss over
# LOSS_WARN_FACTOR times that in the first LOSS_WARN_STEPS steps means the inputs are on a scale the
# model cannot start from (raw tabular features: losses of 25-72 on a 2-class CSV), so the log says
# once per trainer that the features may need ``dataset add --standardize``.
LOSS_WARN_FACTOR = 10.0
LOSS_WARN_STEPS = 10


@dataclass(frozen=True)
class StepResult:
    """What one synchronised step did: local loss before it, whether the averaged gradient was used."""

    step: int
    local_loss: float
    lr: float
    applied: bool


def resolve_device(device: str) -> torch.device:
    """``auto`` picks CUDA when available, else CPU; ``cpu``/``cuda``/``cuda:N`` are taken as given.
    Anything else is a :class:`DeviceError` naming the device (``node start`` and ``serve`` check
    their ``--device`` with it before anything starts)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:  # torch's own parse error ("gpu", "cuda:x"): a traceback for a typo
        raise DeviceError("{device:{value!r}}: use auto, cpu, cuda or cuda:N", value=device) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError("{device:{value!r}} asked for, but CUDA is not available", value=device)
    if dev.type not in ("cpu", "cuda"):
        raise DeviceError("{device:{value!r}}: only cpu, cuda and auto are supported", value=device)
    return dev


def module_device(model: nn.Module) -> torch.device:
    """Where ``model``'s first parameter (else buffer) lives; the CPU for a module with neither."""
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


class Trainer:
    """One member's model, optimizer and step counter for a task.

    A round is :meth:`compute_gradient` (local, keeps the result until it is used), the average of
    :attr:`pending` over the round's members, then :meth:`apply`; :func:`p2ptrain.training.run_round`
    does the three. If a round fails after some members applied its step, :meth:`rollback` undoes the
    last step (one step of history is kept: a copy of weights and optimizer state, i.e. about twice the
    model's memory with Adam), and the round can be retried with the gradient already computed.
    """

    def __init__(
        self,
        task: Task,
        *,
        total_steps: int | None = None,
        device: str | None = "auto",
        precision: str = "fp32",
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        if precision not in PRECISIONS:
            raise TrainerError(f"precision {precision!r}: must be one of {', '.join(PRECISIONS)}")
        if device is None and model is None:
            raise TrainerError("device None means where the given model is: give the model")
        self.task = task
        # None: the given model stays where its owner put it (a user's module, under the user's loop).
        self.device = resolve_device(device) if device is not None else module_device(model)  # type: ignore[arg-type]
        if precision == "fp16" and self.device.type != "cuda":
            raise TrainerError("precision fp16 needs a CUDA device (use bf16 on CPU)")
        self.precision = precision
        steps = total_steps if total_steps is not None else task.training.total_steps
        if steps is None:
            raise TrainerError("the task gives epochs, so the trainer needs total_steps (see task.total_steps)")
        self.total_steps = steps
        if model is None:
            model = build_model(task.model.name, task.model.arguments, task.seed)
        self.model = model.to(self.device) if device is not None else model
        self.params = list(self.model.parameters())
        self.optimizer = optimizer if optimizer is not None else build_optimizer(task, self.params)
        self.step = 0
        self.pending: torch.Tensor | None = None
        self.pending_loss = math.nan
        self._snapshot: tuple[int, dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None
        self._snapshot_buffers: dict[str, torch.Tensor] = {}
        self.warned_loss = False  # the enormous-first-loss warning was given (once per trainer)

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.params)

    @property
    def can_roll_back(self) -> bool:
        """Whether the state before the last step is kept (see :meth:`rollback`)."""
        return self._snapshot is not None

    @property
    def batches_per_step(self) -> int:
        """Batches one step's gradient takes: ``sync_interval``."""
        return self.task.training.sync_interval

    @property
    def batch_position(self) -> int:
        """Where the batches of the next gradient start in this member's stream of batches
        (:class:`~p2ptrain.training.PositionedBatches`): a function of the step alone (the
        pending gradient, kept for a retry, took its step's batches already)."""
        return (self.step + (self.pending is not None)) * self.batches_per_step

    @property
    def done(self) -> bool:
        return self.step >= self.total_steps

    def _autocast(self) -> torch.autocast:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision, torch.float32)
        return torch.autocast(self.device.type, dtype=dtype, enabled=self.precision != "fp32")

    # --- the round -------------------------------------------------------------------------

    def compute_gradient(self, batches: Iterator[Batch]) -> torch.Tensor:
        """Take ``sync_interval`` batches, accumulate their mean gradient; return it flat (fp32, CPU).

        The result is also kept as :attr:`pending` until :meth:`apply` uses it, so a failed all-reduce
        can be retried without consuming more data.
        """
        loss = self.backward(batches)
        flat = torch.cat([
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in self.params
        ]).cpu()
        if not all_finite(flat):
            log.warning("step %d: local gradient is not finite (loss %.4g); contributing zeros", self.step, loss)
            flat.zero_()
        self.pending, self.pending_loss = flat, loss
        return flat

    def backward(self, batches: Iterator[Batch]) -> float:
        """Accumulate the mean gradient of ``sync_interval`` batches into the parameters' ``.grad``
        (unscaled, fp32 loss scaling undone); return the mean local loss."""
        k = self.task.training.sync_interval
        scale = FP16_LOSS_SCALE if self.precision == "fp16" else 1.0
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total, classes = 0.0, 0
        for i in range(k):
            try:
                x, y = next(batches)
            except StopIteration:
                raise TrainerError(f"the data ran out during local step {i + 1} of {k}") from None
            x, y = x.to(self.device), y.to(self.device)
            with self._autocast():
                logits = self.model(x)
            loss, _hits, _n = loss_and_hits(logits, y)
            (loss * (scale / k)).backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
            total += float(loss.detach())
            classes = logits.shape[-1]
        self._check_first_loss(total / k, classes)
        if scale != 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.div_(scale)
        return total / k

    def _check_first_loss(self, loss: float, classes: int) -> None:
        """Warn (once) when an early loss is enormous for ``classes`` classes: see LOSS_WARN_FACTOR."""
        if self.warned_loss or self.step >= LOSS_WARN_STEPS or classes < 2 or not math.isfinite(loss):
            return
        limit = LOSS_WARN_FACTOR * math.log(classes)
        if loss > limit:
            self.warned_loss = True
            log.warning("step %d: local loss %.4g is over %.0fx log(%d classes) = %.3g this early: the features "
                        "may need --standardize (p2ptrain dataset add --standardize)", self.step, loss,
                        LOSS_WARN_FACTOR, classes, limit)

    def apply(self, averaged: torch.Tensor) -> StepResult:
        """One optimizer step with the members' mean gradient; every member computes the same update."""
        if averaged.shape != (self.num_parameters,):
            raise TrainerError(f"averaged gradient has shape {tuple(averaged.shape)}, expected ({self.num_parameters},)")
        self._take_snapshot()
        applied = all_finite(averaged)
        lr = self._schedule_lr(applied)
        if applied:
            offset = 0
            for p in self.params:
                n = p.numel()
                # A view (on the CPU): the optimizers read gradients without writing them, and a
                # model-sized copy every step costs page faults.
                p.grad = averaged[offset : offset + n].view_as(p).to(device=p.device, dtype=p.dtype)
                offset += n
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        else:
            log.warning("step %d: averaged gradient is not finite; every member skips this step", self.step)
        result = StepResult(step=self.step, local_loss=self.pending_loss, lr=lr, applied=applied)
        self.step += 1
        self.pending = None
        return result

    def _schedule_lr(self, applied: bool) -> float:
        """The learning rate of this step, from the task's schedule, set on the optimizer when the step
        is ``applied`` (a run of the user's own optimizer keeps the user's rates)."""
        lr = lr_at(self.task, self.step, self.total_steps)
        if applied:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        return lr

    def _take_snapshot(self) -> None:
        """Keep the state before a step, for :meth:`rollback`, in the previous snapshot's tensors:
        allocating a model-sized state afresh at every step costs page faults (23 ms a step for an
        MLP of 4.3M parameters with Adam, against 6 ms for the copies alone).

        A GPU's tensors go to page-locked memory, not waited for (the step's kernels queue after
        the copies on the same stream; :meth:`rollback` waits): waited-for pageable copies took most
        of a step's apply on a GPU (docs/benchmarks.md#a-members-step-on-a-gpu)."""
        buffers = self._snapshot_buffers

        def keep(name: str, value: torch.Tensor) -> torch.Tensor:
            buf = buffers.get(name)
            if buf is None or buf.shape != value.shape or buf.dtype != value.dtype:
                buf = buffers[name] = torch.empty(value.shape, dtype=value.dtype, pin_memory=value.is_cuda)
            return buf.copy_(value.detach(), non_blocking=value.is_cuda and buf.is_pinned())

        self._snapshot = (
            self.step,
            # A pipelined member's freed stages (on the meta device) have nothing to keep.
            {k: keep(f"model.{k}", v) for k, v in self.model.state_dict().items() if not v.is_meta},
            self.optimizer_tensors(keep),
        )

    def rollback(self) -> None:
        """Undo the last :meth:`apply` (its gradient is not kept: recompute or keep the flat copy)."""
        if self._snapshot is None:
            raise TrainerError("nothing to roll back")
        step, model_t, optim_t = self._snapshot
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the snapshot's copies were queued, not waited for
        self._load_tensors(model_t, optim_t, step)
        self._snapshot = None
        self._snapshot_buffers = {}  # the optimizer's state may now be these very tensors

    def can_align(self, plan_step: int) -> bool:
        """Whether :meth:`align` can bring the trainer to ``plan_step``."""
        return self.step == plan_step or (
            self.step == plan_step + 1 and self._snapshot is not None and self._snapshot[0] == plan_step
        )

    def align(self, plan_step: int) -> None:
        """Make the trainer be at ``plan_step`` before a round: roll back one step if a failed round
        was applied here but retried by the coordinator; anything else means resync from a checkpoint."""
        if not self.can_align(plan_step):
            raise TrainerError(f"trainer is at step {self.step}, the round starts at step {plan_step}: resync")
        if self.step == plan_step + 1:
            self.rollback()

    # --- buffers (BatchNorm's running statistics, ...) ------------------------------------------

    def buffer_vector(self) -> torch.Tensor | None:
        """The model's buffers (state that is not a parameter: running means, counters) as one flat
        float32 vector, None when it has none. Members update them from their own data, so they are
        averaged at every checkpoint (:meth:`load_buffer_vector`): the checkpoint's bytes, which
        every member hashes, must be the same everywhere."""
        params = {name for name, _ in self.model.named_parameters()}
        buffers = [t for name, t in self.model.state_dict().items() if name not in params]
        if not buffers:
            return None
        return torch.cat([t.detach().reshape(-1).to(device="cpu", dtype=torch.float32) for t in buffers])

    def load_buffer_vector(self, flat: torch.Tensor) -> None:
        """Set the buffers from :meth:`buffer_vector`'s layout (integer buffers rounded)."""
        params = {name for name, _ in self.model.named_parameters()}
        offset = 0
        with torch.no_grad():
            for name, tensor in self.model.state_dict().items():
                if name in params:
                    continue
                n = tensor.numel()
                part = flat[offset : offset + n].view_as(tensor)
                if not tensor.is_floating_point():
                    part = part.round()
                tensor.copy_(part.to(dtype=tensor.dtype))
                offset += n

    def release_span(self) -> None:
        """The span's checkpoint is taken (its state serialized): a trainer driven by the user's loop
        lets the user's last step of the span return only now (:mod:`p2ptrain.training._user_trainer`)."""

    # --- evaluation --------------------------------------------------------------------------

    def evaluate(self, batches: Iterable[Batch]) -> Metrics:
        """Mean loss and accuracy over ``batches`` (e.g. ``batched(test_dataset, eval_batch_size)``)."""
        return evaluate_batches(self.model, batches, self.device, self._autocast)

    def evaluate_own(self) -> dict[str, float]:
        """The metrics of a run whose members bring their own data (none here: a task's trainer is
        evaluated on the task's test split)."""
        return {}

    def evaluate_snapshot(self, snapshot: StateSnapshot, batches: Iterable[Batch]) -> Metrics:
        """:meth:`evaluate` of the weights in ``snapshot``, while this trainer's own module may be
        in a later step: the snapshot's module (built on the meta device) takes its tensors
        themselves (no copy on CPU)."""
        module = snapshot.module
        module.load_state_dict(snapshot.model, strict=True, assign=True)
        return evaluate_batches(module.to(self.device), batches, self.device, self._autocast)

    # --- state as bytes -----------------------------------------------------------------------

    def model_tensors(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def optimizer_tensors(
        self, copy: Callable[[str, torch.Tensor], torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """Optimizer state as named tensors (``state.<param index>.<key>``) plus the step counter,
        each a copy (``copy(name, tensor)`` makes it; default a fresh CPU clone)."""
        return optimizer_tensors(self.optimizer, self.step, copy)

    def model_bytes(self) -> bytes:
        """Deterministic safetensors of the weights (with the architecture's card): the bytes a model CID names."""
        return model_bytes(self.model, self._card())

    def optimizer_bytes(self) -> bytes:
        """Deterministic safetensors of the optimizer state and step: what a late joiner resumes from."""
        return tensors_bytes(self.optimizer_tensors())

    def snapshot(self) -> StateSnapshot:
        """Copies of the weights and the optimizer state now, to serialize later (off the training's
        path, while the next span changes the originals): one copy of each tensor, where
        :meth:`model_bytes` and :meth:`optimizer_bytes` make two of the optimizer's and the
        serialization's own work. Its bytes are the ones those give at this step."""
        # The module to evaluate it with, on the meta device: no memory, no initialisation, and
        # built now, while this trainer is idle (build_model seeds torch's global generator).
        with torch.device("meta"):
            module = build_model(self.task.model.name, self.task.model.arguments, self.task.seed)
        return StateSnapshot(self.step, self.model_tensors(), self.optimizer_tensors(), self._card(), module)

    def _card(self) -> dict[str, Any]:
        return {"name": self.task.model.name, "kwargs": self.task.model.arguments}

    def optimizer_state_keys(self) -> frozenset[str]:
        """The per-parameter state keys this trainer's optimizer keeps (what an optimizer file may
        name, and how many model-sized tensors it may hold per parameter)."""
        assert self.task.optimizer is not None, "a task of the registry names its optimizer"
        return frozenset(OPTIMIZER_STATE_KEYS[self.task.optimizer.name])

    def model_limit(self) -> int:
        """The most bytes an honest model file of this architecture can take."""
        return file_bytes_bound(self.model.state_dict().values())

    def state_limits(self) -> tuple[int, int]:
        """The most bytes an honest (model, optimizer) checkpoint of this architecture can take:
        the bound for reading a checkpoint named by a peer, before anything is parsed."""
        return self.model_limit(), self.optimizer_limit(self.params)

    def optimizer_limit(self, params: Iterable[torch.Tensor]) -> int:
        """The most bytes an honest optimizer file of ``params``' state takes: each state key of the
        optimizer at most once per parameter and at most as large as it (a scalar "step" takes 8
        bytes, inside its header allowance); plus trainer.step."""
        keys = len(self.optimizer_state_keys())
        return keys * sum(p.numel() * p.element_size() + HEADER_PER_TENSOR for p in params) + HEADER_SLACK + HEADER_PER_TENSOR + 8

    def load_state(self, model_data: bytes, optimizer_data: bytes) -> None:
        """Resume from a checkpoint's bytes (checked against the architecture and the optimizer)."""
        optim_t = read_tensors(optimizer_data)
        step_t = optim_t.pop("trainer.step", None)
        if step_t is None or step_t.dtype != torch.int64 or step_t.numel() != 1:
            raise RecordError("optimizer file has no valid trainer.step")
        # Both files checked before either is loaded: a bad optimizer file leaves the model as it was.
        self._load_tensors(model_tensors(self.model, model_data), optim_t, int(step_t))
        self._snapshot = None  # the step before a checkpoint is not ours to return to

    def _load_tensors(
        self, model_t: dict[str, torch.Tensor] | None, optim_t: dict[str, torch.Tensor], step: int
    ) -> None:
        state = optimizer_state(optim_t, self.params, self.optimizer_state_keys())  # checked first
        if model_t is not None:
            self.model.load_state_dict(model_t, strict=True)
        sd = self.optimizer.state_dict()
        sd["state"] = state
        self.optimizer.load_state_dict(sd)
        self.step = step
        self.pending = None
