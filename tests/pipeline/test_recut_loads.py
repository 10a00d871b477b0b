"""A member takes its stage of a moved cut (``[pipeline] balance = "recut"``) from the files of the
old cut's stages that cover it (run/_stage_trainer.py, ``recut`` and ``load_parts``): stage files keep
the whole model's tensor names and optimizer indices, so the new stage is exactly what the old files
held of its pieces, weights and Adam state alike, bit for bit, and cut back it writes the old files'
bytes again. A file that holds other pieces than its entry says is refused, and nothing changes."""

from __future__ import annotations

import pytest
import torch

from p2ptrain.models import PartitionError
from p2ptrain.protocol import read_tensors, RecordError
from p2ptrain.run._stage_trainer import StagedTrainer
from p2ptrain.task import load_task
from p2ptrain.training import manifest_bytes, StageFile

from .conftest import CID, LM_TASK

# 8 pieces (embedding, 6 blocks, head) in 3 stages, Adam: an optimizer file holds two moments a parameter.
TASK = load_task(LM_TASK.replace("depth = 2", "depth = 6").replace('name = "sgd"\nlr = 0.1', 'name = "adam"\nlr = 0.01')
                 + '[pipeline]\nstages = 3\nbalance = "recut"\n')
NEW = (0, 2, 6, 8)


def _trained() -> tuple[list[StagedTrainer], list[tuple[bytes, bytes]]]:
    """One member per stage of the task's cut, each after two steps of made-up gradients."""
    members = [StagedTrainer(TASK, device="cpu") for _ in range(3)]
    for stage, member in enumerate(members):
        for step in range(2):
            g = torch.Generator().manual_seed(10 * stage + step)
            for p in member.take_stage(stage).parameters():
                p.grad = torch.randn(p.shape, generator=g)
            member.apply_stage(stage, 0.0)
    return members, [member.stage_files(stage) for stage, member in enumerate(members)]


def _parts(old: list[StagedTrainer], files: list[tuple[bytes, bytes]], first: int,
           last: int) -> list[tuple[int, int, bytes, bytes]]:
    stages = old[0].stages
    return [(s.first, s.last, *f) for s, f in zip(stages, files, strict=True) if s.first <= last and first <= s.last]


def test_a_stage_of_a_new_cut_is_what_the_old_files_held_of_its_pieces() -> None:
    old, files = _trained()
    assert old[0].cut == (0, 3, 5, 8)
    whole: dict[str, torch.Tensor] = {}
    for model_data, _ in files:
        whole.update(read_tensors(model_data))
    for stage in range(3):
        member = StagedTrainer(TASK, device="cpu")
        manifest = manifest_bytes([StageFile(s.first, s.last, CID, CID, 1) for s in old[0].stages])
        member.load_manifest(manifest, manifest, 2)
        member.recut(NEW)
        assert member.cut == NEW and [(s.first, s.last) for s in member.stages] == [(0, 1), (2, 5), (6, 7)]
        a, b = NEW[stage], NEW[stage + 1] - 1
        member.load_parts(stage, _parts(old, files, a, b), step=2)
        assert member.step == 2 and member.holds(stage)
        model, optim = member.stage_files(stage)
        tensors = read_tensors(model)
        assert set(tensors) == set(member.stages[stage].state_names())
        assert all(torch.equal(t, whole[n]) for n, t in tensors.items())
        # Adam's moments of its parameters, under their whole-model indices, as the old files hold them.
        held: dict[str, torch.Tensor] = {}
        for _, optim_data in files:
            held.update(read_tensors(optim_data))
        mine = read_tensors(optim)
        assert len(mine) > 1 and all(torch.equal(t, held[n]) for n, t in mine.items())
        # It trains on: a step of its stage applies (the optimizer state fits its parameters).
        for p in member.stages[stage].parameters():
            p.grad = torch.ones_like(p)
        member.apply_stage(stage, 0.0)
        assert member.step == 3


