"""The trainer of a run of the user's own module, driven by the user's own loop.

A node-run task computes its gradients itself (:meth:`Trainer.compute_gradient` over the task's
shards). Here the user's loop does: ``loss.backward(); opt.step()`` in the user's thread. The round
loop (in the node's trio thread, its compute step in a worker thread) and the user's thread meet
in a :class:`GradientBridge`:

1. ``opt.step()`` flattens the parameters' gradients and hands them over (:meth:`GradientBridge.submit`),
   then waits;
2. the round loop's compute step takes them as the round's pending gradient
   (:meth:`UserTrainer.compute_gradient`), the ring averages them with the other members' as for any
   task, and :meth:`UserTrainer.apply` runs the user's optimizer on the average, the one identical
   step on every member;
3. the user's ``opt.step()`` returns.

So between two ``opt.step()`` calls nothing but the user's forward and backward touches the model,
and the round loop touches it only while the user waits: no lock is needed. A round that fails keeps
the gradient for its retry (the user keeps waiting); a member that has to load the run's state by CID
(it fell behind) drops the gradient and releases the user with that news (the weights changed under
it). In local-SGD mode the user's ``opt.step()`` is an inner step, applied at once by the user's own
optimizer, and every H-th one hands the pseudo-gradient over instead (:class:`UserLocalSGDTrainer`).

The learning rate is the user's: :meth:`UserTrainer.apply` does not set it (a node-run task's
schedule does). A schedule must then be the same function of the run's step on every member,
e.g. ``LambdaLR(inner, lambda _: f(opt.step_count))``: a late joiner takes the run's step.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import trio
from torch import nn

from p2ptrain.training._batches import Batch
from p2ptrain.training._trainer_error import TrainerError
from p2ptrain.training._local_sgd import LocalSGDTrainer
from p2ptrain.protocol import RecordError, is_checkpoint
from p2ptrain.task import Task
from p2ptrain.training._trainer import StepResult, Trainer
from p2ptrain.training._trainer_state import StateSnapshot, state_name

log = logging.getLogger(__name__)

# The round loop's compute step waits for the user's gradient in slices of this, checking in between
# whether its round was cancelled (a newer plan): the user's loop sets the pace, not a deadline.
_POLL_S = 0.2
# Tensors a user's optimizer may keep per parameter (Adam keeps three, AMSGrad four): the bound on an
# optimizer file read from a peer, whose keys are the class's own words.
_MAX_STATE_KEYS = 6
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


class StepSkipped(RuntimeError):
    """The user's step did not happen as a step of the run: the member loaded the run's state (it
    had fallen behind, or joined a run under way), or left the run. The weights are the run's; the
    loop goes on with its next batch."""


class GradientBridge:
    """The hand-off between the user's thread (``opt.step()``) and the round loop's compute step."""

    def __init__(self) -> None:
        # Held by the user's thread whenever it is not waiting in a step: the run changes the user's
        # module (a step, a state loaded by CID) only while it holds it, so never under the user's
        # forward or backward pass (autograd refuses tensors changed in place under it).
        self.model_lock = threading.Lock()
        self._cond = threading.Condition()
        self._gradient: tuple[torch.Tensor, float] | None = None
        self._ticket = 0  # the step handed over last
        self._settled: dict[int, str | None] = {}  # ticket -> None (applied) or why it was skipped
        self._taken: int | None = None  # the ticket the round loop holds
        self.closed: str | None = None

    # -- the user's side ---------------------------------------------------------------------

    def submit(self, gradient: torch.Tensor, loss: float) -> int:
        """Hand a step's flat gradient over; its ticket, for :meth:`wait`."""
        with self._cond:
            if self.closed is not None:
                raise StepSkipped(self.closed)
            self._ticket += 1
            self._gradient = (gradient, loss)
            self._cond.notify_all()
            return self._ticket

    def wait(self, ticket: int, timeout: float | None = None) -> None:
        """Until the step of ``ticket`` was applied (returns) or skipped (:class:`StepSkipped`);
        :class:`TimeoutError` after ``timeout`` seconds (None: no limit)."""
        self.model_lock.release()
        try:
            with self._cond:
                if not self._cond.wait_for(lambda: ticket in self._settled or self.closed is not None, timeout):
                    raise TimeoutError(f"step {ticket} was not taken up by the run within {timeout} s")
                why = self._settled.pop(ticket, self.closed)
        finally:
            self.model_lock.acquire()
        if why is not None:
            raise StepSkipped(why)

    # -- the round loop's side ---------------------------------------------------------------

    def take(self, cancelled: Callable[[], None]) -> tuple[torch.Tensor, float]:
        """The user's next gradient (blocking; ``cancelled()`` raises when the round is called off,
        and the gradient then stays for the next round)."""
        with self._cond:
            while self._gradient is None:
                if self.closed is not None:
                    raise TrainerError(f"the run's user loop stopped: {self.closed}")
                self._cond.wait(_POLL_S)
                if self._gradient is None:
                    self._cond.release()
                    try:
                        cancelled()
                    finally:
                        self._cond.acquire()
            gradient, self._gradient = self._gradient, None
            self._taken = self._ticket
            return gradient

    def settle(self, skipped: str | None = None) -> None:
        """The step taken was applied (``skipped`` None) or dropped (why): its user returns."""
        with self._cond:
            if self._taken is not None:
                self._settled[self._taken] = skipped
                self._taken = None
            elif skipped is not None and self._gradient is not None:
                # Dropped before any round took it: the user waiting on it is released too.
                self._settled[self._ticket] = skipped
                self._gradient = None
            self._cond.notify_all()

    def close(self, why: str) -> None:
        """No more steps: every waiting user is released with ``why``."""
        with self._cond:
            self.closed = why
            self._cond.notify_all()


