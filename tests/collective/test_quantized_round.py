"""Sparse rounds with quantized values (int8, 2-bit) on real loopback hosts: identical bits on every
member, the mean of what was sent, the rounding kept; a member's malformed values are refused and counted."""

from __future__ import annotations

import contextvars

import pytest
import torch

import p2ptrain.collective._quantized_gather as quantized_round
from p2ptrain.collective import BadPayload, RoundSpec, SparseAllReducer
from p2ptrain.wire.quantization import roundtrip

WORLD, N = 4, 20_000


@pytest.mark.parametrize("kind", ["int8", "2bit"])
async def test_quantized_sparse_rounds_agree_bitwise_and_keep_the_rounding(cluster, gather, kind: str) -> None:
    grads = [[torch.randn(N, generator=torch.Generator().manual_seed(10 * s + i)) for i in range(WORLD)] for s in range(2)]
    async with cluster(WORLD) as peers:
        ring = [p.id for p in peers]
        reducers = [SparseAllReducer(p.collective, RoundSpec(density=0.02, quantize=kind)) for p in peers]
        for step in range(2):
            # What each member will send: its residual + gradient at the round's indices, quantized.
            before = [(r.feedback.residual.clone() if r.feedback else torch.zeros(N)) + g
                      for r, g in zip(reducers, grads[step])]
            out = await gather([lambda r=r, g=g: r.allreduce(g, ring, 7 + step) for r, g in zip(reducers, grads[step])])
            for i in range(WORLD):
                assert out[i].equal(out[0])
            idx = reducers[0].last_indices
            sent = [roundtrip(acc[idx], kind) for acc in before]
            expected = torch.zeros(N)
            expected[idx] = (sent[0] + sent[1] + sent[2] + sent[3]) / WORLD
            assert out[0].equal(expected)
            for r, acc, s in zip(reducers, before, sent):
                assert r.feedback.residual[idx].equal(acc[idx] - s)  # the rounding is kept, not lost
            bytes_sent = peers[0].collective.last_round.bytes_sent
            # fp32 values would take 6 bytes a value (reduce-scatter and all-gather) plus ~1 of indices.
            assert bytes_sent < (2.5 if kind == "2bit" else 5) * idx.numel()


async def test_a_member_sending_malformed_values_is_refused_named_and_counted(cluster, gather, monkeypatch) -> None:
    hostile = contextvars.ContextVar("hostile", default=False)
    honest_encode, honest_decode = quantized_round.encode, quantized_round.decode

    def encode(values: torch.Tensor, kind: str) -> bytes:
        data = honest_encode(values, kind)
        return b"\x00\x00\xc0\x7f" + data[4:] if hostile.get() else data  # a NaN scale

    def decode(data: bytes, count: int, kind: str) -> torch.Tensor:
        return torch.zeros(count) if hostile.get() else honest_decode(data, count, kind)  # it checks nothing

    monkeypatch.setattr(quantized_round, "encode", encode)
    monkeypatch.setattr(quantized_round, "decode", decode)
    async with cluster(3) as peers:
        ring = [p.id for p in peers]
        reducers = [SparseAllReducer(p.collective, RoundSpec(density=0.05, quantize="2bit")) for p in peers]
        grads = [torch.randn(N) for _ in peers]

        async def bad() -> torch.Tensor:
            hostile.set(True)
            return await reducers[2].allreduce(grads[2], ring, 1)

        out = await gather([lambda: reducers[0].allreduce(grads[0], ring, 1),
                            lambda: reducers[1].allreduce(grads[1], ring, 1), bad])
    for i in (0, 1):
        assert isinstance(out[i], BadPayload) and out[i].peer_id == peers[2].id, out[i]
        assert peers[i].collective.hub.stats()["refused_bad_payload"] == 1
        assert reducers[i].feedback.residual.eq(0).all()  # the failed round committed nothing
