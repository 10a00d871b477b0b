"""A member of a local-SGD pipelined run (run/_stage_local_sgd.py) takes its stage of a moved cut
(``[pipeline] balance = "recut"``) from the files of the old cut's stages that cover it, as a sync
member does (tests/pipeline/test_recut_loads.py): weights and outer state alike. A stage file's
optimizer file holds the outer step and each parameter's outer momentum under its whole-model index
(``state.<index>.outer_momentum``), so the new stage holds exactly what the old files held of its
pieces, bit for bit; its next outer step is the one the old cut's replicas take for the same
pseudo-gradients (the momentum counts in it), and cut back it writes the old files' bytes again.
Under ``[outer] optimizer = "average"`` (no outer state) the files hold the step only."""

from __future__ import annotations

import pytest
import torch

from p2ptrain.protocol import read_tensors
from p2ptrain.run import LocalSGDStagedTrainer
from p2ptrain.task import load_task, Task
from p2ptrain.training import manifest_bytes, StageFile

from .conftest import CID, LM_TASK

# 8 pieces (embedding, 6 blocks, head) in 3 stages; Adam inside (each member's own, in no file).
BASE = (LM_TASK.replace("depth = 2", "depth = 6").replace('name = "sgd"\nlr = 0.1', 'name = "adam"\nlr = 0.01')
        .replace("total_steps = 10", 'total_steps = 10\nmode = "local_sgd"\ninner_steps = 2'))
# The trainer takes any cut a plan names whatever the task's balance (protocol/_recut.py checks who may name one).
PIPELINE = "[pipeline]\nstages = 3\n"
NESTEROV = load_task(BASE + '[outer]\noptimizer = "nesterov"\n' + PIPELINE)
AVERAGE = load_task(BASE + '[outer]\noptimizer = "average"\n' + PIPELINE)
NEW = (0, 2, 6, 8)


def _outer_step(member: LocalSGDStagedTrainer, stage: int, seed: int) -> None:
    """One outer step of ``stage``: an inner step on made-up gradients, then the outer step with a
    made-up ring sum of pseudo-gradients, a function of each parameter's name and ``seed`` only, so
    any cut's members of the stage get the same sum for the same parameter."""
    member.begin_round(stage)
    for p in member.stages[stage].parameters():
        p.grad = torch.ones_like(p)
    assert member.inner_step_stage(stage, 0, 1, 1)
    member.pseudo_gradient(stage)
    for name, p in member.model.named_parameters():
        if any(p is q for q in member.stages[stage].parameters()):
            g = torch.Generator().manual_seed(seed * 1000 + sum(map(ord, name)))
            p.grad = 0.01 * torch.randn(p.shape, generator=g)
    member.apply_outer(stage, 2, 0.0)


def _trained(task: Task) -> tuple[list[LocalSGDStagedTrainer], list[tuple[bytes, bytes]]]:
    """One member per stage of the task's cut, each after two outer steps (momentum non-zero)."""
    members = [LocalSGDStagedTrainer(task, device="cpu") for _ in range(3)]
    for stage, member in enumerate(members):
        member.take_stage(stage)
        for step in range(2):
            _outer_step(member, stage, step)
    return members, [member.stage_files(stage) for stage, member in enumerate(members)]


def _parts(old: list[LocalSGDStagedTrainer], files: list[tuple[bytes, bytes]], first: int,
           last: int) -> list[tuple[int, int, bytes, bytes]]:
    stages = old[0].stages
    return [(s.first, s.last, *f) for s, f in zip(stages, files, strict=True) if s.first <= last and first <= s.last]


def _moved(task: Task, old: list[LocalSGDStagedTrainer], files: list[tuple[bytes, bytes]],
           stage: int) -> LocalSGDStagedTrainer:
    """A member that loads the checkpoint's manifest, takes the new cut and loads ``stage`` of it."""
    member = LocalSGDStagedTrainer(task, device="cpu")
    manifest = manifest_bytes([StageFile(s.first, s.last, CID, CID, 1) for s in old[0].stages])
    member.load_manifest(manifest, manifest, 2)
    member.recut(NEW)
    member.load_parts(stage, _parts(old, files, NEW[stage], NEW[stage + 1] - 1), step=2)
    return member


@pytest.mark.parametrize("task", [NESTEROV, AVERAGE], ids=["nesterov", "average"])
def test_a_stage_of_a_new_cut_holds_the_old_files_weights_and_outer_state(task: Task) -> None:
    old, files = _trained(task)
    assert old[0].cut == (0, 3, 5, 8)
    whole: dict[str, torch.Tensor] = {}
    outer: dict[str, torch.Tensor] = {}
    for model_data, optim_data in files:
        whole.update(read_tensors(model_data))
        outer.update(read_tensors(optim_data))
    nesterov = task.outer is not None and task.outer.optimizer == "nesterov"
    assert len(outer) == 1 + (len(whole) if nesterov else 0)  # the step, and one momentum per parameter (Nesterov)
    for stage in range(3):
        member = _moved(task, old, files, stage)
        assert member.cut == NEW and member.step == 2 and member.holds(stage)
        model, optim = member.stage_files(stage)
        tensors = read_tensors(model)
        assert set(tensors) == set(member.stages[stage].state_names())
        assert all(torch.equal(t, whole[n]) for n, t in tensors.items())
        mine = read_tensors(optim)
        indices = member._stage_indices(stage)
        assert set(mine) == {"trainer.step"} | ({f"state.{i}.outer_momentum" for i in indices} if nesterov else set())
        assert all(torch.equal(t, outer[n]) for n, t in mine.items() if n != "trainer.step")
        assert all(t.abs().sum() > 0 for n, t in mine.items() if n != "trainer.step")


def test_the_next_outer_step_of_a_new_cut_is_the_old_cut_s_bit_for_bit() -> None:
    """The outer step of the moved stage, for the ring sum the old cut's replicas take, gives their
    bits: weights and momentum (lost momentum would give other bits: Nesterov's step reads it)."""
    old, files = _trained(NESTEROV)
    moved = [_moved(NESTEROV, old, files, stage) for stage in range(3)]
    for stage, member in enumerate(old):
        _outer_step(member, stage, 2)
    for stage, member in enumerate(moved):
        _outer_step(member, stage, 2)
    reference = {n: t for member in old for n, t in member.model.state_dict().items() if not t.is_meta}
    momenta = {n: t for member in old for n, t in member.optimizer_tensors().items() if n != "trainer.step"}
    for stage, member in enumerate(moved):
        assert member.step == 3
        held = member.model.state_dict()
        assert all(torch.equal(held[n], reference[n]) for n in member.stages[stage].state_names())
        mine = {n: t for n, t in member.optimizer_tensors().items() if n != "trainer.step"}
        assert mine and all(torch.equal(t, momenta[n]) for n, t in mine.items())


def test_cut_back_a_local_sgd_stage_writes_the_old_files_again() -> None:
    old, files = _trained(NESTEROV)
    moved = _moved(NESTEROV, old, files, 1)
    new_files = moved.stage_files(1)
    # The new stage 1's files (pieces 2..5) are a part a member of the task's cut takes stage 1 (3..4) from.
    back = LocalSGDStagedTrainer(NESTEROV, device="cpu")
    back.back_to(2)
    back.load_parts(1, [(2, 5, *new_files)], step=2)
    assert back.stage_files(1) == files[1]
