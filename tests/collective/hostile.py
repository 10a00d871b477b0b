"""A Byzantine member for tests and bench/robust.py, and digits training on real loopback hosts.

:class:`Hostile` wraps a real :class:`Collective`: the member's contribution is multiplied by
``factor`` after it was formed and just before it goes on the wire, so every byte the others see
travels the real path (frames, checks, the owners' reduction). Its index selection stays honest:
the attack is on the values, which every wire check accepts (finite, right count, right dtype).

Loaded by path (bench/robust.py and tests/collective/test_robust.py), so it imports nothing from
the test tree.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import torch
import trio

from p2ptrain.collective import Collective, RoundSpec, SparseAllReducer
from p2ptrain.testing import connected_hosts

ROUND_TIMEOUT_S = 20.0  # one training round of four members, generous for a loaded machine


class Hostile:
    """A member that sends ``factor`` times its contribution (100: scaled; -1: sign-flipped).

    It has the two methods :class:`SparseAllReducer` calls and forwards them to the real
    collective with the transformed tensor.
    """

    def __init__(self, collective: Collective, factor: float) -> None:
        self.collective = collective
        self.factor = factor

    async def dense_round(self, data: torch.Tensor, ring: list, round_id: int, spec: RoundSpec) -> None:
        data.mul_(self.factor)  # the reducer sends a copy of its accumulated gradient; the result overwrites it
        await self.collective.dense_round(data, ring, round_id, spec)

    async def sparse_round(self, source: torch.Tensor, ring: list, round_id: int, spec: RoundSpec, *, prepare=None,
                           **options):
        # ``source`` is filled by ``prepare`` (in a worker thread) and read only after it: transform
        # it there, into a tensor of our own, leaving the reducer's accumulated gradient honest.
        sent = torch.empty_like(source)

        def hostile_prepare() -> None:
            if prepare is not None:
                prepare()
            torch.mul(source, self.factor, out=sent)

        return await self.collective.sparse_round(sent, ring, round_id, spec, prepare=hostile_prepare, **options)


@asynccontextmanager
async def hosts(n: int) -> AsyncIterator[list[Collective]]:
    """``n`` real libp2p hosts on 127.0.0.1, every pair connected, each with a Collective."""
    async with connected_hosts(n) as peers:
        yield [Collective(peer.host) for peer in peers]


async def average_gradients(reducer: SparseAllReducer, model: torch.nn.Module, ring: list, round_id: int) -> None:
    """What a node does with a round: the model's flat gradient through the reducer (top-k over the
    whole vector), the members' mean written back as every parameter's ``.grad``."""
    params = list(model.parameters())
    mean = await reducer.allreduce(torch.cat([p.grad.reshape(-1) for p in params]), ring, round_id)
    offset = 0
    for p in params:
        p.grad.copy_(mean[offset : offset + p.numel()].view_as(p))
        offset += p.numel()


def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn digits scaled to [0, 1], split 1437 train / 360 test (fixed order)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16
    y = torch.tensor(data.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    return x, y, order[:1437], order[1437:]


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


async def train_digits(
    collectives: list[Collective], *, steps: int, robust: str, hostile: dict[int, float], density: float = 0.01,
    batch: int = 32, lr: float = 0.1, first_round: int = 0, on_round: Callable[[int, float], None] | None = None,
) -> tuple[float, list[torch.nn.Module]]:
    """Train the digits MLP on every host (member i holds shard i); ``hostile`` maps a member to its
    factor. Returns member 0's test accuracy (0.0 if its weights are no longer finite) and the models.

    ``on_round(step, seconds)`` gets each round's wall time (all members, sync included).
    """
    x, y, train_idx, test_idx = digits()
    size = len(collectives)
    ring = [c.peer_id for c in collectives]
    models = [mlp() for _ in range(size)]
    spec = RoundSpec(density=density, robust=robust, timeout=ROUND_TIMEOUT_S)
    reducers = [
        SparseAllReducer(Hostile(c, hostile[i]) if i in hostile else c, spec)
        for i, c in enumerate(collectives)
    ]
    optimizers = [torch.optim.SGD(m.parameters(), lr=lr) for m in models]
    shards = [train_idx[i::size] for i in range(size)]

    async def member(i: int, step: int) -> None:
        pick = torch.randint(len(shards[i]), (batch,), generator=torch.Generator().manual_seed(step * 10 + i))
        chosen = shards[i][pick]
        optimizers[i].zero_grad()
        torch.nn.functional.cross_entropy(models[i](x[chosen]), y[chosen]).backward()
        await average_gradients(reducers[i], models[i], ring, first_round + step)
        optimizers[i].step()

    for step in range(steps):
        started = trio.current_time()
        with trio.fail_after(ROUND_TIMEOUT_S):
            async with trio.open_nursery() as nursery:
                for i in range(size):
                    nursery.start_soon(member, i, step)
        if on_round is not None:
            on_round(step, trio.current_time() - started)
    with torch.no_grad():
        logits = models[0](x[test_idx])
        accuracy = (logits.argmax(1) == y[test_idx]).float().mean().item() if bool(logits.isfinite().all()) else 0.0
    return accuracy, models
