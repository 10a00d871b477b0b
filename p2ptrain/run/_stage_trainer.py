"""A member's trainer in a pipelined run: the model cut into stages, of which it holds and trains one.

A member never holds the whole model. It is built on the meta device (its shapes, nothing
allocated); at step 0 of a run from the task's seed it can take any stage, whose initial bits it
makes then from the seed, one piece at a time (:class:`~p2ptrain.models.InitialPieces`: the same
bits as one process's build), and from then on it holds that stage's weights, gradients and
optimizer state only, and steps only that stage. The run's initial model, the root of its chain,
is the manifest of every stage's initial files (:meth:`StagedTrainer.initial_stage_files`, hashed
one stage at a time), so every member agrees on it without holding it. Its checkpoint is its
stage's two files (:meth:`StagedTrainer.stage_files`), which a manifest names with the other
stages' (run/_stage_checkpoints.py). A member that loads a checkpoint (resume, resync, a joiner, a
run from an ``initial_model``) takes the manifest only (:meth:`StagedTrainer.load_manifest`: it
holds no stage at that step) and then the one stage its plan names
(:meth:`StagedTrainer.load_stage`, by CID from that manifest); a member a plan moves to another
stage loads that one the same way.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from p2ptrain.base import all_finite
from p2ptrain.models import build_model, file_bytes_bound, InitialPieces, meta_model, Piece
from p2ptrain.data import Manifest
from p2ptrain.pipeline import partition, partition_at, request_shapes, RequestShapes, Stage
from p2ptrain.protocol import (model_tensors, read_model_card, read_tensors, RecordError, state_bytes, tensors_bytes,
                               write_state_file)
from p2ptrain.task import cut_problem
from p2ptrain.training import ManifestError, read_manifest, StageFile, StepResult, Trainer, TrainerError

log = logging.getLogger(__name__)

# An optimizer file's per-parameter names: state.<index>.<key> (the key is checked by the trainer).
INDEX_NAME = re.compile(r"state\.(0|[1-9][0-9]{0,8})\.[a-z_]+")


class StagedTrainer(Trainer):
    """:class:`~p2ptrain.training.Trainer` of a pipelined task (``task.pipeline``), one stage at a time."""

    def __init__(self, task: Any, **kwargs: Any) -> None:
        assert task.pipeline is not None, "a task without [pipeline] has the data-parallel trainer"
        # The stage protocol carries CPU tensors and no autocast: a pipelined run computes on the CPU
        # in fp32 for now (a task that requires CUDA is refused: task.unmet_requirement).
        if kwargs.get("device", "auto") not in ("auto", "cpu") or kwargs.get("precision", "fp32") != "fp32":
            log.warning("a pipelined run trains on the CPU in fp32 (not %s, %s)", kwargs.get("device"),
                        kwargs.get("precision"))
        kwargs.update(device=None, precision="fp32")
        model = meta_model(task.model.name, task.model.arguments)  # shapes only: nothing allocated
        # A weight tied inside a stage would come apart when the stage is freed and allocated again
        # (each module's parameter converted on its own): such a model is built whole from the seed
        # and keeps every stage allocated.
        self._frees = all(len(list(s.parameters())) == len(list(s.named_parameters(remove_duplicate=False)))
                          for s in partition(model, task.pipeline.stages))
        if not self._frees:
            model = build_model(task.model.name, task.model.arguments, task.seed)
        super().__init__(task, model=model, **kwargs)
        self.device = torch.device("cpu")
        # The stages share the model's modules: stepping a stage steps the model's own parameters.
        self.stages: list[Stage] = partition(self.model, task.pipeline.stages)
        # Every piece's tensor names, and each parameter's index in the whole model (the optimizer file's).
        self._piece_names = [set(piece.state_names()) for stage in self.stages for piece in stage.pieces
                             if isinstance(piece, Piece)]
        self._param_names = [name for name, _ in self.model.named_parameters()]
        self.initial = InitialPieces(task.model.name, task.model.arguments, task.seed)
        # A run from the task's seed: at step 0 any stage's bits are the seed's (made when taken).
        self.seeded = not task.initial_model
        self.whole = not self._frees and self.seeded  # every stage is at self.step and allocated
        self.trained: int | None = None  # otherwise the one stage held (None: none)

    def holds(self, stage: int) -> bool:
        """Whether this member holds ``stage`` at its step, or can take it from the seed (at step 0
        of a run from the task's seed, any stage); after :meth:`load_manifest` none until it loads
        one, after :meth:`take_stage` or :meth:`load_stage` that one."""
        return self.whole or self.trained == stage or (self.seeded and self.step == 0)

    def take_stage(self, stage: int) -> Stage:
        """The stage to serve in a plan; a :class:`TrainerError` when this member does not hold it at
        its step (it loads it first, run/_stage_checkpoints.py). A stage not held yet is made from
        the seed; every other stage's tensors are freed: from then on this member holds that stage's
        weights, gradients and optimizer state only."""
        if not self.holds(stage):
            held = "no stage" if self.trained is None else f"stage {self.trained}"
            raise TrainerError(f"holds {held} at step {self.step}, not stage {stage}")
        if self.trained != stage:
            from_seed = not self.whole
            self._hold({stage})
            if from_seed:
                state = self.model.state_dict()
                with torch.no_grad():
                    for tensors in self.initial.tensors(self.stages[stage].first, self.stages[stage].last):
                        for name, t in tensors.items():
                            state[name].copy_(t)
            self.whole, self.trained = False, stage
        return self.stages[stage]

    def apply_stage(self, stage: int, loss: float) -> StepResult:
        """One optimizer step of ``stage``, whose parameters' gradients are the step's, summed over the
        stage's replicas (the others have none: torch's optimizers skip them). ``loss``: the step's."""
        assert self.trained == stage and not self.whole, "a stage is stepped once taken (take_stage)"
        self._take_snapshot()
        params = list(self.stages[stage].parameters())
        applied = all(all_finite(p.grad) for p in params if p.grad is not None)
        lr = self._schedule_lr(applied)
        if applied:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        result = StepResult(step=self.step, local_loss=loss, lr=lr, applied=applied)
        self.step += 1
        return result

    def load_state(self, model_data: bytes, optimizer_data: bytes) -> None:
        self._hold(set(range(len(self.stages))))  # a whole model file: every stage allocated again
        super().load_state(model_data, optimizer_data)
        self.whole, self.trained = True, None

    # --- memory: the stages this member holds -------------------------------------------------------

    def _hold(self, keep: set[int]) -> None:
        """Allocate the stages in ``keep`` that were freed (their values are loaded next) and free
        every other stage's tensors (``to("meta")``): its weights, gradients and optimizer state. The
        model's parameter list and the optimizer follow the new parameters, in the same order (the
        optimizer file's indices are the whole model's)."""
        self._snapshot, self._snapshot_buffers = None, {}
        if self._frees:
            before = list(self.model.parameters())
            for i, stage in enumerate(self.stages):
                freed = any(t.is_meta for t in (*stage.parameters(), *stage.buffers()))
                if i in keep and freed:
                    stage.to_empty(device=self.device)
                elif i not in keep and not freed:
                    for param in stage.parameters():
                        param.grad = None  # a failed step's, which the optimizer would step on the meta device
                    stage.to("meta")
            self.params = list(self.model.parameters())
            renamed = {id(old): new for old, new in zip(before, self.params, strict=True)}
            for group in self.optimizer.param_groups:
                group["params"] = [renamed[id(p)] for p in group["params"]]
        kept = {id(p) for i in keep for p in self.stages[i].parameters()}
        state = self.optimizer.state
        for p in [p for p in state if id(p) not in kept]:
            del state[p]

    def _load_tensors(self, model_t: dict[str, torch.Tensor] | None, optim_t: dict[str, torch.Tensor],
                      step: int) -> None:
        if model_t is not None:  # the freed stages' names, as they are (a rollback keeps the held ones)
            model_t = {**self.model.state_dict(), **model_t}
        super()._load_tensors(model_t, optim_t, step)

    def load_manifest(self, model_data: bytes, optimizer_data: bytes, step: int) -> None:
        """A checkpoint of the run at ``step`` whose model and optimizer CID name one manifest:
        check it names this model's stages; this member then holds no stage at ``step`` until it
        loads one (:meth:`load_stage`, from that manifest's files). :class:`RecordError` for bytes
        that are no such manifest, and nothing is changed."""
        if model_data != optimizer_data:
            raise RecordError("a pipelined checkpoint's model and optimizer CIDs name one manifest")
        try:
            entries = read_manifest(model_data)
        except ManifestError as exc:
            raise RecordError(str(exc)) from None
        problem = self.manifest_problem(entries)
        if problem is not None:
            raise RecordError(f"the manifest's stages are not a cut of this task's pieces: {problem}")
        self.back_to(step)

    def manifest_problem(self, entries: Sequence[StageFile]) -> str | None:
        """Why a manifest's stages (``read_manifest``: they tile the pieces from 0) are no cut a plan
        of this task may name (``task.cut_problem``: its stage count over all its pieces, each stage
        within one member's ``MAX_PARAMETERS``, no weight tied across two), or None. Any such cut,
        also for a task that does not re-cut: :meth:`load_parts` takes a stage from the files that
        cover it. A wider stage would have a joiner read a file of up to the whole model."""
        return cut_problem(self.task, (*(e.first for e in entries), entries[-1].last + 1))

    def part_limits(self, first: int, last: int) -> tuple[int, int]:
        """The most bytes honest (model, optimizer) files of pieces ``first``..``last`` take
        (:meth:`state_limits` of those pieces only): what a member reads of a manifest entry's files."""
        names = set().union(*self._piece_names[first : last + 1])
        whole = self.model.state_dict()
        params = [p for name, p in self.model.named_parameters() if name in names]
        return file_bytes_bound(whole[n] for n in sorted(names)), self.optimizer_limit(params)

    def back_to(self, step: int) -> None:
        """Hold no stage, at ``step``: what this member holds is of another step (a checkpoint it
        loads, or the run going back to its last confirmed one after a stage lost every replica);
        it loads its plan's stage from that checkpoint next (run/_stage_checkpoints.py)."""
        self.optimizer.zero_grad(set_to_none=True)  # a failed step's gradients are of no step now
        self._hold(set())
        self.step, self.pending = step, None
        self.whole, self.trained = False, None

    @property
    def cut(self) -> tuple[int, ...]:
        """Each stage's first piece, then the number of pieces: the task's cut until a plan moves it (recut)."""
        return (*(s.first for s in self.stages), self.stages[-1].last + 1)

    def recut(self, bounds: Sequence[int]) -> None:
        """Cut the model at ``bounds`` (a plan's cut: protocol/_recut.py) and hold no stage, at this
        step: a plan that moves the cut starts at a confirmed checkpoint, from whose manifest this
        member loads its stage of the new cut next (:meth:`load_parts`, from the files of the old
        stages that cover it). ``models.PartitionError`` for bounds that are no cut of the pieces."""
        stages = partition_at(self.model, bounds)  # checked before anything is dropped
        self.back_to(self.step)
        self.stages = stages

    def request_shapes(self, manifest: Manifest) -> list[RequestShapes]:
        """What a request to each stage's replica may hold (pipeline/_request_shapes.py): the task's
        microbatch (an EVAL: its eval batch) of samples of its data set's ``manifest`` (token ids for
        a text set, float32 otherwise, as the data loader gives them to the model), traced on a model
        of its own on the meta device, so no stage this member serves is touched. Empty (a replica
        then takes any request within the default frame limits, as before) when the meta device
        cannot trace the model: a check that stopped a run that trains would be worse than none."""
        task = self.task
        assert task.pipeline is not None
        sample = torch.empty(manifest.features.shape, dtype=torch.int64 if manifest.tokens is not None else torch.float32)
        try:
            return request_shapes(meta_model(task.model.name, task.model.arguments), task.pipeline.stages, sample,
                                  manifest.labels.shape, microbatch=task.pipeline.microbatch_size or task.training.batch_size,
                                  evaluation=task.training.eval_batch_size, cut=self.cut)
        except (NotImplementedError, RuntimeError, ValueError, TypeError, IndexError) as exc:
            log.warning("the stages' request shapes cannot be traced on the meta device (%s): their replicas take "
                        "any request within the default frame limits", str(exc).strip().split("\n")[0])
            return []

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
        :meth:`optimizer_bytes`. A stage this member can take from the seed but has not taken is
        made from it (its optimizer file: the step only)."""
        names = self.stages[stage].state_names()
        if self.whole or self.trained == stage:
            whole = self.model.state_dict()
            tensors = {name: whole[name] for name in names}
        elif self.holds(stage):
            tensors = {n: t for piece in self.initial.tensors(self.stages[stage].first, self.stages[stage].last)
                       for n, t in piece.items()}
        else:
            raise TrainerError(f"holds no stage {stage} at step {self.step}")
        indices = {str(i) for i in self._stage_indices(stage)}
        optim = {name: t for name, t in self.optimizer_tensors().items()
                 if name == "trainer.step" or name.split(".")[1] in indices}
        return state_bytes(tensors, self._card()), tensors_bytes(optim)

    def stage_numbers(self, stage: int) -> int:
        """How many numbers ``stage``'s model file holds (a manifest's ``parameters``)."""
        whole = self.model.state_dict()
        return sum(whole[name].numel() for name in self.stages[stage].state_names())

    def initial_stage_files(self, scratch: Path, initial: bytes | None = None) -> Iterator[Path]:
        """Every stage's model file at step 0, in order, each written to a file in ``scratch`` (and
        its path yielded): the run's initial model as a manifest names it
        (run/_stage_checkpoints.py, ``initial_manifest``). From the seed, each stage's bits are made
        when its file is asked for, one piece at a time, and written from their own memory: one
        stage's weights are the most this holds at once. With ``initial`` (the bytes of the task's
        ``initial_model``, which must fit this model exactly: :class:`RecordError`), each stage's
        part of them."""
        if initial is not None:
            tensors = model_tensors(self.model, initial)  # checked against the shapes (on the meta device)
            parts: Iterator[dict[str, torch.Tensor]] = ({name: tensors[name] for name in stage.state_names()}
                                                        for stage in self.stages)
        else:
            parts = self._seeded_stages()
        for i, part in enumerate(parts):
            path = scratch / f"stage-{i}.safetensors"
            write_state_file(path, part, self._card())
            del part
            yield path

    def _seeded_stages(self) -> Iterator[dict[str, torch.Tensor]]:
        pieces = self.initial.tensors(0, self.stages[-1].last)
        for stage in self.stages:
            part: dict[str, torch.Tensor] = {}
            for _ in range(stage.first, stage.last + 1):
                part.update(next(pieces))
            yield part

    def load_stage(self, stage: int, model_data: bytes, optimizer_data: bytes, step: int | None = None) -> None:
        """Take ``stage``'s checkpoint files (:meth:`stage_files`' form, e.g. by CID from a manifest):
        its parameters, their optimizer state and the step (which must be ``step`` when given); the
        other stages are not held after it. :class:`RecordError` for files that are not exactly
        that stage's, and nothing is changed."""
        s = self.stages[stage]
        self.load_parts(stage, [(s.first, s.last, model_data, optimizer_data)], step)

    def load_parts(self, stage: int, parts: Sequence[tuple[int, int, bytes, bytes]], step: int | None = None) -> None:
        """Take ``stage`` from the checkpoint files of the stages of a manifest that cover its pieces
        (``(first, last, model file, optimizer file)`` each, maybe of another cut: a plan moved it):
        each file must hold exactly pieces ``first..last``'s tensors (its optimizer file their
        parameters' state only, of one step, ``step`` when given); this stage's are kept. Stage
        files keep the whole model's names and optimizer indices, so the union of the parts is
        what :meth:`stage_files` of the stage would hold. :class:`RecordError` as :meth:`load_stage`,
        and for a part whose pieces are not this model's (checked first: a slice would take pieces
        ``-3..7`` for the last three and ``5..1000`` for ``5..7``, and a manifest named them)."""
        count = len(self._piece_names)
        for first, last, _, _ in parts:
            if not 0 <= first <= last < count:
                raise RecordError(f"pieces {first}..{last} are not pieces of this model's {count}")
        names, at_stage = set(self.stages[stage].state_names()), (self.stages[stage].first, self.stages[stage].last)
        tensors: dict[str, torch.Tensor] = {}
        optim: dict[str, torch.Tensor] = {}
        steps: set[int] = set()
        for first, last, model_data, optimizer_data in parts:
            what = f"stage {stage}" if (first, last) == at_stage else f"pieces {first}..{last}"
            if read_model_card(model_data) != self._card():
                raise RecordError(f"{what}'s model file is not of this task's model")
            found = read_tensors(model_data)
            own: set[str] = set().union(*self._piece_names[first : last + 1])
            if set(found) != own:
                raise RecordError(f"the model file does not hold exactly {what}'s tensors")
            tensors.update((n, t) for n, t in found.items() if n in names)
            part = read_tensors(optimizer_data)
            saved = part.pop("trainer.step", None)
            if saved is None or saved.dtype != torch.int64 or saved.numel() != 1:
                raise RecordError("optimizer file has no valid trainer.step")
            steps.add(int(saved))
            for name, t in part.items():
                at = int(name.split(".")[1]) if INDEX_NAME.fullmatch(name) else -1
                if not 0 <= at < len(self._param_names) or self._param_names[at] not in own:
                    raise RecordError(f"the optimizer file's {name!r} is no state of {what}")
                if self._param_names[at] in names:
                    optim[name] = t
        if len(steps) != 1:
            raise RecordError(f"stage {stage}'s optimizer files are of steps {sorted(steps)}")
        if step is not None and steps != {step}:
            raise RecordError(f"stage {stage}'s optimizer file is of step {steps.pop()}, the checkpoint's is {step}")
        saved = torch.tensor(steps.pop(), dtype=torch.int64)
        whole = self.model.state_dict()
        if set(tensors) != names:
            raise RecordError(f"the model files do not hold exactly stage {stage}'s tensors")
        for name in names:
            if tensors[name].shape != whole[name].shape or tensors[name].dtype != whole[name].dtype:
                raise RecordError(f"stage {stage}'s tensor {name}: {tuple(tensors[name].shape)} {tensors[name].dtype}")
        indices, keys = self._stage_indices(stage), self.optimizer_state_keys()
        held: dict[int, set[str]] = {}
        for name, t in sorted(optim.items()):
            _, index, key = name.split(".", 2) if INDEX_NAME.fullmatch(name) else ("", "-1", "")
            if int(index) not in indices or key not in keys:
                raise RecordError(f"the optimizer file's {name!r} is no state of stage {stage}")
            param = self.params[int(index)]
            if t.numel() != 1 if key == "step" else (t.shape != param.shape or t.dtype != param.dtype):
                raise RecordError(f"optimizer tensor {name} has shape {tuple(t.shape)} {t.dtype}")
            held.setdefault(int(index), set()).add(key)
        # A parameter's state is all of the optimizer's keys or none (a step count that is one number):
        # a file that loads but that the optimizer cannot step would fail this member's first step.
        partial = sorted(i for i, held_keys in held.items() if held_keys != keys)
        if partial:
            raise RecordError(f"the optimizer file keeps {sorted(held[partial[0]])} of parameter {partial[0]}'s "
                              f"state, not {sorted(keys)}")
        self._hold({stage})
        self._load_tensors(tensors, optim, int(saved))  # checks the optimizer's keys and shapes
        self.whole, self.trained = False, stage
