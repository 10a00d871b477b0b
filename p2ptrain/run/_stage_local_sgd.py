"""A pipelined member's trainer in local-SGD mode: H inner steps of its own, then one outer step of its stage.

Data-parallel local SGD (:class:`~p2ptrain.training.LocalSGDTrainer`) has every member take H
inner steps from the shared weights and average the pseudo-gradients ``theta - theta_after`` at the
outer step. A pipelined member holds one stage, so the same is done stage by stage
(run/_stages.py drives it; docs/pipeline.md, "Local-SGD mode"):

- :meth:`LocalSGDStagedTrainer.begin_round` keeps the stage's weights ``theta`` at the round's start.
- After each of the H passes of the drivers' microbatches through the stages,
  :meth:`~LocalSGDStagedTrainer.inner_step_stage` steps this member's own (inner) optimizer on the
  gradients of the microbatches that went through it, scaled to their mean: a replica holds only
  some of a pass's microbatches (each weighted by its share of the whole pass), and its inner step is
  that of their mean gradient, as a data-parallel member's is of its own batch's. A ring of one
  (every microbatch held) therefore takes exactly a sync step's update.
- :meth:`~LocalSGDStagedTrainer.pseudo_gradient` puts the stage back to ``theta`` and leaves
  ``theta - theta_after`` in its parameters' gradients, which the stage's replicas then sum over
  their ring exactly as a sync step's gradients (dense, or sparse with error feedback).
- :meth:`~LocalSGDStagedTrainer.apply_outer` divides that sum by the ring's size (the replicas'
  mean pseudo-gradient, what a data-parallel round averages) and takes the task's outer step
  (:class:`~p2ptrain.training.OuterOptimizer`): the same input on the same state on every replica of
  the stage, so the same bits, and the replicas are bitwise identical after every outer step.

Shared and checkpointed: the stage's weights and its outer state (the outer momentum of each of its
parameters, ``state.<index>.outer_momentum`` in the stage's optimizer file, the whole model's
indices, as a sync stage file names its optimizer's state) and the outer step. The inner optimizer's
state is each member's own, never sent nor checkpointed (a member that loads a stage starts it fresh),
as in data-parallel local SGD. :attr:`step` counts outer steps; the inner learning rate follows the
task's schedule over inner steps (``step * inner_steps + i`` of ``total_steps * inner_steps``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from p2ptrain.base import all_finite, flat_params, load_flat_params
from p2ptrain.protocol import RecordError
from p2ptrain.run._stage_trainer import INDEX_NAME, StagedTrainer
from p2ptrain.task import OuterSpec, Task
from p2ptrain.training import (inner_lr, MOMENTUM_KEY, OuterOptimizer, step_inner, StepResult, TrainerError,
                                zero_unless_finite)

log = logging.getLogger(__name__)

# The outer momentum of one parameter in a stage's optimizer file: state.<index>.outer_momentum.
OUTER_KEY = "outer_momentum"


class LocalSGDStagedTrainer(StagedTrainer):
    """:class:`StagedTrainer` of a pipelined task in ``training.mode = "local_sgd"``."""

    def __init__(self, task: Task, **kwargs: Any) -> None:
        if not task.training.local_sgd or task.training.inner_steps is None:
            raise TrainerError('LocalSGDStagedTrainer needs a task with training.mode = "local_sgd"')
        super().__init__(task, **kwargs)
        self.inner_steps = task.training.inner_steps
        self.outer_spec = task.outer or OuterSpec()
        # {parameter index: its outer momentum} of the stage held (Nesterov only; none yet: zeros).
        self._momentum: dict[int, torch.Tensor] = {}
        self._start: torch.Tensor | None = None  # the stage's weights at the round's start, inside a round
        self.inner_step: int | None = None  # the inner step under way (for status), None between rounds

    @property
    def batches_per_step(self) -> int:
        """A round's H passes take ``sync_interval`` batches each (a driver's)."""
        return self.inner_steps * self.task.training.sync_interval

    def optimizer_state_keys(self) -> frozenset[str]:
        """What a stage's optimizer file holds per parameter: its outer momentum (Nesterov), or nothing."""
        return frozenset({OUTER_KEY}) if self.outer_spec.optimizer == "nesterov" else frozenset()

    # --- the round ----------------------------------------------------------------------------

    def begin_round(self, stage: int) -> None:
        """Keep ``stage``'s weights at the round's start: what the pseudo-gradient is taken from,
        and what the stage goes back to when the round fails (:meth:`end_round`)."""
        assert self.trained == stage and not self.whole, "a stage is trained once taken (take_stage)"
        self._start = flat_params(list(self.stages[stage].parameters()))
        self.inner_step = 0

    def inner_step_stage(self, stage: int, inner: int, held: int, total: int) -> bool:
        """Inner step ``inner`` of the round: this member's optimizer steps ``stage`` on the gradients
        of the ``held`` microbatches (of the pass's ``total``) it accumulated, scaled to their mean.
        False when nothing was stepped (none held, or a gradient not finite)."""
        assert self._start is not None, "an inner step inside a round (begin_round)"
        params = list(self.stages[stage].parameters())
        stepped = held > 0 and all(all_finite(p.grad) for p in params if p.grad is not None)
        if held > 0 and not stepped:
            log.warning("step %d: inner step %d has a non-finite gradient; skipped", self.step, inner)
        if stepped:
            scale = total / held
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(scale)
            step_inner(self.optimizer, self.task, self.step, inner, self.inner_steps, self.total_steps)
        self.optimizer.zero_grad(set_to_none=True)
        self.inner_step = inner + 1
        return stepped

    def pseudo_gradient(self, stage: int) -> None:
        """The round's inner steps are done: ``stage`` goes back to its weights at the round's start,
        and each parameter's gradient is its part of ``theta - theta_after`` (zeros where it is not
        finite), which the stage's replicas sum next."""
        assert self._start is not None, "a pseudo-gradient ends a round (begin_round)"
        params = list(self.stages[stage].parameters())
        start, self._start = self._start, None
        delta = torch.sub(start, flat_params(params))
        load_flat_params(params, start)
        zero_unless_finite(delta, self.step)
        offset = 0
        for p in params:
            p.grad = delta[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self.inner_step = None

    def end_round(self, stage: int) -> None:
        """A round that did not reach its outer step: ``stage`` back to its weights at the round's
        start (a retry repeats the round from them), its gradients dropped."""
        if self._start is not None:
            load_flat_params(list(self.stages[stage].parameters()), self._start)
            self._start = None
        self.optimizer.zero_grad(set_to_none=True)
        self.inner_step = None

    def apply_outer(self, stage: int, ring: int, loss: float) -> StepResult:
        """The outer step of ``stage``, whose parameters' gradients are the pseudo-gradients summed
        over its ``ring`` replicas: their mean through the task's outer optimizer, the same bits on
        every replica. ``loss``: the round's."""
        assert self.trained == stage and not self.whole and self._start is None, "after pseudo_gradient"
        self._take_snapshot()  # the weights at the round's start and the outer state: a rollback's
        params = list(self.stages[stage].parameters())
        averaged = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        averaged.div_(ring)  # the replicas' mean (exact for a ring of one)
        applied = all_finite(averaged)
        if applied:
            theta = flat_params(params)
            outer = OuterOptimizer(self.outer_spec, theta.numel())
            indices = sorted(self._stage_indices(stage))
            if outer.momentum is not None:
                outer.load({MOMENTUM_KEY: torch.cat([
                    self._momentum.get(i, torch.zeros_like(self.params[i])).reshape(-1) for i in indices])})
            outer.step(theta, averaged)
            load_flat_params(params, theta)
            if outer.momentum is not None:
                offset = 0
                for i in indices:
                    n = self.params[i].numel()
                    self._momentum[i] = outer.momentum[offset : offset + n].view_as(self.params[i])
                    offset += n
        else:
            log.warning("step %d: the stage's pseudo-gradient sum is not finite; every replica skips it", self.step)
        self.optimizer.zero_grad(set_to_none=True)
        lr = inner_lr(self.task, self.step, self.inner_steps - 1, self.inner_steps, self.total_steps)
        result = StepResult(step=self.step, local_loss=loss, lr=lr, applied=applied)
        self.step += 1
        return result

    # --- the shared state: the stage's outer momentum --------------------------------------------

    def optimizer_tensors(
        self, copy: Callable[[str, torch.Tensor], torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """The shared optimizer state: the outer step and the outer momentum of the stage held (the
        inner optimizer's state is this member's own and is left out)."""
        out = {"trainer.step": torch.tensor(self.step, dtype=torch.int64)}
        for i, value in sorted(self._momentum.items()):
            name = f"state.{i}.{OUTER_KEY}"
            out[name] = copy(name, value) if copy else value.detach().cpu().clone()
        return out

    def _load_tensors(self, model_t: dict[str, torch.Tensor] | None, optim_t: dict[str, torch.Tensor],
                      step: int) -> None:
        momentum: dict[int, torch.Tensor] = {}
        for name, value in optim_t.items():
            if name == "trainer.step":
                continue
            found = INDEX_NAME.fullmatch(name)
            index = int(name.split(".")[1]) if found else -1
            if not found or name.rsplit(".", 1)[1] not in self.optimizer_state_keys() or index >= len(self.params):
                raise RecordError(f"the optimizer file's {name!r} is no outer state of this model")
            if value.dtype != torch.float32 or value.shape != self.params[index].shape:
                raise RecordError(f"optimizer tensor {name} has shape {tuple(value.shape)} {value.dtype}")
            momentum[index] = value.detach().to("cpu", copy=True).contiguous()
        if model_t is not None:  # the freed stages' names, as they are (a rollback keeps the held ones)
            self.model.load_state_dict({**self.model.state_dict(), **model_t}, strict=True)
        self._momentum, self.step, self.pending = momentum, step, None

    def _hold(self, keep: set[int]) -> None:
        super()._hold(keep)
        kept = {i for stage in keep for i in self._stage_indices(stage)}
        self._momentum = {i: m for i, m in self._momentum.items() if i in kept}
        self._start = None


def staged_trainer(task: Task, **kwargs: Any) -> StagedTrainer:
    """The trainer of a pipelined ``task``'s mode: :class:`LocalSGDStagedTrainer` or :class:`StagedTrainer`."""
    return LocalSGDStagedTrainer(task, **kwargs) if task.training.local_sgd else StagedTrainer(task, **kwargs)
