"""A pipelined run's model by CID: a manifest of stage files, which every fetch path assembles into
the whole model, byte for byte the file one trainer of the whole model writes; anything in a
manifest or its files that does not make that model is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from p2ptrain.api import ensure_local
from p2ptrain.base import UserError
from p2ptrain.cli.main import main as cli_main
from p2ptrain.ipfs import ContentUnavailable, FileTooLarge, open_store
from p2ptrain.models import cut_pieces
from p2ptrain.protocol import read_tensors, RecordError, state_bytes
from p2ptrain.task import load_task
from p2ptrain.training import (is_manifest, load_model, manifest_bytes, ManifestError, model_file, read_manifest,
                               stage_file_cids, StageFile, Trainer)

from .conftest import LM_TASK

TASK = load_task(LM_TASK + "[pipeline]\nstages = 2\n")


def stage_files(trainer: Trainer, store, cuts: list[tuple[int, int]]) -> list[StageFile]:
    """Each stage's model file (its pieces' tensors, the whole model's card) added to ``store``."""
    pieces, _ = cut_pieces(trainer.model, 2)
    whole = trainer.model.state_dict()
    out = []
    for first, last in cuts:
        names = {f"{prefix}." for piece in pieces[first : last + 1] for prefix in piece.prefixes}
        own = {k: v for k, v in whole.items() if any(k.startswith(p) for p in names)}
        cid = store.add_bytes(state_bytes(own, trainer._card()))
        out.append(StageFile(first, last, cid, cid, sum(t.numel() for t in own.values())))
    return out


@pytest.fixture
def made(tmp_path: Path):
    trainer = Trainer(TASK, total_steps=1, device="cpu")
    store = open_store(tmp_path)
    stages = stage_files(trainer, store, [(0, 1), (2, 3)])
    return trainer, store, stages, store.add_bytes(manifest_bytes(stages))


def test_a_manifest_assembles_into_the_whole_trainers_file(made, tmp_path: Path) -> None:
    trainer, store, stages, cid = made
    assert is_manifest(store.cat(cid)) and read_manifest(store.cat(cid)) == tuple(stages)
    assert stage_file_cids(store, cid) == [s.model for s in stages]
    assert model_file(store, cid) == trainer.model_bytes()  # the data-parallel checkpoint's bytes
    loaded = load_model(cid, store=store)
    assert all(torch.equal(v, trainer.model.state_dict()[k]) for k, v in loaded.state_dict().items())
    # model fetch writes the whole file; a model file's CID is no manifest and lists no stages.
    out = tmp_path / "m.safetensors"
    assert cli_main(["model", "fetch", cid, "-o", str(out), "--home", str(tmp_path)]) == 0
    assert out.read_bytes() == trainer.model_bytes()
    plain = store.add_bytes(trainer.model_bytes())
    assert stage_file_cids(store, plain) == [] and model_file(store, plain) == trainer.model_bytes()


def test_a_stage_file_missing_is_named(made, tmp_path: Path) -> None:
    _, store, stages, _ = made
    absent = store.add_bytes(b"a stage file this store never held", only_hash=True)
    cid = store.add_bytes(manifest_bytes([stages[0], StageFile(2, 3, absent, absent, stages[1].parameters)]))
    with pytest.raises(ContentUnavailable):
        model_file(store, cid)
    # No node runs in this home and no bootstrap is given: the line names the missing stage file.
    with pytest.raises(UserError, match=absent):
        ensure_local(tmp_path, [cid], [])


def test_what_does_not_make_the_model_is_refused(made) -> None:
    trainer, store, stages, _ = made

    def assembled(entries: list[StageFile]) -> bytes:
        return model_file(store, store.add_bytes(manifest_bytes(entries)))

    swapped = [StageFile(0, 1, stages[1].model, stages[1].optimizer, stages[1].parameters),
               StageFile(2, 3, stages[0].model, stages[0].optimizer, stages[0].parameters)]
    with pytest.raises(RecordError, match="tensors of pieces 0..1"):
        assembled(swapped)
    with pytest.raises(RecordError, match="count"):
        assembled([stages[0], StageFile(2, 3, stages[1].model, stages[1].optimizer, stages[1].parameters + 1)])
    other = store.add_bytes(state_bytes(read_tensors(store.cat(stages[1].model)), {"name": "transformer_lm", "kwargs": {
        **trainer._card()["kwargs"], "heads": 4}}))
    with pytest.raises(RecordError, match="another model card"):
        assembled([stages[0], StageFile(2, 3, other, other, stages[1].parameters)])
    with pytest.raises(RecordError, match="cover 3 pieces"):
        assembled([stages[0], StageFile(2, 2, stages[1].model, stages[1].optimizer, stages[1].parameters)])
    with pytest.raises(FileTooLarge):  # the files together are bounded as one model file
        model_file(store, store.add_bytes(manifest_bytes(stages)), max_bytes=len(trainer.model_bytes()) // 2)


@pytest.mark.parametrize("body", [
    {"format": "p2ptrain.stages/1", "stages": [{"first": 0, "last": 1, "model": "x", "optimizer": "x", "parameters": 1}] * 2},
    {"format": "p2ptrain.stages/1", "stages": []},
    {"format": "p2ptrain.stages/1", "stages": [{"first": 1, "last": 1, "model": "x", "optimizer": "x", "parameters": 1}]},
    {"format": "p2ptrain.stages/1", "stages": [], "extra": 1},
])
def test_a_manifest_of_another_shape_is_refused(made, body) -> None:
    _, _, stages, _ = made
    text = json.dumps(body).replace('"x"', json.dumps(stages[0].model))
    with pytest.raises(ManifestError):
        read_manifest(text.encode())


def test_a_manifest_not_in_canonical_form_is_refused(made) -> None:
    _, _, stages, _ = made
    canonical = manifest_bytes(stages)
    assert is_manifest(canonical)
    spaced = canonical.replace(b'"stages":', b'"stages": ')
    assert is_manifest(spaced)
    with pytest.raises(ManifestError, match="canonical"):
        read_manifest(spaced)