def test_cut_back_a_stage_writes_the_old_files_again() -> None:
    old, files = _trained()
    moved = StagedTrainer(TASK, device="cpu")
    moved.back_to(2)
    moved.recut(NEW)
    moved.load_parts(1, _parts(old, files, 2, 5), step=2)
    new_files = moved.stage_files(1)
    # The new stage 1's files are themselves a part a member of the task's cut takes stage 1 from.
    back = StagedTrainer(TASK, device="cpu")
    back.back_to(2)
    back.load_parts(1, [(2, 5, *new_files)], step=2)
    assert back.stage_files(1) == files[1]


def test_parts_that_are_not_their_pieces_are_refused_and_change_nothing() -> None:
    old, files = _trained()
    member = StagedTrainer(TASK, device="cpu")
    member.back_to(2)
    member.recut(NEW)
    member.load_parts(0, _parts(old, files, 0, 1), step=2)
    before = member.stage_files(0)
    with pytest.raises(RecordError, match="exactly pieces 0..3"):
        member.load_parts(1, [(0, 3, *files[0]), (3, 5, *files[1])], step=2)  # stage 0's file said to hold piece 3
    with pytest.raises(RecordError, match="no state of pieces 3..4"):
        member.load_parts(1, [(0, 2, *files[0]), (3, 4, files[1][0], files[2][1])], step=2)
    with pytest.raises(RecordError, match="exactly stage 1's tensors"):
        member.load_parts(1, [(3, 4, *files[1])], step=2)  # pieces 3..4 only: stage 1 is 2..5
    with pytest.raises(RecordError, match="of step 2, the checkpoint's is 3"):
        member.load_parts(1, _parts(old, files, 2, 5), step=3)
    assert member.stage_files(0) == before and member.holds(0)
    with pytest.raises(PartitionError):
        member.recut((0, 4, 4, 8))
    assert member.cut == NEW and member.holds(0)


@pytest.mark.parametrize("first, last", [(5, 1000), (-3, 7)], ids=["past-the-end", "negative"])
def test_a_part_whose_pieces_are_not_the_model_s_is_refused(first: int, last: int) -> None:
    """A manifest's entry (or a part) naming pieces the model has not: a slice took ``5..1000`` as
    ``5..7`` and ``-3..7`` as the last three pieces, so stage 2's true file under such an entry
    loaded (a joiner took its stage by CID from a manifest ``load_manifest`` refuses). Fails before
    the range check in ``load_parts``."""
    old, files = _trained()
    member = StagedTrainer(TASK, device="cpu")
    member.back_to(2)
    with pytest.raises(RecordError, match=f"pieces {first}..{last} are not pieces of this model's 8"):
        member.load_parts(2, [(first, last, *files[2])], step=2)
    assert not member.holds(2)
    member.load_parts(2, [(5, 7, *files[2])], step=2)  # the same file under its true pieces
    assert member.holds(2)


def test_a_manifest_cut_no_plan_could_name_is_refused_and_each_entry_read_within_its_pieces(monkeypatch) -> None:
    """A manifest's stages must be a cut a plan of the task may name (``task.cut_problem``): a stage
    wider than one member's ``MAX_PARAMETERS`` had a joiner read a file of up to the whole model (each
    entry's files were read within the whole model's bound); now refused, and each entry's files are
    read within what its own pieces take (``part_limits``). Fails before (load_manifest took any cut)."""
    old, files = _trained()
    member = StagedTrainer(TASK, device="cpu")
    sizes = [sum(p.numel() for p in s.parameters()) for s in old[0].stages]
    monkeypatch.setattr("p2ptrain.task._cuts.MAX_PARAMETERS", max(sizes))  # one member holds a stage, no more
    wide = manifest_bytes([StageFile(0, 0, CID, CID, 1), StageFile(1, 1, CID, CID, 1), StageFile(2, 7, CID, CID, 1)])
    with pytest.raises(RecordError, match="not a cut of this task's pieces: its cut puts .* in stage 2"):
        member.load_manifest(wide, wide, 2)
    ours = manifest_bytes([StageFile(s.first, s.last, CID, CID, 1) for s in old[0].stages])
    member.load_manifest(ours, ours, 2)  # the task's own cut, as every honest manifest's
    for stage, (model, optim) in enumerate(files):
        s = old[0].stages[stage]
        assert len(model) <= member.part_limits(s.first, s.last)[0] < member.state_limits()[0]
        assert len(optim) <= member.part_limits(s.first, s.last)[1] < member.state_limits()[1]
