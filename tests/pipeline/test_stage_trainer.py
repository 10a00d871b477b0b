"""A pipelined member's trainer (run/_stage_trainer.py): it steps its stage only; the stages' files
assemble into the bits one trainer of the whole model holds after the same steps (what records,
attestations and ``model fetch`` rely on), and a member that loads a checkpoint takes its manifest,
then only the stage its plan names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from p2ptrain.ipfs import EmbeddedStore
from p2ptrain.protocol import read_model_card, read_tensors, RecordError, state_bytes, tensors_bytes

from p2ptrain.run._stage_checkpoints import initial_manifest
from p2ptrain.run._stage_trainer import StagedTrainer
from p2ptrain.task import load_task
from p2ptrain.training import manifest_bytes, model_file, read_manifest, StageFile, Trainer, TrainerError

from .conftest import LM_TASK

TASK = load_task(LM_TASK.replace('name = "sgd"\nlr = 0.1', 'name = "adam"\nlr = 0.01') + "[pipeline]\nstages = 2\n")
REPLICAS = 2


def gradients(model: torch.nn.Module, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {name: torch.randn(p.shape, generator=g) for name, p in model.named_parameters()}


def allocated(member: StagedTrainer) -> int:
    """The bytes of this member's weights, gradients and optimizer state that are allocated."""
    tensors = [*member.model.parameters(), *(p.grad for p in member.model.parameters() if p.grad is not None),
               *(t for st in member.optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor))]
    return sum(t.numel() * t.element_size() for t in tensors if not t.is_meta)


def materialized(member: StagedTrainer) -> int:
    """How many parameter elements this member's model holds in memory (not on the meta device)."""
    return sum(p.numel() for p in member.model.parameters() if not p.is_meta)


def test_a_member_holds_only_the_stage_it_takes() -> None:
    """Built from the seed a member holds nothing (it can take any stage at step 0); once it takes
    one, what it allocates is its stage's weights, gradients and Adam's two moments, no more."""
    member = StagedTrainer(TASK, device="cpu")
    assert allocated(member) == 0 and materialized(member) == 0
    assert member.holds(0) and member.holds(1)  # from the seed: every stage at step 0
    member.take_stage(0)
    assert all(p.is_meta for p in member.stages[1].parameters())
    for p in member.stages[0].parameters():
        p.grad = torch.ones_like(p)
    member.apply_stage(0, 0.0)
    assert member.holds(0) and not member.holds(1)  # step 1: stage 1 is no longer the seed's
    with pytest.raises(TrainerError, match="holds stage 0 at step 1, not stage 1"):
        member.take_stage(1)
    stage = sum(p.numel() * p.element_size() for p in member.stages[0].parameters())
    # Its weights and Adam's two moments (the gradients are set to None by the step), and Adam's steps.
    assert 3 * stage <= allocated(member) <= 3 * stage + 8 * len(list(member.stages[0].parameters()))


DEEP_TASK = LM_TASK.replace("depth = 2", "depth = 6") + "[pipeline]\nstages = 4\n"  # 8 pieces
DEEP = load_task(DEEP_TASK)


@pytest.mark.parametrize("order", [(0,), (3,), (2, 1), (1, 3, 0)])
def test_a_member_builds_only_its_stage_with_the_bits_of_the_whole_build(order: tuple[int, ...], tmp_path: Path) -> None:
    """A member never materializes more than the stage it takes: its model holds that stage's
    parameter elements only, after construction (none), after hashing every stage's initial files
    (the chain's root) and after taking a stage (in any order at step 0: a retry of the first step
    may move it); and those are the very bits one process's whole model gets from the seed."""
    whole = Trainer(DEEP, device="cpu").model.state_dict()
    member = StagedTrainer(DEEP, device="cpu")
    assert materialized(member) == 0
    for path, stage in zip(member.initial_stage_files(tmp_path), member.stages, strict=True):
        part = read_tensors(path.read_bytes())
        assert set(part) == set(stage.state_names()) and all(torch.equal(part[n], whole[n]) for n in part)
        assert materialized(member) == 0
    for index in order:
        stage = member.take_stage(index)
        assert materialized(member) == sum(p.numel() for p in stage.parameters())
        held = member.model.state_dict()
        assert all(torch.equal(held[name], whole[name]) for name in stage.state_names())
        assert all(p.is_meta for i, s in enumerate(member.stages) if i != index for p in s.parameters())


def test_the_initial_manifest_is_the_whole_builds_stages_without_the_whole(tmp_path: Path) -> None:
    """The chain's root of a pipelined run is the manifest of every stage's initial files: the same
    CID on every member and by ``model verify``, computed one stage at a time, and it assembles into
    one process's initial model file; a run from an ``initial_model`` cuts that file instead, and a
    member then holds no stage until it loads its own from the files stored beside the manifest."""
    store = EmbeddedStore(tmp_path)
    single = Trainer(DEEP, device="cpu")
    root = initial_manifest(store, StagedTrainer(DEEP, device="cpu"))
    assert root == initial_manifest(store, StagedTrainer(DEEP, device="cpu"), only_hash=True)
    # The files cut from one process's model file: stored, so the manifest assembles into that file.
    assert initial_manifest(store, StagedTrainer(DEEP, device="cpu"), single.model_bytes()) == root
    assert model_file(store, root) == single.model_bytes()
    # Each stage's file, written from its tensors' memory, has the bytes state_bytes gives them.
    whole = single.model.state_dict()
    for stage, entry in zip(StagedTrainer(DEEP, device="cpu").stages, read_manifest(store.cat(root)), strict=True):
        own = state_bytes({name: whole[name] for name in stage.state_names()}, read_model_card(single.model_bytes()))
        assert store.cat(entry.model) == own

    other = StagedTrainer(load_task("seed = 1\n" + DEEP_TASK), device="cpu")
    assert initial_manifest(store, other, only_hash=True) != root  # the seed makes the root
    pinned = load_task(f'initial_model = "{root}"\n' + DEEP_TASK)
    member = StagedTrainer(pinned, device="cpu")
    assert not member.holds(0) and not member.holds(2)  # its bits are the file's, not the seed's
    with pytest.raises(RecordError, match="does not fit"):
        list(member.initial_stage_files(tmp_path, Trainer(load_task(LM_TASK), device="cpu").model_bytes()))
    entry = read_manifest(store.cat(root))[2]
    member.load_stage(2, store.cat(entry.model), store.cat(entry.optimizer), 0)
    assert member.holds(2) and materialized(member) == entry.parameters


