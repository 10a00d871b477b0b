"""Local-SGD mode's trainer: a round is H inner steps, then one outer step on the averaged pseudo-gradient.

:class:`LocalSGDTrainer` keeps :class:`~p2ptrain.training.Trainer`'s round contract, so the
round loop, the collective, checkpoints, attestations, retries and resync run unchanged:

- :meth:`compute_gradient` takes ``inner_steps`` local optimizer steps from the shared weights
  ``theta`` (each one ``sync_interval`` batches), and returns the pseudo-gradient
  ``theta - theta_after`` as the round's pending vector. The model is then put back to ``theta``, so
  between rounds every member holds the same weights, as in sync mode.
- The pending vector goes through the same ``average`` (the sparse all-reduce with error feedback:
  ``[compression]`` applies to the pseudo-gradient).
- :meth:`apply` runs the outer optimizer (:mod:`p2ptrain.training._outer`) on the average: the same
  input from the same state on every member, so the same bits.

What is shared and what is not: the weights and the outer momentum are identical on every member and
are what a checkpoint holds (the optimizer file holds the outer state and the step). The inner
optimizer's state (Adam's moments, say) is each member's own; it is kept across rounds, never sent,
never checkpointed. A late joiner loads the weights and outer state by CID and starts its inner
optimizer fresh. A member that dies mid-inner-loop loses only its own inner steps of that round: the
others' all-reduce fails and the retry averages the pseudo-gradients they already computed, without it.

Steps: :attr:`step` counts outer steps (rounds), as plans and records do; the inner learning rate
follows the task's schedule over inner steps (``step * inner_steps + i`` of ``total_steps *
inner_steps``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from p2ptrain.base import all_finite, flat_params, load_flat_params
from p2ptrain.training._batches import Batch
from p2ptrain.training._optimizers import lr_at
from p2ptrain.training._outer import OuterError, OuterOptimizer
from p2ptrain.protocol import RecordError
from p2ptrain.task import OuterSpec, Task
from p2ptrain.training._trainer import StepResult, Trainer, TrainerError

log = logging.getLogger(__name__)

# Header allowance of the outer optimizer file beyond its tensor bytes (two tensors' names, dtypes,
# shapes and offsets in the safetensors JSON header: well under a KiB; 4 KiB leaves room).
_OUTER_HEADER_BYTES = 4096



def inner_lr(task: Task, step: int, inner: int, inner_steps: int, total_steps: int) -> float:
    """The inner learning rate of inner step ``inner`` of outer step ``step``: the task's schedule
    over inner steps (``step * inner_steps + inner`` of ``total_steps * inner_steps``), so that a
    run of H inner steps per round anneals as one of ``total_steps * H`` sync steps would."""
    return lr_at(task, step * inner_steps + inner, total_steps * inner_steps)


def step_inner(optimizer: torch.optim.Optimizer, task: Task, step: int, inner: int, inner_steps: int,
               total_steps: int) -> None:
    """``optimizer`` (a member's own inner one) steps at :func:`inner_lr`: what both local-SGD
    trainers do after each inner step's gradients, the data-parallel one and a pipelined stage's."""
    lr = inner_lr(task, step, inner, inner_steps, total_steps)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()


def zero_unless_finite(delta: torch.Tensor, step: int) -> None:
    """A pseudo-gradient that is not finite is contributed as zeros (warned), in place: one member's
    diverged inner loop must not poison the average, which every member applies alike."""
    if not all_finite(delta):
        log.warning("step %d: pseudo-gradient is not finite; contributing zeros", step)
        delta.zero_()


class LocalSGDTrainer(Trainer):
    """A :class:`Trainer` whose round is H inner steps and an outer step (DiLoCo)."""

    def __init__(self, task: Task, **kwargs: Any) -> None:
        if not task.training.local_sgd or task.training.inner_steps is None:
            raise TrainerError('LocalSGDTrainer needs a task with training.mode = "local_sgd"')
        super().__init__(task, **kwargs)
        self.inner_steps = task.training.inner_steps
        self.outer = OuterOptimizer(task.outer or OuterSpec(), self.num_parameters)
        self._start = torch.empty(self.num_parameters, dtype=torch.float32)
        # The inner step under way (0-based), None between inner loops: for status and for tests
        # that stop a member in the middle of one.
        self.inner_step: int | None = None

    @property
    def batches_per_step(self) -> int:
        """A round's H inner steps take ``sync_interval`` batches each."""
        return self.inner_steps * self.task.training.sync_interval

    def flat_weights(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The model's parameters as one flat float32 CPU vector (in ``out`` when given)."""
        flat = flat_params(self.params)
        return flat if out is None else out.copy_(flat)

    def _set_weights(self, flat: torch.Tensor) -> None:
        load_flat_params(self.params, flat)

    def compute_gradient(self, batches: Iterator[Batch]) -> torch.Tensor:
        """H inner steps from the shared weights; the pseudo-gradient ``theta - theta_after`` (kept
        as :attr:`pending`). The model holds the shared weights again when this returns."""
        start = self.flat_weights(self._start)
        losses = 0.0
        try:
            for i in range(self.inner_steps):
                self.inner_step = i
                loss = self.backward(batches)
                losses += loss
                grads_ok = all(p.grad is None or all_finite(p.grad) for p in self.params)
                if not grads_ok:
                    log.warning("step %d: inner step %d has a non-finite gradient; skipped", self.step, i)
                    continue
                step_inner(self.optimizer, self.task, self.step, i, self.inner_steps, self.total_steps)
            self.optimizer.zero_grad(set_to_none=True)
            delta = torch.sub(start, self.flat_weights())
        finally:
            self.inner_step = None
            self._set_weights(start)  # whatever happened, the model holds the shared weights
        zero_unless_finite(delta, self.step)
        self.pending, self.pending_loss = delta, losses / self.inner_steps
        return delta

    def apply(self, averaged: torch.Tensor) -> StepResult:
        """The outer step with the members' mean pseudo-gradient; every member computes the same."""
        if averaged.shape != (self.num_parameters,):
            raise TrainerError(f"averaged pseudo-gradient has shape {tuple(averaged.shape)}, "
                               f"expected ({self.num_parameters},)")
        self._take_snapshot()
        applied = all_finite(averaged)
        if applied:
            theta = self.flat_weights()
            self.outer.step(theta, averaged)
            self._set_weights(theta)
        else:
            log.warning("step %d: averaged pseudo-gradient is not finite; every member skips this step", self.step)
        # The inner rate of this step's last inner step: the task's schedule, or the user's own optimizer's.
        lr = (inner_lr(self.task, self.step, self.inner_steps - 1, self.inner_steps, self.total_steps)
              if self.task.optimizer is not None else float(self.optimizer.param_groups[0]["lr"]))
        result = StepResult(step=self.step, local_loss=self.pending_loss, lr=lr, applied=applied)
        self.step += 1
        self.pending = None
        return result

    def optimizer_tensors(
        self, copy: Callable[[str, torch.Tensor], torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """The shared optimizer state: the outer state and the (outer) step counter. The inner
        optimizer's state is this member's own and is left out."""
        out = {"trainer.step": torch.tensor(self.step, dtype=torch.int64)}
        for name, value in self.outer.state().items():
            out[name] = copy(name, value) if copy else value.detach().cpu().clone()
        return out

    def state_limits(self) -> tuple[int, int]:
        # Not the inner optimizer's bound: a user's run names no optimizer of the registry to take it from.
        return self.model_limit(), self.outer.state_bytes_bound() + _OUTER_HEADER_BYTES

    def _load_tensors(
        self, model_t: dict[str, torch.Tensor] | None, optim_t: dict[str, torch.Tensor], step: int
    ) -> None:
        if model_t is not None:
            self.model.load_state_dict(model_t, strict=True)
        try:
            self.outer.load({k: v for k, v in optim_t.items() if k != "trainer.step"})
        except OuterError as exc:
            raise RecordError(f"optimizer file: {exc}") from None
        self.step = step
        self.pending = None


def new_trainer(task: Task, **kwargs: Any) -> Trainer:
    """The trainer of ``task``'s mode: :class:`LocalSGDTrainer` or the sync :class:`Trainer`."""
    return LocalSGDTrainer(task, **kwargs) if task.training.local_sgd else Trainer(task, **kwargs)

