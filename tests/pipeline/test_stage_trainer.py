"""A pipelined member's trainer (run/_stage_trainer.py): it steps its stage only, and a checkpoint's
gather gives every member the whole model and optimizer state, the bits one trainer of the whole
model holds after the same steps: what records, attestations and ``model fetch`` rely on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from p2ptrain.ipfs import EmbeddedStore
from p2ptrain.protocol import read_tensors, RecordError, tensors_bytes

from p2ptrain.run._stage_trainer import StagedTrainer
from p2ptrain.task import load_task
from p2ptrain.training import manifest_bytes, model_file, StageFile, Trainer, TrainerError

from .conftest import LM_TASK

TASK = load_task(LM_TASK.replace('name = "sgd"\nlr = 0.1', 'name = "adam"\nlr = 0.01') + "[pipeline]\nstages = 2\n")
REPLICAS = 2


def gradients(model: torch.nn.Module, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {name: torch.randn(p.shape, generator=g) for name, p in model.named_parameters()}


def test_stages_stepped_apart_and_gathered_hold_the_whole_trainers_bits() -> None:
    whole = Trainer(TASK, device="cpu")
    members = [StagedTrainer(TASK, device="cpu") for _ in range(2 * REPLICAS)]
    stage_of = [i // REPLICAS for i in range(len(members))]
    for step in range(3):
        grads = gradients(whole.model, step)
        whole.apply(torch.cat([grads[name].reshape(-1) for name, _ in whole.model.named_parameters()]))
        for member, stage in zip(members, stage_of, strict=True):
            for name, p in member.stages[stage].model_parameters():
                p.grad = grads[name].clone()
            member.apply_stage(stage, 0.0)
    # Between checkpoints a member holds only its stage: it cannot be moved to another.
    assert members[0].holds(0) and not members[0].holds(1)
    with pytest.raises(TrainerError, match="holds stage 0 at step 3, not stage 1"):
        members[0].take_stage(1)
    # The gather: one replica of each stage contributes, the sum goes to every member.
    total = sum(m.state_vector(s, contribute=i % REPLICAS == 0) for i, (m, s) in enumerate(zip(members, stage_of)))
    with torch.no_grad():  # a replica gone astray: told when it takes the gathered state
        next(members[REPLICAS - 1].stages[0].parameters()).add_(1e-6)
    for i, member in enumerate(members):
        assert member.load_state_vector(total.clone(), stage_of[i]) is (i != REPLICAS - 1)
        assert member.whole and member.holds(1)
        assert member.model_bytes() == whole.model_bytes()
        assert member.optimizer_bytes() == whole.optimizer_bytes()


def test_a_rolled_back_step_holds_every_stage_again() -> None:
    member = StagedTrainer(TASK, device="cpu")
    for p in member.stages[1].parameters():
        p.grad = torch.ones_like(p)
    member.apply_stage(1, 0.0)
    assert not member.holds(0)
    member.align(0)  # a retry of step 0: the step is rolled back
    assert member.step == 0 and member.holds(0)
    assert member.model_bytes() == StagedTrainer(TASK, device="cpu").model_bytes()


def test_stage_files_assemble_into_the_whole_and_load_back(tmp_path: Path) -> None:
    """Each stage's files, written by its replica before any gather, are what a manifest names: they
    assemble into the whole trainer's model file, their optimizer state is the whole's, and a fresh
    member (a joiner, or one moved there) loads its stage from them alone."""
    whole = Trainer(TASK, device="cpu")
    members = [StagedTrainer(TASK, device="cpu") for _ in range(2)]
    for step in range(2):
        grads = gradients(whole.model, step)
        whole.apply(torch.cat([grads[name].reshape(-1) for name, _ in whole.model.named_parameters()]))
        for stage, member in enumerate(members):
            for name, p in member.stages[stage].model_parameters():
                p.grad = grads[name].clone()
            member.apply_stage(stage, 0.0)
    files = [member.stage_files(stage) for stage, member in enumerate(members)]
    store = EmbeddedStore(tmp_path)
    entries = []
    for stage, (model_data, optim_data) in zip(members[0].stages, files, strict=True):
        entries.append(StageFile(stage.first, stage.last, store.add_bytes(model_data), store.add_bytes(optim_data),
                                 sum(t.numel() for t in read_tensors(model_data).values())))
    assert model_file(store, store.add_bytes(manifest_bytes(entries))) == whole.model_bytes()
    optim: dict[str, torch.Tensor] = {}
    for _, optim_data in files:
        optim.update(read_tensors(optim_data))
    assert tensors_bytes(optim) == whole.optimizer_bytes()

    joiner = StagedTrainer(TASK, device="cpu")
    joiner.load_stage(1, *files[1])
    assert joiner.step == 2 and joiner.holds(1) and not joiner.holds(0)
    assert joiner.stage_files(1) == files[1]
    with pytest.raises(RecordError, match="exactly stage 0"):
        joiner.load_stage(0, *files[1])
    with pytest.raises(RecordError, match="no state of stage 0"):
        joiner.load_stage(0, files[0][0], files[1][1])
    assert joiner.stage_files(1) == files[1] and joiner.holds(1)  # a refused file changed nothing
