"""``p2ptrain dataset add/info`` through the installed command, then read back with IPFSDataset."""

import json
import sys
from pathlib import Path

import numpy as np

from p2ptrain.testing import run_forked
from p2ptrain.data import IPFSDataset

P2PTRAIN = str(Path(sys.executable).with_name("p2ptrain"))


def run(*args, home):
    return run_forked(
        [P2PTRAIN, "dataset", *args, "--home", str(home)], capture_output=True, text=True, timeout=120
    )


def test_add_digits_then_info_then_load(tmp_path):
    added = run("add", "sklearn:digits", "--shards", "4", "--test-fraction", "0.25", home=tmp_path)
    assert added.returncode == 0, added.stderr
    cid = added.stdout.strip()
    assert cid.startswith("bafk")
    info = run("info", cid, "--json", home=tmp_path)
    manifest = json.loads(info.stdout)
    assert manifest["name"] == "digits"
    assert manifest["features"] == {"dtype": "float32", "shape": [64]}
    assert len(manifest["splits"]["train"]) == 4
    total = sum(s["num_samples"] for split in manifest["splits"].values() for s in split)
    assert total == 1797
    text = run("info", cid, home=tmp_path).stdout
    assert "train: 1348 samples, 4 shards" in text and "test: 449 samples" in text
    test_split = IPFSDataset(cid, split="test", home=tmp_path)
    assert len(list(test_split)) == 449


def test_add_folder(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    np.save(src / "features.npy", np.arange(40, dtype=np.float32).reshape(20, 2))
    np.save(src / "labels.npy", np.arange(20))
    added = run("add", str(src), "--shards", "2", "--test-fraction", "0", home=tmp_path / "h")
    assert added.returncode == 0, added.stderr
    info = json.loads(run("info", added.stdout.strip(), "--json", home=tmp_path / "h").stdout)
    assert info["name"] == "src" and list(info["splits"]) == ["train"]


def test_errors_are_one_line(tmp_path):
    for args, message in [
        (("add", "sklearn:digits", "--shards", "5000"), "cannot fill 5000 shards"),
        (("add", str(tmp_path / "nope"), "--shards", "2"), "no such file or folder"),
        (("info", "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o"), "not held locally"),
    ]:
        result = run(*args, home=tmp_path)
        assert result.returncode == 1 and message in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
