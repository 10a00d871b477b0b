"""Each example in examples/ runs as the members of one run on loopback, as separate processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from p2ptrain.testing import run_script, script_members

EXAMPLES = Path(__file__).parents[2] / "examples"
# The members' idle waits shortened (tests/conftest.py, quick_process_timers): a joiner listens 0.75 s
# for a head instead of 3, a new coordinator's first plan waits 0.5 s for joiners instead of 2.
pytestmark = pytest.mark.usefixtures("quick_process_timers")

RUN_S = 420.0  # processes import torch and libp2p, meet and train: a minute alone, more when loaded


@pytest.mark.timeout(RUN_S + 60)
def test_custom_loop_cnn_with_batchnorm(tmp_path: Path) -> None:
    results = run_script(EXAMPLES / "custom_loop.py", script_members(2, tmp_path), ["--steps", "50"], timeout=RUN_S)
    assert len({r["model_cid"] for r in results}) == 1 and results[0]["model_cid"]
    assert len({r["weights"] for r in results}) == 1, "BatchNorm statistics or weights differ between members"
    assert all(r["steps"] == 50 for r in results)


@pytest.mark.timeout(RUN_S + 60)
def test_federated_with_train_in_local_sgd_mode(tmp_path: Path) -> None:
    """``p2ptrain.train`` with ``mode="local_sgd"``, three members, each on its own third of the data."""
    members = script_members(3, tmp_path)
    results = run_script(EXAMPLES / "federated.py", members, ["--local-sgd", "--steps", "120"], timeout=RUN_S)
    assert len({r["model_cid"] for r in results}) == 1 and results[0]["model_cid"]
    assert len({r["weights"] for r in results}) == 1
    assert min(r["accuracy"] for r in results) >= 0.9, results
    assert all(abs(r["metrics"]["accuracy"] - r["accuracy"]) < 1e-6 for r in results)  # TrainResult's metrics
    # train() says where each member listens: what a user starting the first member passes to the others.
    for m in members:
        said = [line for line in (m.home / "script.log").read_text().splitlines() if "p2ptrain: member of run" in line]
        assert said and f"/p2p/{m.peer_id}" in said[0], said


@pytest.mark.timeout(RUN_S + 60)
def test_local_sgd_from_a_loop(tmp_path: Path) -> None:
    results = run_script(EXAMPLES / "local_sgd_loop.py", script_members(2, tmp_path), timeout=RUN_S)
    assert len({r["model_cid"] for r in results}) == 1 and results[0]["model_cid"]
    assert len({r["weights"] for r in results}) == 1
    assert min(r["accuracy"] for r in results) >= 0.8, results


@pytest.mark.timeout(RUN_S + 60)
def test_resnet18_on_an_image_folder(tmp_path: Path) -> None:
    """Skipped where torchvision does not import beside this torch (the project's venv): validated
    in a venv with torch 2.14.1 and torchvision 0.29.1."""
    pytest.importorskip("torchvision", reason="torchvision does not import beside this torch")
    results = run_script(EXAMPLES / "resnet_image_folder.py", script_members(2, tmp_path), ["--steps", "12"],
                         timeout=RUN_S)
    assert len({r["dataset"] for r in results}) == 1, "the same folder must give the same dataset CID"
    assert len({r["model_cid"] for r in results}) == 1 and results[0]["model_cid"]
    assert len({r["weights"] for r in results}) == 1, "weights or BatchNorm statistics differ between members"
    assert all(r["steps"] == 12 for r in results)


@pytest.mark.timeout(RUN_S + 60)
def test_gpt2_architecture_on_text_files(tmp_path: Path) -> None:
    """A transformers GPT-2 config (p2ptrain.models.build_model("hf", ...)) on windows of text files."""
    results = run_script(EXAMPLES / "gpt2_text.py", script_members(2, tmp_path), ["--steps", "40"], timeout=RUN_S)
    assert len({r["model_cid"] for r in results}) == 1 and results[0]["model_cid"]
    assert len({r["weights"] for r in results}) == 1
    assert all(r["steps"] == 40 and r["loss"] < r["first_loss"] - 1.0 for r in results), results