def _cancelled() -> None:
    """In the round loop's worker thread: raise trio.Cancelled if its round was called off."""
    trio.from_thread.check_cancelled()


class _UserLoop(Trainer):
    """What both trainers of a user's loop share: the bridge to the user's thread, the module
    changed only under its lock, the user's last step of a span held until its checkpoint, and the
    user's own evaluation. Placed before the numerics class in the bases (:class:`UserTrainer`,
    :class:`UserLocalSGDTrainer`), whose ``apply`` and ``load_state`` it wraps."""

    bridge: GradientBridge
    _evaluate_own: Callable[[nn.Module], dict[str, float]] | None
    _held: bool
    # What the user's waiting step is told when the run's state is loaded under it.
    _dropped = "the step was dropped"

    def _bind_user(self, model: nn.Module, bridge: GradientBridge,
                   evaluate: Callable[[nn.Module], dict[str, float]] | None) -> None:
        self.bridge = bridge
        self._evaluate_own = evaluate
        self._held = False  # the user's last step of a span waits for its checkpoint

    @property
    def batches_per_step(self) -> int:
        return 0  # the user's loop reads its own data

    def compute_gradient(self, batches: Iterator[Batch]) -> torch.Tensor:
        """The user's gradient of this step (waits for ``opt.step()``)."""
        flat, loss = self.bridge.take(_cancelled)
        self.pending, self.pending_loss = flat, loss
        return flat

    def apply(self, averaged: torch.Tensor) -> StepResult:
        """The step on the members' mean, while the user waits; then the user's step returns, unless
        it ended a span: then the user waits until the checkpoint's state is taken
        (:meth:`release_span`), since its next forward pass would change the buffers (BatchNorm's
        running statistics) being averaged and hashed."""
        with self.bridge.model_lock:
            result = super().apply(averaged)
        if is_checkpoint(self.task, self.step - 1, self.total_steps):
            self._held = True
        else:
            self.bridge.settle()
        return result

    def release_span(self) -> None:
        if self._held:
            self._held = False
            self.bridge.settle()

    def load_state(self, model_data: bytes, optimizer_data: bytes) -> None:
        """The run's state by CID into the user's own module and optimizer, once the user waits in a
        step (or before its first); a step the user waits on is dropped (it was computed from other
        weights). Called from a worker thread."""
        with self.bridge.model_lock:
            super().load_state(model_data, optimizer_data)
        self.bridge.settle(f"this member loaded the run's state at step {self.step}; {self._dropped}")

    def _card(self) -> dict[str, Any]:
        return {"name": "user", "kwargs": {"architecture": self.task.model.architecture}}

    def snapshot(self) -> StateSnapshot:
        raise TrainerError("overlapping checkpoints are not available for a run of the user's own model")

    def evaluate_own(self) -> dict[str, float]:
        """The user's own evaluation of the weights now (``train(test_data=...)``), else nothing."""
        return _evaluate_user(self.model, self.bridge, self._evaluate_own)


