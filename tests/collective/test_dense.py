"""Dense ring all-reduce between real libp2p hosts: matches gloo, identical bits on every peer."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from p2ptrain.collective import CollectiveError, RoundSpec
from p2ptrain.testing import run_forked

SIZES = [1, 2, 7, 1001, 65_537]
WORLDS = [2, 3, 4, 5]
GLOO = Path(__file__).with_name("gloo_reference.py")


def inputs(world: int, n: int, dtype=torch.float32, seed: int = 0) -> list[torch.Tensor]:
    return [
        torch.randn(n, generator=torch.Generator().manual_seed(seed * 100 + r)).to(dtype)
        for r in range(world)
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



@pytest.fixture(scope="module")
def gloo_reference(tmp_path_factory) -> dict[int, list[dict[str, torch.Tensor]]]:
    """{world: each rank's gloo SUM of every size's inputs}: one script run for the module, whose
    ranks are forked from one torch import (gloo_reference.py), not four runs of spawned ranks."""
    folder = tmp_path_factory.mktemp("gloo")
    for world in WORLDS:
        (folder / f"w{world}").mkdir()
        data = {n: inputs(world, n, seed=n) for n in SIZES}
        for r in range(world):
            save_file({f"n{n}": data[n][r] for n in SIZES}, folder / f"w{world}" / f"in{r}.safetensors")
    run_forked([sys.executable, str(GLOO), str(folder), *(f"{w}:{free_port()}" for w in WORLDS)],
               check=True, timeout=300)
    return {w: [load_file(folder / f"w{w}" / f"out{r}.safetensors") for r in range(w)] for w in WORLDS}


@pytest.mark.parametrize("world", WORLDS)
async def test_dense_matches_gloo_and_is_bitwise_identical(cluster, gather, gloo_reference, world):
    data = {n: inputs(world, n, seed=n) for n in SIZES}
    reference = gloo_reference[world]
    # Small segments, so the larger sizes travel as many pipelined frames per chunk.
    async with cluster(world, segment_bytes=4096) as peers:
        ring = [p.id for p in peers]
        for round_id, n in enumerate(SIZES):
            for op in ("sum", "mean"):
                rid = round_id * 2 + (op == "mean")
                outs = await gather(
                    [
                        lambda p=p, r=r: p.collective.allreduce(data[n][r], ring, rid, RoundSpec(op=op))
                        for r, p in enumerate(peers)
                    ]
                )
                for r, out in enumerate(outs):
                    assert isinstance(out, torch.Tensor), out
                    assert out.view(torch.int32).equal(outs[0].view(torch.int32)), f"peer {r} differs"
                    expected = reference[r][f"n{n}"] / (world if op == "mean" else 1)
                    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
                for r in range(world):  # inputs untouched
                    assert data[n][r].equal(inputs(world, n, seed=n)[r])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
async def test_half_precision_dtypes(cluster, gather, dtype):
    world, n = 3, 10_007
    xs = inputs(world, n, dtype=dtype)
    async with cluster(world, segment_bytes=2048) as peers:
        ring = [p.id for p in peers]
        outs = await gather([lambda p=p, x=x: p.collective.allreduce(x, ring, 1) for p, x in zip(peers, xs)])
    exact = torch.stack([x.double() for x in xs]).mean(0)
    for out in outs:
        assert out.dtype == dtype
        assert out.view(torch.int16).equal(outs[0].view(torch.int16))
    torch.testing.assert_close(outs[0].double(), exact, rtol=2e-2, atol=2e-2)


async def test_more_peers_than_elements_and_single_member(cluster, gather):
    async with cluster(4) as peers:
        ring = [p.id for p in peers]
        xs = inputs(4, 2)
        outs = await gather([lambda p=p, x=x: p.collective.allreduce(x, ring, 7) for p, x in zip(peers, xs)])
        for out in outs:
            assert out.equal(outs[0])
        torch.testing.assert_close(outs[0], torch.stack(xs).mean(0))
        alone = await peers[0].collective.allreduce(xs[0], [peers[0].id], 8)
        assert alone.equal(xs[0])


async def test_round_ids_are_single_use_and_rings_must_agree(cluster, gather):
    async with cluster(3) as peers:
        ring = [p.id for p in peers]
        x = torch.ones(10)
        await gather([lambda p=p: p.collective.allreduce(x, ring, 1) for p in peers])
        with pytest.raises(CollectiveError, match="already used"):
            await peers[0].collective.allreduce(x, ring, 1)
        # Peer 2 thinks the tensor is longer: every member fails, nothing is summed.
        outs = await gather(
            [
                lambda p=p, i=i: p.collective.allreduce(torch.ones(11 if i == 2 else 10), ring, 2, RoundSpec(timeout=3))
                for i, p in enumerate(peers)
            ]
        )
        assert all(isinstance(o, CollectiveError) for o in outs), outs
        assert any("disagrees" in str(o) or "refused" in str(o) for o in outs), outs
