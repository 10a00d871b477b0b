"""The user's own module on a GPU: two members in this process, one from its own loop
(``p2ptrain.Optimizer``), the other through ``p2ptrain.train`` with a dataset on the CPU; the run's
model loads into a CPU instance and is served on the GPU (``p2ptrain.serve``'s ``open_model``),
and ``p2ptrain model serve --device cuda`` (a process) answers for a registry model.

Every test skips where torch sees no CUDA device; docs/deploy.md#gpus says on which card and when
they last ran.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import p2ptrain
from p2ptrain.ipfs import open_store
from p2ptrain.models import build_model
from p2ptrain.node import free_port
from p2ptrain.protocol import model_bytes
from p2ptrain.serve import open_model, predict
from p2ptrain.task import task_from_bytes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (torch.cuda.is_available() is False here)")

STEPS = 60
RUN_S = 150.0


class DigitsNet(nn.Module):
    """A module of the user's own (not in the registry), with BatchNorm: its buffers are averaged at
    each checkpoint, from the GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU())
        self.out = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(x))


def _digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    return x[:1400], y[:1400], x[1400:], y[1400:]


def _adam(params: object) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=3e-3, fused=True)  # type: ignore[arg-type]


@pytest.mark.timeout(RUN_S + 60)
def test_a_users_cuda_module_trains_through_optimizer_and_train_and_its_model_loads_on_the_cpu(tmp_path: Path) -> None:
    train_x, train_y, test_x, test_y = _digits()
    options = {"run": "cuda-api", "density": 0.1, "checkpoint_every": 20, "min_peers": 2}
    torch.manual_seed(0)
    mine = DigitsNet().cuda()
    first = p2ptrain.Optimizer(_adam(mine.parameters()), model=mine, home=tmp_path / "a", total_steps=STEPS,
                               listen=[f"/ip4/127.0.0.1/tcp/{free_port()}"], join_window_s=0.5, **options)
    torch.manual_seed(1)
    theirs = DigitsNet().cuda()
    outcome: dict[str, Any] = {}

    def member_b() -> None:  # the one-call form, with the dataset on the CPU
        try:
            outcome["b"] = p2ptrain.train(
                theirs, TensorDataset(train_x[1::2], train_y[1::2]), test_data=TensorDataset(test_x, test_y),
                optimizer=_adam, steps=STEPS, batch_size=32, home=tmp_path / "b", progress=False,
                listen=[f"/ip4/127.0.0.1/tcp/{free_port()}"], bootstrap=first.addresses, **options)
        except BaseException as exc:
            outcome["b"] = exc

    def member_a() -> None:  # the user's own loop
        loader = DataLoader(TensorDataset(train_x[0::2], train_y[0::2]), batch_size=32, shuffle=True, drop_last=True)
        try:
            while True:
                for x, y in loader:
                    first.zero_grad()
                    nn.functional.cross_entropy(mine(x.cuda()), y.cuda()).backward()
                    first.step()
        except p2ptrain.RunFinished:
            outcome["a"] = first.model_cid
        except BaseException as exc:
            outcome["a"] = exc

    with first:
        # Daemon threads: a member that never gets its step (a hung run) must not hold the test.
        threads = [threading.Thread(target=member, daemon=True) for member in (member_b, member_a)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + RUN_S
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in threads):
            pytest.fail(f"the run did not finish within {RUN_S:.0f} s: {first.status()}")
        # A model on the GPU makes a task that needs CUDA: a CPU member of the script meets elsewhere.
        assert task_from_bytes(open_store(tmp_path / "a").cat(first.run_cid)).requirements.device == "cuda"
    for member in ("a", "b"):
        if isinstance(outcome[member], BaseException):
            raise outcome[member]
    cid, result = outcome["a"], outcome["b"]
    assert all(p.is_cuda for p in [*mine.parameters(), *theirs.parameters()])
    assert cid is not None and result.model_cid == cid
    # Both hold the run's final model, bit for bit (each loaded it at the end), on the GPU.
    for (name, a), b in zip(mine.state_dict().items(), theirs.state_dict().values()):
        assert torch.equal(a, b), name
    # The model by CID, into a CPU instance: the same bits; the member's accuracy, measured on the GPU.
    cpu_model = p2ptrain.load_state(DigitsNet(), cid, home=tmp_path / "a")
    for (name, a), b in zip(cpu_model.state_dict().items(), mine.state_dict().values()):
        assert torch.equal(a, b.cpu()), name
    with torch.no_grad():
        cpu_out = cpu_model.eval()(test_x)
    accuracy = float((cpu_out.argmax(1) == test_y).float().mean())
    assert accuracy >= 0.85 and result.metrics["accuracy"] == pytest.approx(accuracy, abs=0.01)

    # Served from the GPU: the same predictions as the CPU instance.
    server = open_model(cid, home=tmp_path / "a", model=DigitsNet(), input_shape=(64,), listen="127.0.0.1:0",
                        device="cuda")
    assert server.batcher.current.device.type == "cuda"

    async def ask() -> dict[str, object]:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                url = await nursery.start(server.run)
                answer = await trio.to_thread.run_sync(predict, url, test_x[:16].tolist())
                nursery.cancel_scope.cancel()
        return answer  # type: ignore[no-any-return]

    answer = trio.run(ask)
    assert answer["model_cid"] == cid
    assert torch.allclose(torch.tensor(answer["outputs"]), cpu_out[:16], atol=1e-4)


CARD = {"name": "mlp", "kwargs": {"in_features": 64, "hidden": [32], "out_features": 10}}


@pytest.mark.timeout(120)
def test_model_serve_device_cuda_answers_what_the_cpu_computes(tmp_path: Path) -> None:
    """``p2ptrain model serve CID --device cuda`` in its own process: its answers are the CPU's."""
    module = build_model(CARD["name"], CARD["kwargs"], 3)
    cid = str(open_store(tmp_path).add_bytes(model_bytes(module, CARD)))
    code = "import sys; from p2ptrain.cli.main import main; sys.exit(main())"
    proc = subprocess.Popen([sys.executable, "-c", code, "model", "serve", cid, "--home", str(tmp_path), "--listen",
                             "127.0.0.1:0", "--device", "cuda"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        url, seen = None, []
        deadline = time.monotonic() + 60
        assert proc.stdout is not None
        while url is None and time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 0.5)
            line = proc.stdout.readline() if ready else ""
            seen.append(line)
            if line.startswith("serving "):
                url = line.split(" at ")[1].split()[0]
            elif not line and proc.poll() is not None:
                break
        assert url is not None, "".join(seen)
        x = torch.rand(5, 64)
        answer = predict(url, x.tolist())
        with torch.no_grad():
            expected = module.eval()(x)
        assert answer["model_cid"] == cid
        assert torch.allclose(torch.tensor(answer["outputs"]), expected, atol=1e-4), json.dumps(answer)[:300]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
