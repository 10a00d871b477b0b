"""Four peers train an MLP on scikit-learn digits: 1% top-k + error feedback vs the dense average.

The averaging runs in-process (LocalRing) with the same SparseAllReducer code; test_sparse checks that
LocalRing and real hosts give identical bits, so this measures the compressor, not the transport.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import trio

from p2ptrain.collective import RoundSpec, SparseAllReducer

# What a node does with a round and the digits split: one copy, shared with test_robust.py.
_spec = importlib.util.spec_from_file_location("p2ptrain_test_hostile", Path(__file__).with_name("hostile.py"))
hostile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hostile)

PEERS, STEPS, BATCH, LR = 4, 400, 32, 0.1


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


async def train(local_ring, density: float) -> tuple[float, list[torch.nn.Module]]:
    x, y, train_idx, test_idx = hostile.digits()
    ring = local_ring(PEERS)
    members = list(range(PEERS))  # LocalRing ignores the ring's contents, only its order matters
    models = [model() for _ in members]
    reducers = [SparseAllReducer(ring.member(i), RoundSpec(density=density)) for i in members]
    optimizers = [torch.optim.SGD(m.parameters(), lr=LR) for m in models]
    shards = [train_idx[i::PEERS] for i in members]

    async def peer(i: int, step: int) -> None:
        pick = torch.randint(len(shards[i]), (BATCH,), generator=torch.Generator().manual_seed(step * 10 + i))
        batch = shards[i][pick]
        optimizers[i].zero_grad()
        torch.nn.functional.cross_entropy(models[i](x[batch]), y[batch]).backward()
        await hostile.average_gradients(reducers[i], models[i], members, step)
        optimizers[i].step()

    for step in range(STEPS):
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for i in members:
                    nursery.start_soon(peer, i, step)
    with torch.no_grad():
        accuracy = (models[0](x[test_idx]).argmax(1) == y[test_idx]).float().mean().item()
    return accuracy, models


@pytest.fixture
def one_thread():
    """Tiny tensors: torch's second thread only contends with the trio loop on a 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


async def test_one_percent_topk_with_error_feedback_matches_dense_accuracy(local_ring, one_thread):
    dense, _ = await train(local_ring, 1.0)
    sparse, models = await train(local_ring, 0.01)
    assert dense > 0.9  # the dense baseline really learned
    print(f"test accuracy after {STEPS} steps: dense {dense:.4f}, 1% top-k + error feedback {sparse:.4f}")
    assert sparse >= dense - 0.01, (sparse, dense)
    for m in models[1:]:  # every peer applied identical updates: identical replicas
        for a, b in zip(models[0].parameters(), m.parameters()):
            assert a.equal(b)
