"""A member's trainer in a pipelined run: the whole model, of which it trains one stage.

The member builds, loads and checkpoints the whole model exactly as a data-parallel member does
(the task's seed or initial model, a checkpoint by CID, the same model and optimizer files), so
records, attestations, resync, resume and ``model fetch`` work unchanged. Between checkpoints it
steps only its stage's parameters (the others keep the values of the last checkpoint); at a
checkpoint one replica of every stage contributes its stage's parameters and optimizer state to an
exact sum over all the plan's members (:meth:`StagedTrainer.state_vector`), after which every
member holds the whole model again, bit for bit the same, and hashes it as any member does.

The price: every member holds the whole model's memory (a later step builds and loads only its
stage's pieces: per-stage checkpoints and a manifest, docs/pipeline.md), and each checkpoint moves
the whole model and its optimizer state once through a ring of all the members.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch

from p2ptrain.base import all_finite
from p2ptrain.pipeline import partition, Stage
from p2ptrain.protocol import read_model_card, read_tensors, RecordError, state_bytes, tensors_bytes
from p2ptrain.training import StepResult, Trainer, TrainerError

log = logging.getLogger(__name__)

# An optimizer file's per-parameter names: state.<index>.<key> (the key is checked by the trainer).
_INDEX_NAME = re.compile(r"state\.(0|[1-9][0-9]{0,8})\.[a-z_]+")


class StagedTrainer(Trainer):
    """:class:`~p2ptrain.training.Trainer` of a pipelined task (``task.pipeline``), one stage at a time."""

    def __init__(self, task: Any, **kwargs: Any) -> None:
        assert task.pipeline is not None, "a task without [pipeline] has the data-parallel trainer"
        # The stage protocol carries CPU tensors and no autocast: a pipelined run computes on the CPU
        # in fp32 for now (a task that requires CUDA is refused: task.unmet_requirement).
        if kwargs.get("device", "auto") not in ("auto", "cpu") or kwargs.get("precision", "fp32") != "fp32":
            log.warning("a pipelined run trains on the CPU in fp32 (not %s, %s)", kwargs.get("device"),
                        kwargs.get("precision"))
        kwargs.update(device="cpu", precision="fp32")
        super().__init__(task, **kwargs)
        # The stages share the model's modules: stepping a stage steps the model's own parameters.
        self.stages: list[Stage] = partition(self.model, task.pipeline.stages)
        self.whole = True  # every parameter is at self.step (built, loaded, or gathered at a checkpoint)
        self.trained: int | None = None  # the stage stepped since the model was last whole
        self._whole_before = True  # `whole` before the last step, for rollback

    def holds(self, stage: int) -> bool:
        """Whether this member holds ``stage`` at its step: always after a checkpoint or a load; between
        two, only the stage it steps (the others are at the last checkpoint)."""
        return self.whole or self.trained == stage

    def take_stage(self, stage: int) -> Stage:
        """The stage to serve in a plan; a :class:`TrainerError` when this member does not hold it at
        its step (a plan moved it to another stage between checkpoints: it resyncs from the latest)."""
        if not self.holds(stage):
            raise TrainerError(f"holds stage {self.trained} at step {self.step}, not stage {stage} (moved between "
                               "checkpoints)")
        return self.stages[stage]

    def apply_stage(self, stage: int, loss: float) -> StepResult:
        """One optimizer step of ``stage``, whose parameters' gradients are the step's, summed over the
        stage's replicas (the others have none: torch's optimizers skip them). ``loss``: the step's."""
        self._take_snapshot()
        self._whole_before = self.whole
        params = list(self.stages[stage].parameters())
        applied = all(all_finite(p.grad) for p in params if p.grad is not None)
        lr = self._schedule_lr(applied)
        if applied:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.whole, self.trained = False, stage
        result = StepResult(step=self.step, local_loss=loss, lr=lr, applied=applied)
        self.step += 1
        return result

    def rollback(self) -> None:
        super().rollback()
        self.whole = self._whole_before

    def load_state(self, model_data: bytes, optimizer_data: bytes) -> None:
        super().load_state(model_data, optimizer_data)
        self.whole = True

    # --- a stage's checkpoint files ---------------------------------------------------------------

    def _stage_indices(self, stage: int) -> set[int]:
        """The indices (in :attr:`params`, the optimizer file's numbering) of ``stage``'s parameters."""
        own = {id(p) for p in self.stages[stage].parameters()}
        return {i for i, p in enumerate(self.params) if id(p) in own}

    def stage_files(self, stage: int) -> tuple[bytes, bytes]:
        """``stage``'s checkpoint as a manifest names it (training/_stage_manifest.py): its model file
        (its pieces' tensors under their names in the whole model, with the whole model's card) and
        its optimizer file (its parameters' state under their whole-model indices, and the step).
        The stage files of every stage assemble into :meth:`model_bytes` of the whole
        (:func:`p2ptrain.training.model_file`), and their optimizer tensors are those of
        :meth:`optimizer_bytes`."""
        whole = self.model.state_dict()
        model_data = state_bytes({name: whole[name] for name in self.stages[stage].state_names()}, self._card())
        indices = {str(i) for i in self._stage_indices(stage)}
        optim = {name: t for name, t in self.optimizer_tensors().items()
                 if name == "trainer.step" or name.split(".")[1] in indices}
        return model_data, tensors_bytes(optim)

    def load_stage(self, stage: int, model_data: bytes, optimizer_data: bytes) -> None:
        """Take ``stage``'s checkpoint files (:meth:`stage_files`' form, e.g. by CID from a manifest):
        its parameters, their optimizer state and the step; the other stages are not held after it.
        :class:`RecordError` for files that are not exactly that stage's, and nothing is changed."""
        if read_model_card(model_data) != self._card():
            raise RecordError(f"stage {stage}'s model file is not of this task's model")
        tensors = read_tensors(model_data)
        whole = self.model.state_dict()
        names = self.stages[stage].state_names()
        if set(tensors) != set(names):
            raise RecordError(f"the model file does not hold exactly stage {stage}'s tensors")
        for name in names:
            if tensors[name].shape != whole[name].shape or tensors[name].dtype != whole[name].dtype:
                raise RecordError(f"stage {stage}'s tensor {name}: {tuple(tensors[name].shape)} {tensors[name].dtype}")
        optim = read_tensors(optimizer_data)
        step = optim.pop("trainer.step", None)
        if step is None or step.dtype != torch.int64 or step.numel() != 1:
            raise RecordError("optimizer file has no valid trainer.step")
        indices, keys = self._stage_indices(stage), self.optimizer_state_keys()
        for name, t in sorted(optim.items()):
            _, index, key = name.split(".", 2) if _INDEX_NAME.fullmatch(name) else ("", "-1", "")
            if int(index) not in indices or key not in keys:
                raise RecordError(f"the optimizer file's {name!r} is no state of stage {stage}")
            if key != "step" and t.shape != self.params[int(index)].shape:
                raise RecordError(f"optimizer tensor {name} has shape {tuple(t.shape)}")
        model_t = {**whole, **tensors}
        self._load_tensors(model_t, optim, int(step))  # checks the optimizer's keys and shapes
        self.whole, self.trained = False, stage
        self._snapshot = None

    # --- the checkpoint's gather ---------------------------------------------------------------

    def _layout(self) -> list[tuple[str, int]]:
        """The gather vector's parts: ``(name, entries)`` for every parameter, then for every
        parameter and optimizer state key a presence flag and the state's values."""
        parts = [(f"model.{name}", p.numel()) for name, p in self.model.named_parameters()]
        for i, p in enumerate(self.params):
            for key in sorted(self.optimizer_state_keys()):
                parts += [(f"present.{i}.{key}", 1), (f"state.{i}.{key}", 1 if key == "step" else p.numel())]
        return parts

    def state_vector(self, stage: int, contribute: bool) -> torch.Tensor:
        """This member's share of the whole state: ``stage``'s parameters and their optimizer state
        when it ``contribute``\\ s (one replica of each stage does), zeros elsewhere. Summed over
        the plan's members (``x + 0`` is ``x``), it is the whole model and optimizer state."""
        own = {id(p) for p in self.stages[stage].parameters()} if contribute else set()
        state = self.optimizer.state
        values: dict[str, torch.Tensor] = {}
        for name, p in self.model.named_parameters():
            if id(p) in own:
                values[f"model.{name}"] = p.detach()
        for i, p in enumerate(self.params):
            if id(p) not in own:
                continue
            for key, value in state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    values[f"present.{i}.{key}"] = torch.ones(1)
                    values[f"state.{i}.{key}"] = value.detach()
        layout = self._layout()
        flat = torch.zeros(sum(n for _, n in layout), dtype=torch.float32)
        offset = 0
        for name, n in layout:
            if name in values:
                flat[offset : offset + n] = values[name].reshape(-1).to(device="cpu", dtype=torch.float32)
            offset += n
        return flat

    def load_state_vector(self, flat: torch.Tensor, stage: int) -> bool:
        """Take the summed :meth:`state_vector` as the whole model and optimizer state; whether this
        member's own ``stage`` parameters were those bits already (the replicas of a stage are
        bitwise identical unless one of them went astray: the caller counts it)."""
        layout = self._layout()
        if flat.shape != (sum(n for _, n in layout),):
            raise TrainerError(f"gathered state has shape {tuple(flat.shape)}, expected ({sum(n for _, n in layout)},)")
        parts: dict[str, torch.Tensor] = {}
        offset = 0
        for name, n in layout:
            parts[name] = flat[offset : offset + n]
            offset += n
        model_t = dict(self.model.state_dict())
        own = {id(p) for p in self.stages[stage].parameters()}
        same = True
        for name, p in self.model.named_parameters():
            model_t[name] = parts[f"model.{name}"].view_as(p).to(dtype=p.dtype)
            if id(p) in own and same:
                same = torch.equal(model_t[name], p.detach())
        optim_t: dict[str, torch.Tensor] = {}
        for i, p in enumerate(self.params):
            for key in sorted(self.optimizer_state_keys()):
                if float(parts[f"present.{i}.{key}"]) > 0:
                    value = parts[f"state.{i}.{key}"]
                    optim_t[f"state.{i}.{key}"] = value.reshape(()).clone() if key == "step" else value.view_as(p).clone()
        self._load_tensors(model_t, optim_t, self.step)
        self.whole, self.trained = True, None
        self._snapshot = None  # the step before the gather holds stale stages
        return same
