"""The CUDA path on a real GPU: runs of a registry model on ``device="cuda"`` (fp32, bf16 and fp16
autocast) among three full peers in this process, and the GPU a peer advertises in its heartbeats.

Every test skips where torch sees no CUDA device: the machines this project is built and tested
on have none. docs/deploy.md#gpus says on which card and when they last ran.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import trio
from sklearn.datasets import load_digits

from p2ptrain.services import TaskOptions
from p2ptrain.testing import local_peers, publish_digits_task
from p2ptrain.training import model_from_bytes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (torch.cuda.is_available() is False here)")

# A task of testing.DIGITS_TASK's MLP that admits CUDA peers only, with a denser average than the
# default 1% (a few dozen steps must move the accuracy well above the initial weights').
CUDA_TASK = '[compression]\ndensity = 0.5\n[requirements]\ndevice = "cuda"\n'
STEPS, INTERVAL = 150, 50
DEADLINE_S = 90.0


def digits_accuracy(module: torch.nn.Module) -> float:
    """Accuracy of a CPU module on all of sklearn's digits (features / 16, as the task's dataset)."""
    x, y = load_digits(return_X_y=True)
    with torch.no_grad():
        predicted = module.eval()(torch.tensor((x / 16.0).astype(np.float32))).argmax(1)
    return float((predicted == torch.tensor(y)).float().mean())


@pytest.mark.timeout(DEADLINE_S + 60)
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
async def test_three_cuda_peers_confirm_their_own_bits_and_the_model_loads_on_the_cpu(tmp_path: Path,
                                                                                       precision: str) -> None:
    """Every member trains on the GPU, every member's own weights hash to the confirmed model CID
    (not only a quorum's), the model improves on its initial weights and loads on the CPU; each
    peer sees the others' GPU (name, memory) in their heartbeats."""
    options = TaskOptions(device="cuda", precision=precision)
    async with local_peers(3, tmp_path, task_options=options) as peers:
        task_cid = await publish_digits_task(peers[0], name=f"cuda-{precision}", total_steps=STEPS,
                                             checkpoint_interval=INTERVAL, min_peers=3, extra=CUDA_TASK)
        with trio.fail_after(DEADLINE_S):
            runs = [await peer.tasks.join(task_cid) for peer in peers]

            def done() -> list[dict[str, Any]] | None:
                statuses = [peers.status(i, task_cid) for i in range(len(peers))]
                return statuses if all(s.get("state") == "done" for s in statuses) else None

            statuses = await peers.wait_until(done, DEADLINE_S, what="every member done")
        for run in runs:
            trainer = run.shared.trainer
            assert trainer is not None and trainer.device.type == "cuda" and trainer.precision == precision
            assert all(p.is_cuda for p in trainer.params)
        assert len({s["latest_model_cid"] for s in statuses}) == 1, statuses
        cid = statuses[0]["latest_model_cid"]
        assert [e["step"] for e in statuses[0]["chain"]] == list(range(INTERVAL, STEPS + 1, INTERVAL))
        for peer, run in zip(peers, runs):
            own = await trio.to_thread.run_sync(lambda: peer.content.store.add_bytes(run.shared.trainer.model_bytes(),
                                                                                    only_hash=True))
            assert str(own) == cid, f"{peer.node.peer_id}: its weights are not the confirmed model's"
        store = peers[0].content.store
        final = model_from_bytes(store.cat(cid))
        initial = model_from_bytes(store.cat(runs[0].shared.initial_cid))
        assert all(t.device.type == "cpu" for t in final.state_dict().values())
        before, after = digits_accuracy(initial), digits_accuracy(final)
        assert after >= before + 0.25 and after >= 0.4, (before, after)
        recorded = statuses[0]["chain"][-1]["metrics"]["accuracy"]  # the coordinator's, on the GPU
        assert recorded >= 0.4

        # The heartbeats: each peer advertises this machine's GPU once its torch probe has run.
        name, memory = torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory
        others = [(a, b) for a in peers for b in peers if a is not b]

        def advertised() -> bool | None:
            for a, b in others:
                record = a.node.membership.get(b.node.peer_id)
                if record is None or record.caps.device != "cuda" or record.caps.gpu_name != name:
                    return None
                assert record.caps.gpu_memory_bytes == memory
            return True

        await peers.wait_until(advertised, 30, what="every peer's heartbeats advertise the GPU")


MLP_TASK = """\
name = "rollback"
[model]
name = "mlp"
kwargs = { in_features = 64, hidden = [512, 512], out_features = 10 }
[dataset]
manifest = "QmPr27mpm19tVRhDMn98aEecF9ii7FVYZVuQNeTGNTFida"
[optimizer]
name = "adam"
lr = 0.001
[training]
batch_size = 64
total_steps = 100
"""


def test_a_cuda_step_rolls_back_to_the_same_bits_and_replays_to_the_same_bits() -> None:
    """The rollback snapshot of a GPU trainer is copied to page-locked memory without waiting:
    a rolled-back step leaves the bits of before it (weights and Adam's state), and the same step
    again gives the bits it gave the first time."""
    from p2ptrain.task import load_task
    from p2ptrain.training import Trainer

    task = load_task(MLP_TASK)
    trainer = Trainer(task, device="cuda")
    batches = iter([(torch.randn(64, 64), torch.randint(0, 10, (64,))) for _ in range(4)])
    trainer.apply(trainer.compute_gradient(batches))  # Adam's state exists from here on
    before = (trainer.model_bytes(), trainer.optimizer_bytes())
    flat = trainer.compute_gradient(batches)
    trainer.apply(flat)
    once = (trainer.model_bytes(), trainer.optimizer_bytes())
    assert once != before
    trainer.rollback()
    assert (trainer.model_bytes(), trainer.optimizer_bytes()) == before
    trainer.apply(flat)
    assert (trainer.model_bytes(), trainer.optimizer_bytes()) == once
