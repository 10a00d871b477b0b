"""Real libp2p hosts on 127.0.0.1, each with a Collective, fully connected, in this trio process."""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest
import torch
import trio

from p2ptrain.collective import Collective
from p2ptrain.collective._ring import chunk_bounds
from p2ptrain.collective._sparse import assemble, slice_of, slice_ranges
from p2ptrain.testing import LocalHost, connected_hosts


@dataclass
class Peer:
    local: LocalHost
    collective: Collective

    @property
    def host(self):
        return self.local.host

    @property
    def id(self):
        return self.local.id

    def kill(self) -> None:
        """Stop the host: its connections close as if the process had died."""
        self.local.kill()


@asynccontextmanager
async def start_cluster(n: int, **collective_options):
    """``n`` running hosts, every pair connected, each with a Collective (ring = list order)."""
    async with connected_hosts(n) as hosts:
        yield [Peer(local, Collective(local.host, **collective_options)) for local in hosts]


async def run_all(calls, *, deadline: float = 60):
    """Run one coroutine function per peer concurrently; their results (or exceptions), in order."""
    results: list = [None] * len(calls)

    async def one(i, call):
        try:
            results[i] = await call()
        except Exception as error:  # collected: each test asserts on what every peer saw
            results[i] = error

    with trio.fail_after(deadline):
        async with trio.open_nursery() as nursery:
            for i, call in enumerate(calls):
                nursery.start_soon(one, i, call)
    return results


@pytest.fixture
def cluster():
    return start_cluster


@pytest.fixture
def gather():
    """``await gather([call, ...])``: run one call per peer concurrently, bounded (see run_all)."""
    return run_all


def ring_sum(contributions: list[torch.Tensor], average: bool) -> torch.Tensor:
    """What the network ring computes, in one process: chunk c summed from member c around the ring."""
    size = len(contributions)
    bounds = chunk_bounds(contributions[0].numel(), size)
    out = torch.empty_like(contributions[0])
    for c in range(size):
        a, b = bounds[c], bounds[c + 1]
        acc = contributions[c][a:b].clone()
        for j in range(1, size):
            acc = torch.add(contributions[(c + j) % size][a:b], acc)
        if average:
            acc.div_(size)
        out[a:b] = acc
    return out


class LocalRing:
    """An in-process stand-in for P Collectives with the same arithmetic (for fast training tests).

    ``member(i)`` has the ``dense_round``/``sparse_round`` methods SparseAllReducer calls; members run
    concurrently in one trio process and meet at a barrier per round.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._meetings: dict = {}

    def member(self, index: int) -> LocalMember:
        return LocalMember(self, index)

    async def meet(self, key, index: int, value, combine):
        slot = self._meetings.setdefault(key, {"values": {}, "done": trio.Event(), "result": None})
        slot["values"][index] = value
        if len(slot["values"]) == self.size:
            slot["result"] = combine([slot["values"][i] for i in range(self.size)])
            slot["done"].set()
        with trio.fail_after(10):
            await slot["done"].wait()
        return slot["result"]


@dataclass
class LocalMember:
    ring: LocalRing
    index: int

    async def dense_round(self, data, ring, round_id, spec, *, owner_seed=None):
        result = await self.ring.meet((round_id, "dense"), self.index, data.clone(), lambda xs: ring_sum(xs, spec.average))
        data.copy_(result)

    async def sparse_round(self, source, ring, round_id, spec, *, sizes, ks, select, prepare=None, seed=None,
                           owner_seed=None):
        size = self.ring.size
        if prepare is not None:
            prepare()
        ranges = slice_ranges(sizes, ks, size)
        mine = slice_of(self.index, round_id if seed is None else seed, size)
        chosen = select(ranges[mine])
        per_slice = await self.ring.meet((round_id, "idx"), self.index, (mine, chosen), dict)
        indices = assemble([per_slice[m] for m in range(size)], ranges)
        values = source.index_select(0, indices).to(spec.values_of(source.dtype))
        reduced = await self.ring.meet((round_id, "values"), self.index, values, lambda xs: ring_sum(xs, spec.average))
        return indices, reduced.clone()


@pytest.fixture
def local_ring():
    return LocalRing
