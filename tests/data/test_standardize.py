"""``dataset add --standardize``: the train split's per-feature mean and std in the manifest (strictly
parsed, absent from older manifests, whose CIDs do not change), applied by IPFSDataset and so by
``model eval``; and the trainer's warning when the first losses are enormous (raw features)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from p2ptrain.testing import run_forked
from p2ptrain.base import boundedjson
from p2ptrain.data import IPFSDataset, Manifest, ManifestError, build_dataset, load_source
from p2ptrain.data._manifest import MAX_STANDARDIZE_FEATURES
from p2ptrain.ipfs import open_store
from p2ptrain.training import Trainer, batched, batches_forever
from p2ptrain.models import build_model
from p2ptrain.protocol import model_bytes
from p2ptrain.task import load_task

P2PTRAIN = str(Path(sys.executable).with_name("p2ptrain"))
# sklearn:breast_cancer in 4 shards, test fraction 0.2, seed 0, built before --standardize existed.
BREAST_CANCER_CID = "bafkreifsifito2uu5jir6mxu5656qohxdyum6vh23vp4kpnu3sssf4t65q"


def _p2ptrain(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    return run_forked([P2PTRAIN, *args, "--home", str(home)], capture_output=True, text=True, timeout=120)


def test_a_manifest_without_standardize_keeps_its_cid(tmp_path: Path) -> None:
    name, features, labels = load_source("sklearn:breast_cancer")
    cid, manifest = build_dataset(open_store(tmp_path), name, features, labels, 4)
    assert cid == BREAST_CANCER_CID and manifest.standardize is None
    assert b"standardize" not in manifest.to_json()


def test_standardize_is_computed_on_train_stored_and_applied_by_the_dataset_and_model_eval(tmp_path: Path) -> None:
    added = _p2ptrain("dataset", "add", "sklearn:breast_cancer", "--shards", "4", "--standardize", home=tmp_path)
    assert added.returncode == 0, added.stderr
    cid = added.stdout.strip()
    assert cid != BREAST_CANCER_CID
    info = json.loads(_p2ptrain("dataset", "info", cid, "--json", home=tmp_path).stdout)
    assert len(info["standardize"]["mean"]) == len(info["standardize"]["std"]) == 30
    assert "standardized" in _p2ptrain("dataset", "info", cid, home=tmp_path).stdout

    train = torch.stack([x for x, _ in IPFSDataset(cid, split="train", home=tmp_path, shuffle=False)])
    assert train.dtype == torch.float32
    assert torch.allclose(train.mean(0), torch.zeros(30), atol=1e-4)
    assert torch.allclose(train.std(0, unbiased=False), torch.ones(30), atol=1e-4)
    # The raw features span 0.0008 to 4254: the test split, scaled with the train statistics, is near 0/1.
    test = torch.stack([x for x, _ in IPFSDataset(cid, split="test", home=tmp_path, shuffle=False)])
    assert test.abs().mean() < 1.5

    # model eval reads through IPFSDataset: a linear model whose second logit is feature 0 scores
    # the cross-entropy of the standardized feature, not of the raw one (values up to 28).
    # (hidden units relu(x0) and relu(-x0); logit 1 is their difference, logit 0 is 0.)
    card = {"name": "mlp", "kwargs": {"in_features": 30, "hidden": [2], "out_features": 2}}
    module = build_model(card["name"], card["kwargs"], 0)
    with torch.no_grad():
        for layer in (module[1], module[3]):
            layer.weight.zero_()
            layer.bias.zero_()
        module[1].weight[0, 0], module[1].weight[1, 0] = 1.0, -1.0
        module[3].weight[1, 0], module[3].weight[1, 1] = 1.0, -1.0
    (tmp_path / "m.safetensors").write_bytes(model_bytes(module, card))
    evaluated = _p2ptrain("model", "eval", str(tmp_path / "m.safetensors"), "--dataset", cid, "--json", home=tmp_path)
    assert evaluated.returncode == 0, evaluated.stderr
    loss = json.loads(evaluated.stdout)["loss"]
    labels = torch.tensor([int(y) for _, y in IPFSDataset(cid, split="test", home=tmp_path, shuffle=False)])
    logits = torch.stack([torch.zeros(len(test)), test[:, 0]], 1)
    expected = torch.nn.functional.cross_entropy(logits, labels).item()
    assert loss == pytest.approx(expected, rel=1e-4)


def test_a_constant_feature_is_centred_not_divided_by_zero(tmp_path: Path) -> None:
    features = np.stack([np.full(20, 7.0), np.arange(20.0)], 1).astype(np.float32)
    cid, manifest = build_dataset(open_store(tmp_path), "c", features, np.arange(20) % 2, 2, 0.0, standardize=True)
    assert manifest.standardize is not None and manifest.standardize.std[0] == 0.0
    rows = torch.stack([x for x, _ in IPFSDataset(cid, store=open_store(tmp_path), shuffle=False)])
    assert torch.isfinite(rows).all() and (rows[:, 0] == 0).all()


@pytest.mark.parametrize(("standardize", "problem"), [
    ({"mean": [0.0], "std": [1.0]}, "list of 2 numbers"),
    ({"mean": [0.0, 0.0], "std": [1.0, -1.0]}, ">= 0.0"),
    ({"mean": [0.0, "x"], "std": [1.0, 1.0]}, "finite numbers"),
    ({"mean": [0.0, 0.0]}, "exactly the keys"),
    ({"mean": [0.0, 0.0], "std": [1.0, 1.0], "scale": 1}, "exactly the keys"),
])
def test_a_bad_standardize_field_is_one_manifest_error(tmp_path: Path, standardize: object, problem: str) -> None:
    features = np.zeros((4, 2), np.float32)
    _, manifest = build_dataset(open_store(tmp_path), "b", features, np.arange(4), 1, 0.0)
    raw = manifest.to_dict() | {"standardize": standardize}
    with pytest.raises(ManifestError, match=problem.replace("(", r"\(")):
        Manifest.from_json(boundedjson.canonical(raw))


def test_standardize_is_bounded_by_the_feature_count(tmp_path: Path) -> None:
    features = np.zeros((2, MAX_STANDARDIZE_FEATURES + 1), np.uint8)
    _, manifest = build_dataset(open_store(tmp_path), "w", features, np.arange(2), 1, 0.0)
    n = MAX_STANDARDIZE_FEATURES + 1
    raw = manifest.to_dict() | {"standardize": {"mean": [0] * n, "std": [1] * n}}
    with pytest.raises(ManifestError, match="exceed"):
        Manifest.from_json(boundedjson.canonical(raw))


TASK = """\
name = "bc"
seed = 0
[model]
name = "mlp"
kwargs = {{ in_features = 30, hidden = [16], out_features = 2 }}
[dataset]
manifest = "{manifest}"
[optimizer]
name = "sgd"
lr = 0.05
[training]
batch_size = 16
total_steps = 20
"""


def test_enormous_first_losses_warn_once_to_standardize(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = open_store(tmp_path)
    name, features, labels = load_source("sklearn:breast_cancer")
    warnings = []
    for standardize in (False, True):
        cid, _ = build_dataset(store, name, features, labels, 1, standardize=standardize)
        trainer = Trainer(load_task(TASK.format(manifest=cid)), device="cpu")
        batches = batches_forever(IPFSDataset(cid, store=store), 16)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="p2ptrain.training._trainer"):
            for _ in range(5):
                trainer.apply(trainer.compute_gradient(batches))
        warnings.append([r.getMessage() for r in caplog.records if "--standardize" in r.getMessage()])
    raw, scaled = warnings
    assert len(raw) == 1 and "features may need --standardize" in raw[0], raw
    assert scaled == []


def test_batched_reads_standardized_floats(tmp_path: Path) -> None:
    name, features, labels = load_source("sklearn:iris")
    store = open_store(tmp_path)
    cid, _ = build_dataset(store, name, (features * 100).astype(np.int64), labels, 1, 0.0, standardize=True)
    x, _ = next(batched(IPFSDataset(cid, store=store, shuffle=False), 150))
    assert x.dtype == torch.float32 and abs(float(x.mean())) < 1e-4
