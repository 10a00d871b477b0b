"""``model eval``, ``model export`` and ``model verify`` with no ``--home`` find a model where a
script's run keeps it (``~/.p2ptrain/runs/<run>``), as ``model fetch CID`` and ``load_model(CID)``
do; a CID that is nowhere is one line that says where it was looked for. Before, the three looked
in ``~/.p2ptrain`` alone: 'not in the store of ~/.p2ptrain, and no node is running there' (eval,
export) and 'no chain in ~/.p2ptrain names model' (verify), for a model on this very machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

GOOD_CID = "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o"  # a valid CID that no store here holds


@pytest.fixture
def home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The default home, with a run home that holds nothing (looked through first, in name order)."""
    monkeypatch.setenv("P2PTRAIN_HOME", str(tmp_path / "home"))
    (tmp_path / "home" / "runs" / "a-empty").mkdir(parents=True)
    return tmp_path / "home"


def test_model_eval_finds_a_model_and_its_data_in_a_run_home(home, capsys):
    import numpy as np

    from p2ptrain.cli.main import main
    from p2ptrain.data import build_dataset, load_source
    from p2ptrain.ipfs import open_store
    from p2ptrain.models import build_model
    from p2ptrain.protocol import model_bytes

    store = open_store(home / "runs" / "digits-member0")
    source, features, labels = load_source("sklearn:digits")
    manifest, _ = build_dataset(store, source, (features / 16.0).astype(np.float32), labels, 2, test_fraction=0.2)
    cid = store.add_bytes(model_bytes(build_model("mlp", {}, 0), {"name": "mlp", "kwargs": {}}))
    assert main(["model", "eval", cid, "--dataset", manifest, "--json"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["samples"] == 359


def test_model_export_finds_an_hf_model_in_a_run_home(home, tmp_path, capsys):
    from transformers import AutoConfig, AutoModelForCausalLM

    from p2ptrain.cli.main import main
    from p2ptrain.ipfs import open_store
    from p2ptrain.training import import_pretrained

    settings = {"n_layer": 1, "n_embd": 16, "n_head": 2, "vocab_size": 40, "n_positions": 8, "bos_token_id": 0,
                "eos_token_id": 0}
    AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", **settings)).save_pretrained(tmp_path / "gpt2")
    cid = open_store(home / "runs" / "lm-member0").add_bytes(import_pretrained(tmp_path / "gpt2")[0])
    assert main(["model", "export", cid, str(tmp_path / "out")]) == 0, capsys.readouterr().err
    assert (tmp_path / "out" / "config.json").is_file() and (tmp_path / "out" / "model.safetensors").is_file()


@pytest.mark.usefixtures("quick_timers")  # tests/conftest.py: the in-process member's idle waits shortened
def test_model_verify_finds_the_chain_of_a_scripts_run_in_its_default_home(home, capsys):
    """A script's run with Optimizer's default home (``~/.p2ptrain/runs/<run>``), alone, to its end."""
    import torch
    from torch import nn

    import p2ptrain
    from p2ptrain.cli.main import main

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = p2ptrain.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, run="lone", min_peers=1,
                             max_peers=1, total_steps=2, checkpoint_every=1, join_window_s=0.5)
    with opt, pytest.raises(p2ptrain.RunFinished):
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
    assert (home / "runs" / "lone").is_dir()
    assert main(["model", "verify", opt.model_cid, "--json"]) == 0, capsys.readouterr()
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["model_cid"] == opt.model_cid and report["version"] == 2, report


def test_a_model_cid_that_is_nowhere_says_where_it_was_looked_for(home, tmp_path, capsys):
    from p2ptrain.cli.main import main

    (home / "runs" / "b-empty").mkdir()
    for command in (["model", "export", GOOD_CID, str(tmp_path / "out")], ["model", "fetch", GOOD_CID, "-o", "m"],
                    ["model", "serve", GOOD_CID, "--listen", "127.0.0.1:0"]):
        assert main(command) == 1
        assert capsys.readouterr().err.strip() == (
            f"p2ptrain: error: {GOOD_CID} not in the store of {home} nor in its 2 run home(s) ({home}/runs/*), and "
            f"no node is running there: start one (p2ptrain node start --home {home} --bootstrap ...) or pass "
            "--bootstrap MULTIADDR")
    assert main(["model", "verify", GOOD_CID]) == 1
    assert capsys.readouterr().err.strip() == (
        f"p2ptrain: error: no chain in {home} names model {GOOD_CID} (nor does any run home under it hold the "
        "model): give the task with --task TASK_CID")
    assert main(["model", "export", GOOD_CID, str(tmp_path / "out"), "--home", str(home)]) == 1  # looked in one home
    assert f"not in the store of {home}, and no node" in capsys.readouterr().err


def test_model_serve_serves_a_model_kept_in_a_run_home(home):
    """``model serve CID`` with no ``--home``: the server process reads the model from the run home
    that holds it (and would announce it through the default home's node, which a run home has not)."""
    import select
    import subprocess
    import sys
    import urllib.request

    from p2ptrain.ipfs import open_store
    from p2ptrain.models import build_model
    from p2ptrain.protocol import model_bytes
    from p2ptrain.testing import start_forked

    card = {"name": "mlp", "kwargs": {"in_features": 64, "hidden": [32], "out_features": 10}}
    cid = open_store(home / "runs" / "digits-member0").add_bytes(
        model_bytes(build_model(card["name"], card["kwargs"], 1), card))
    p2ptrain = str(Path(sys.executable).with_name("p2ptrain"))
    proc = start_forked([p2ptrain, "model", "serve", cid, "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        line = proc.stdout.readline() if ready else ""
        assert line.startswith(f"serving {cid} at "), (line, proc.poll())
        url = line.split(" at ")[1].split()[0]
        with urllib.request.urlopen(f"{url}/model", timeout=60) as answer:
            assert json.loads(answer.read())["model_cid"] == cid
    finally:
        proc.terminate()
        proc.wait(timeout=60)
