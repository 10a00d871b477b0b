"""Mistyped arguments, as a user types them into the installed command: a usage error, never a trace."""

import subprocess
import sys
from pathlib import Path

import pytest

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
    result = subprocess.run([P2PTRAIN, *args, "--home", str(tmp_path / "home")], capture_output=True, timeout=60,
                            cwd=tmp_path)
    err = result.stderr.decode()
    assert result.returncode == 2, err
    assert "not a CID" in err and "NotACid" in err.replace("not-a-cid", "NotACid")
    assert "Traceback" not in err
    assert not (tmp_path / "home").exists()  # refused before anything was created


def test_model_eval_names_a_model_that_is_neither_a_file_nor_a_cid(tmp_path):
    result = subprocess.run([P2PTRAIN, "model", "eval", "QmNotACid", "--dataset", GOOD, "--home",
                             str(tmp_path / "home")], capture_output=True, timeout=60, cwd=tmp_path)
    err = result.stderr.decode()
    assert result.returncode == 1 and "Traceback" not in err, err
    assert "QmNotACid is not a file, and not a CID" in err