class UserTrainer(_UserLoop):
    """:class:`Trainer` over the user's module and optimizer, its gradients from the user's loop."""

    def __init__(self, task: Task, model: nn.Module, optimizer: torch.optim.Optimizer, bridge: GradientBridge,
                 *, total_steps: int, evaluate: Callable[[nn.Module], dict[str, float]] | None = None) -> None:
        if task.optimizer is not None or not task.model.user:
            raise TrainerError("a UserTrainer runs a task of the members' own model ([model] name = \"user\")")
        super().__init__(task, total_steps=total_steps, device=None, model=model, optimizer=optimizer)
        self._bind_user(model, bridge, evaluate)

    def _schedule_lr(self, applied: bool) -> float:
        """The user's own rate (a schedule of theirs must be the same function of the run's step on
        every member; the module docstring says how)."""
        return float(self.optimizer.param_groups[0].get("lr", float("nan")))

    def optimizer_state_keys(self) -> frozenset[str]:
        """The keys the user's optimizer keeps per parameter, as far as it shows them now (for the
        bound on an optimizer file read from a peer: at least _MAX_STATE_KEYS)."""
        keys: set[str] = set()
        for state in self.optimizer.state.values():
            keys.update(k for k, v in state.items() if isinstance(v, torch.Tensor))
        return frozenset(keys) if len(keys) >= _MAX_STATE_KEYS else frozenset(f"key{i}" for i in range(_MAX_STATE_KEYS))

    def _load_tensors(
        self, model_t: dict[str, torch.Tensor] | None, optim_t: dict[str, torch.Tensor], step: int
    ) -> None:
        """An optimizer state of the user's optimizer class: ``state.<index>.<key>`` tensors whose
        keys are whatever that class keeps (a word; at most a few per parameter), each the shape of
        its parameter or a scalar; anything else is a :class:`RecordError` naming it."""
        if model_t is not None:
            self.model.load_state_dict(model_t, strict=True)
        state: dict[int, dict[str, torch.Tensor]] = {}
        for name, tensor in sorted(optim_t.items()):  # sorted: the first problem named is the same everywhere
            if name == "trainer.step":
                continue
            index, key = state_name(name, len(self.params), lambda k: _KEY.fullmatch(k) is not None)
            if tensor.numel() > 1 and tensor.shape != self.params[index].shape:
                raise RecordError(f"optimizer tensor {name} has shape {tuple(tensor.shape)}, "
                                  f"parameter has {tuple(self.params[index].shape)}")
            state.setdefault(index, {})[key] = tensor
            if len(state[index]) > _MAX_STATE_KEYS:
                raise RecordError(f"optimizer file keeps more than {_MAX_STATE_KEYS} tensors for parameter {index}")
        sd = self.optimizer.state_dict()
        sd["state"] = state
        self.optimizer.load_state_dict(sd)
        self.step = step
        self.pending = None


class UserLocalSGDTrainer(_UserLoop, LocalSGDTrainer):
    """Local-SGD from the user's loop: ``opt.step()`` is an inner step (the user's optimizer, at
    once, in the user's thread); every ``inner_steps``-th one hands the pseudo-gradient over and
    waits for the outer step (the same on every member)."""

    _dropped = "its inner steps were dropped"

    def __init__(self, task: Task, model: nn.Module, optimizer: torch.optim.Optimizer, bridge: GradientBridge,
                 *, total_steps: int, evaluate: Callable[[nn.Module], dict[str, float]] | None = None) -> None:
        super().__init__(task, total_steps=total_steps, device=None, model=model, optimizer=optimizer)
        self._bind_user(model, bridge, evaluate)


def _evaluate_user(model: nn.Module, bridge: GradientBridge,
                   evaluate: Callable[[nn.Module], dict[str, float]] | None) -> dict[str, float]:
    """``evaluate(model)`` while the user's loop is not in a forward or backward pass (the bridge's
    lock), the module's train/eval mode as it was before; only finite numbers are kept (they go
    into a signed record)."""
    if evaluate is None:
        return {}
    with bridge.model_lock:
        was_training = model.training
        try:
            metrics = evaluate(model)
        finally:
            model.train(was_training)
    return {str(k): float(v) for k, v in dict(metrics).items() if math.isfinite(float(v))}
