"""A pipelined run's model may be larger than one member may hold (issue 31: models no single peer
holds; `transformer_lm` up to ``MAX_PIPELINED_PARAMETERS``, each stage within ``MAX_PARAMETERS``),
and whoever fetches, loads, evaluates or serves it makes it one file and one module
(training/_stage_files.py, ``model_from_bytes``). The bounds stay those of the architecture the
files name: a stage file is at most one member's model file, the stages together at most an honest
file of that architecture, and a file whose card names a large model allocates nothing until its
bytes could hold it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from p2ptrain.ipfs import EmbeddedStore, FileTooLarge
from p2ptrain.models import MAX_PARAMETERS, meta_model, pieces_of
from p2ptrain.protocol import read_model_card, read_tensors, RecordError, state_bytes, tensors_bytes
from p2ptrain.run._stage_trainer import StagedTrainer
from p2ptrain.task import load_task
from p2ptrain.training import load_model, manifest_bytes, model_file, model_from_bytes, read_manifest, StageFile

from .conftest import LM_TASK

# 59.7 M parameters in 4 stages of at most 15 M: over one member's cap, a valid pipelined task.
BIG = {"vocab_size": 256, "context": 64, "width": 576, "depth": 15, "heads": 8}
TASK = LM_TASK.replace("kwargs = { vocab_size = 61, context = 16, width = 16, depth = 2, heads = 2 }",
                       "kwargs = { vocab_size = 256, context = 64, width = 576, depth = 15, heads = 8 }")
TASK += "[pipeline]\nstages = 4\n"


def stored_stages(store: EmbeddedStore, scratch: Path) -> str:
    """The task's initial stage files (from the seed, one stage in memory at a time) stored, and
    the manifest naming them."""
    trainer = StagedTrainer(load_task(TASK), device="cpu")
    optim = str(store.add_bytes(tensors_bytes({"trainer.step": torch.tensor(0, dtype=torch.int64)})))
    entries = []
    for i, path in enumerate(trainer.initial_stage_files(scratch)):
        stage = trainer.stages[i]
        entries.append(StageFile(stage.first, stage.last, str(store.add_file(path)), optim, trainer.stage_numbers(i)))
        path.unlink()
    return str(store.add_bytes(manifest_bytes(entries)))


def test_a_pipelined_model_over_one_members_cap_is_made_one_and_loaded(tmp_path: Path) -> None:
    parameters = sum(p.numel() for p in meta_model("transformer_lm", BIG).parameters())
    assert parameters > MAX_PARAMETERS
    store = EmbeddedStore(tmp_path / "home")
    cid = stored_stages(store, tmp_path)
    module = load_model(cid, store=store)  # on main: refused, the whole file over one member's bound
    assert sum(p.numel() for p in module.parameters()) == parameters
    # The bits are the stages' files', every one of them.
    state = module.state_dict()
    for entry in read_manifest(store.cat(cid)):
        for name, tensor in read_tensors(store.cat(entry.model)).items():
            assert torch.equal(state[name], tensor), name


def test_a_small_file_whose_card_names_a_large_model_allocates_nothing() -> None:
    """A few bytes naming a 59.7 M-parameter model, which a pipelined run's file may now be: refused
    before anything is built (the cap alone would let such a card allocate 240 MB before the load
    found the file short)."""
    card = read_model_card(state_bytes({"x": torch.zeros(1)}, {"name": "transformer_lm", "kwargs": BIG}))
    assert card is not None
    with pytest.raises(RecordError, match="cannot hold"):
        model_from_bytes(state_bytes({"x": torch.zeros(1)}, card))


def test_stage_files_are_bounded_by_their_architecture(tmp_path: Path) -> None:
    """A manifest whose files' card names a small model cannot make the assembly read more than an
    honest file of that model: a second stage file padded with a large extra tensor is cut off by
    the bound as it is read (on main, the bound was one member's whole model file, ~200 MB)."""
    store = EmbeddedStore(tmp_path / "home")
    small = {"vocab_size": 61, "context": 16, "width": 16, "depth": 2, "heads": 2}
    card = {"name": "transformer_lm", "kwargs": small}
    model = meta_model("transformer_lm", small)
    pieces = [sorted(piece.state_names()) for piece in pieces_of(model)]
    honest = {name: torch.zeros(model.state_dict()[name].shape) for name in pieces[0] + pieces[1]}
    rest = {name: torch.zeros(model.state_dict()[name].shape) for name in pieces[2] + pieces[3]}
    padded = {**rest, "padding": torch.zeros(4_000_000)}  # 16 MB where the model takes ~40 KB
    optim = str(store.add_bytes(tensors_bytes({"trainer.step": torch.tensor(0, dtype=torch.int64)})))
    entries = [StageFile(0, 1, str(store.add_bytes(state_bytes(honest, card))), optim,
                         sum(t.numel() for t in honest.values())),
               StageFile(2, 3, str(store.add_bytes(state_bytes(padded, card))), optim,
                         sum(t.numel() for t in rest.values()))]
    with pytest.raises(FileTooLarge):
        model_file(store, str(store.add_bytes(manifest_bytes(entries))))
