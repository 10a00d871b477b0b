"""Mistyped arguments, as a user types them into the installed command: a usage error, never a trace."""

import subprocess
import sys
from pathlib import Path

import pytest

from p2ptrain.testing import run_forked

P2PTRAIN = str(Path(sys.executable).with_name("p2ptrain"))
GOOD = "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o"


@pytest.mark.parametrize(
    "args",
    [
        ("ipfs", "cat", "not-a-cid"),
        ("ipfs", "pin", "add", "QmNotACid"),
        ("dataset", "info", "QmNotACid"),
        ("task", "status", "QmNotACid"),
        ("node", "start", "--join", "QmNotACid"),
        ("model", "fetch", "QmNotACid", "-o", "model.safetensors"),
        ("model", "fetch", "--latest", "QmNotACid", "-o", "model.safetensors"),
        ("model", "eval", GOOD, "--dataset", "QmNotACid"),
    ],
)
def test_a_malformed_cid_is_a_usage_error_naming_the_argument(tmp_path, args):
    result = run_forked([P2PTRAIN, *args, "--home", str(tmp_path / "home")], capture_output=True, timeout=60,
                        cwd=tmp_path)
    err = result.stderr.decode()
    assert result.returncode == 2, err
    assert "is not a valid CID" in err and "NotACid" in err.replace("not-a-cid", "NotACid")
    assert "Traceback" not in err
    assert not (tmp_path / "home").exists()  # refused before anything was created


def test_node_start_refuses_a_device_it_cannot_train_on_before_anything_starts(tmp_path, capsys):
    """A typo in --device was torch's RuntimeError inside the first task run, long after the start."""
    from p2ptrain.cli.main import main

    assert main(["node", "start", "--home", str(tmp_path / "home"), "--device", "gpu"]) == 1
    assert capsys.readouterr().err.strip() == "p2ptrain: error: --device 'gpu': use auto, cpu, cuda or cuda:N"
    assert not (tmp_path / "home").exists()


def test_model_eval_names_a_model_that_is_neither_a_file_nor_a_cid(tmp_path):
    result = run_forked([P2PTRAIN, "model", "eval", "QmNotACid", "--dataset", GOOD, "--home",
                         str(tmp_path / "home")], capture_output=True, timeout=60, cwd=tmp_path)
    err = result.stderr.decode()
    assert result.returncode == 1 and "Traceback" not in err, err
    assert "QmNotACid is not a file, and 'QmNotACid' is not a valid CID" in err
    # ... at once: before torch is imported (4.4 s here before, for a one-line usage error).
    probe = ("import sys; from p2ptrain.cli.main import main; "
             f"rc = main(['model', 'eval', 'QmNotACid', '--dataset', '{GOOD}', '--home', sys.argv[1]]); "
             "print(rc, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "home")], capture_output=True, timeout=60,
                         cwd=tmp_path, text=True)
    assert out.stdout.split() == ["1", "False"], out.stdout + out.stderr


def _eval_home(tmp_path):
    """A home whose store holds a model, a valid manifest over a garbage shard, and a garbage manifest."""
    from p2ptrain.data import Manifest
    from p2ptrain.data._manifest import ShardRef, TensorSpec
    from p2ptrain.ipfs import open_store
    from p2ptrain.models import build_model
    from p2ptrain.protocol import model_bytes

    home = tmp_path / "home"
    store = open_store(home)
    model = tmp_path / "model.safetensors"
    model.write_bytes(model_bytes(build_model("mlp", {}, 0), {"name": "mlp", "kwargs": {}}))
    garbage_model = tmp_path / "garbage.safetensors"
    garbage_model.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a safetensors header")
    shard = store.add_bytes(b"not a shard", cid_version=1)
    manifest = Manifest("d", TensorSpec("float32", (64,)), TensorSpec("int64", ()), {"test": (ShardRef(shard, 4),)})
    return {
        "home": home,
        "model": model,
        "garbage_model": garbage_model,
        "manifest": manifest.save(store),
        "garbage_manifest": store.add_bytes(b"[" * 100_000, cid_version=1),
    }


@pytest.mark.parametrize(
    "model,dataset,says",
    [
        ("model", "garbage_manifest", "nested"),  # ManifestError
        ("garbage_model", "manifest", "not valid"),  # RecordError
        ("model", "manifest", "cannot be used"),  # ShardUnavailable
    ],
)
def test_model_eval_prints_one_line_for_every_declared_error(tmp_path, model, dataset, says):
    h = _eval_home(tmp_path)
    result = run_forked([P2PTRAIN, "model", "eval", str(h[model]), "--dataset", h[dataset], "--home", str(h["home"])],
                        capture_output=True, timeout=120, cwd=tmp_path)
    err = result.stderr.decode()
    assert result.returncode == 1, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("p2ptrain: error: ") and says in lines[0], err


@pytest.mark.parametrize(
    "content,says",
    [
        (b"\xff\xfe not UTF-8", "not UTF-8"),  # was UnicodeDecodeError
        (b"name = 't'\n[model]\nkwargs = " + b"[" * 5000, "nested too deeply"),  # was RecursionError
        (f"name = 't'\n[model]\nname = 'mlp'\n[dataset]\nmanifest = '{GOOD}'\n[optimizer]\nname = 'sgd'\n"
         f"lr = 1{'0' * 400}\n".encode(), "optimizer.lr: must be a finite number"),  # was OverflowError
    ],
)
def test_task_publish_prints_one_line_for_a_bad_task_file(tmp_path, content, says):
    task = tmp_path / "task.toml"
    task.write_bytes(content)
    result = run_forked([P2PTRAIN, "task", "publish", str(task), "--home", str(tmp_path / "home")],
                        capture_output=True, timeout=120, cwd=tmp_path)
    err = result.stderr.decode()
    assert result.returncode == 1 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("p2ptrain: error: ") and says in lines[0], err