def test_a_rolled_back_step_holds_its_stage_as_it_was() -> None:
    member = StagedTrainer(TASK, device="cpu")
    fresh = member.stage_files(1)[0]
    member.take_stage(1)
    for p in member.stages[1].parameters():
        p.grad = torch.ones_like(p)
    member.apply_stage(1, 0.0)
    assert member.stage_files(1)[0] != fresh
    member.align(0)  # a retry of step 0: the step is rolled back
    assert member.step == 0 and member.trained == 1 and all(p.is_meta for p in member.stages[0].parameters())
    assert member.stage_files(1)[0] == fresh


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
            for name, p in member.take_stage(stage).model_parameters():
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


def test_a_loaded_manifest_holds_no_stage_until_one_is_loaded_from_it(tmp_path: Path) -> None:
    """Resume, resync and a joiner take a pipelined record's manifest (its model and optimizer CID)
    and hold no stage at its step; then the one stage their plan names, of that step only."""
    trained = [StagedTrainer(TASK, device="cpu") for _ in range(2)]
    for stage, member in enumerate(trained):
        for p in member.take_stage(stage).parameters():
            p.grad = torch.ones_like(p)
        member.apply_stage(stage, 0.0)
    store = EmbeddedStore(tmp_path)
    files = [member.stage_files(stage) for stage, member in enumerate(trained)]
    entries = [StageFile(s.first, s.last, store.add_bytes(m), store.add_bytes(o), trained[0].stage_numbers(i))
               for i, (s, (m, o)) in enumerate(zip(trained[0].stages, files, strict=True))]
    manifest = manifest_bytes(entries)
    assert entries[0].parameters + entries[1].parameters == sum(
        t.numel() for t in read_tensors(model_file(store, store.add_bytes(manifest))).values())

    member = StagedTrainer(TASK, device="cpu")
    with pytest.raises(RecordError, match="name one manifest"):
        member.load_manifest(manifest, b"optimizer", 1)
    # A manifest of another cut of the pieces is one (a plan may move the cut: test_recut_loads.py);
    # one that does not cover them all is not.
    short = manifest_bytes([StageFile(0, 0, e.model, e.optimizer, e.parameters) if i == 0 else
                            StageFile(1, entries[1].last - 1, e.model, e.optimizer, e.parameters)
                            for i, e in enumerate(entries)])
    with pytest.raises(RecordError, match="not a cut of this task's pieces"):
        member.load_manifest(short, short, 1)
    assert member.step == 0 and member.holds(1)  # refused: nothing changed
    member.load_manifest(manifest, manifest, 1)
    assert member.step == 1 and not member.holds(0) and not member.holds(1)
    assert allocated(member) == 0  # it holds no stage, so nothing
    with pytest.raises(TrainerError, match="holds no stage at step 1"):
        member.take_stage(1)
    with pytest.raises(RecordError, match="of step 1, the checkpoint's is 2"):
        member.load_stage(1, *files[1], step=2)
    member.load_stage(1, *files[1], step=1)
    assert member.holds(1) and not member.holds(0) and member.stage_files(1) == files[1]
    assert all(p.is_meta for p in member.stages[0].parameters())


def test_a_member_moved_before_the_first_record_takes_its_new_stage_from_the_seed() -> None:
    """A retry of step 0 may move a member that took another stage: it makes the new one from the
    seed, the bits every member has for it, and frees the one it held."""
    member, fresh = StagedTrainer(TASK, device="cpu"), StagedTrainer(TASK, device="cpu")
    member.take_stage(0)
    member.take_stage(1)
    assert member.trained == 1 and member.step == 0
    assert member.stage_files(1) == fresh.stage_files(1)
    assert all(p.is_meta for p in member.stages[0].parameters())


def test_a_member_sent_back_to_a_checkpoint_drops_its_stage_and_steps_the_one_it_loads() -> None:
    """A stage lost every replica: the run goes back to its last checkpoint. A member of stage 0,
    two steps on and with a failed step's gradients still in its stage, drops all of it (weights,
    gradients, Adam's moments) and takes stage 1 from the checkpoint's files; its next step steps
    that stage only (the dropped gradients, on the meta device, are not stepped)."""
    member, fresh = StagedTrainer(TASK, device="cpu"), StagedTrainer(TASK, device="cpu")
    member.take_stage(0)
    for _ in range(2):
        for p in member.stages[0].parameters():
            p.grad = torch.ones_like(p)
        member.apply_stage(0, 0.0)
    for p in member.stages[0].parameters():
        p.grad = torch.ones_like(p)  # the failed step's
    member.back_to(0)
    assert member.step == 0 and member.trained is None and allocated(member) == 0
    member.load_stage(1, *fresh.stage_files(1), 0)
    assert member.stage_files(1) == fresh.stage_files(1)
    for p in member.stages[1].parameters():
        p.grad = torch.ones_like(p)
    member.apply_stage(1, 0.0)
    assert member.step == 1 and all(p.is_meta and p.grad is None for p in member.stages[0].parameters())
