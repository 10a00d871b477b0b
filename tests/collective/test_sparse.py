"""Top-k selection, the index codec, error feedback, and the sparse path over real hosts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.collective import ErrorFeedback, RoundSpec, SparseAllReducer, bucket_ks
from p2ptrain.collective._sparse import (
    assemble,
    check_ranges,
    decode_indices,
    encode_indices,
    max_encoded_bytes,
    select_ranges,
    slice_of,
    slice_ranges,
    topk_indices,
)


@pytest.mark.parametrize("n,k", [(10, 3), (70_000, 700), (1 << 20, 10_486), (1 << 20, 1), (1 << 20, 1 << 20)])
def test_sampled_topk_selects_exactly_the_largest_magnitudes(n, k):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n + k))
    got = topk_indices(x, k, generator=torch.Generator().manual_seed(1))
    assert got.numel() == k and got.dtype == torch.int64
    assert bool((got[1:] > got[:-1]).all())
    expected = torch.topk(x.abs(), k).indices.sort().values
    assert got.equal(expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sampled_topk_is_exact_across_scan_blocks_with_ties_broken_by_position(dtype):
    # Longer than several candidate-scan blocks and not a multiple of one; half-precision values
    # repeat, so ties at the cut (the lowest positions win) fall in different blocks.
    n, k = (1 << 20) + 12_345, 10_600
    x = torch.randn(n, generator=torch.Generator().manual_seed(7)).to(dtype)
    got = topk_indices(x, k, generator=torch.Generator().manual_seed(2))
    magnitude = x.abs().to(torch.float32).numpy()
    by_rank = np.lexsort((np.arange(n), -magnitude))  # largest first, then by position
    assert got.numpy().tolist() == np.sort(by_rank[:k]).tolist()


def test_topk_of_mostly_zero_tensor_still_returns_k():
    x = torch.zeros(200_000)
    x[::1000] = torch.arange(1, 201, dtype=torch.float32)
    got = topk_indices(x, 500)
    assert got.numel() == 500
    assert set(range(0, 200_000, 1000)) <= set(got.tolist())


def test_selection_takes_k_from_every_bucket():
    x = torch.cat([torch.full((1000,), 100.0), torch.full((3000,), 0.01)])
    x += torch.randn(4000) * 1e-3
    sizes = [1000, 3000]
    ks = bucket_ks(sizes, 0.01)
    assert ks == [10, 30]
    (whole,) = slice_ranges(sizes, ks, 1)
    got = select_ranges(x, whole)
    assert (got < 1000).sum() == 10 and (got >= 1000).sum() == 30


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7])
def test_slices_split_every_bucket_and_its_k_and_assemble_to_sorted_top_ks(parts):
    sizes, ks = [1000, 3, 4001, 50], [10, 3, 41, 0]
    ranges = slice_ranges(sizes, ks, parts)
    x = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(parts))
    per_slice = [select_ranges(x, ranges[m]) for m in range(parts)]
    for m in range(parts):
        check_ranges(per_slice[m], ranges[m])
        for a, b, k in ranges[m]:
            assert 0 <= k <= b - a
            expected = torch.topk(x[a:b].abs(), k).indices.sort().values + a
            assert per_slice[m][(per_slice[m] >= a) & (per_slice[m] < b)].equal(expected)
    indices = assemble(per_slice, ranges)
    assert indices.numel() == sum(ks) and bool((indices[1:] > indices[:-1]).all())
    # Which member selects which slice rotates with the round id; every slice has one selector.
    for round_id in range(5):
        assert sorted(slice_of(j, round_id, parts) for j in range(parts)) == list(range(parts))


def test_an_index_set_outside_its_slice_is_refused():
    ranges = slice_ranges([100, 100], [4, 4], 2)[1]  # [50, 100) and [150, 200), 2 each
    check_ranges(torch.tensor([60, 70, 150, 199]), ranges)
    for bad in ([40, 70, 150, 199], [60, 70, 140, 199], [60, 70, 150], [60, 70, 80, 150]):
        with pytest.raises(ValueError):
            check_ranges(torch.tensor(bad), ranges)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 3_000_000), min_size=0, max_size=300, unique=True))
def test_index_codec_roundtrip(values):
    idx = torch.tensor(sorted(values), dtype=torch.int64)
    data = encode_indices(idx)
    assert decode_indices(data, 3_000_001, len(values)).equal(idx)


def test_index_codec_picks_the_shorter_width_and_rejects_bad_input():
    gen = torch.Generator().manual_seed(0)
    one_percent = torch.randperm(1_000_000, generator=gen)[:10_000].sort().values
    data = encode_indices(one_percent)
    assert data[0] == 1 and len(data) < 1.4 * one_percent.numel()  # mostly one byte per index
    tenth = torch.randperm(1_000_000, generator=gen)[:1_000].sort().values
    data = encode_indices(tenth)
    assert data[0] == 2 and len(data) == 1 + 2 * tenth.numel()
    idx = torch.arange(0, 1_000_000, 100)
    data = encode_indices(idx)
    with pytest.raises(ValueError, match="out of range"):
        decode_indices(data, 999_900, idx.numel())
    with pytest.raises(ValueError, match="expected"):
        decode_indices(data, 1_000_000, idx.numel() + 1)
    with pytest.raises(ValueError, match="expected"):
        decode_indices(data + b"\0", 1_000_000, idx.numel())
    with pytest.raises(ValueError, match="encoding"):
        decode_indices(b"\x03" + data[1:], 1_000_000, idx.numel())
    with pytest.raises(ValueError):
        decode_indices(b"\x01\xff", 1_000_000, 1)  # an escape without its full gap
    with pytest.raises(ValueError, match="small enough"):
        decode_indices(b"\x01\xff\x05\x00\x00\x00", 1_000_000, 1)  # not the canonical form
    with pytest.raises(ValueError):
        encode_indices(torch.tensor([5, 5]))
    assert decode_indices(encode_indices(torch.tensor([70_000, 10**9])), 2 * 10**9, 2).tolist() == [70_000, 10**9]
    assert len(encode_indices(torch.arange(300))) <= max_encoded_bytes(300, 300)


@pytest.mark.parametrize("value_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_error_feedback_invariant_sent_plus_residual_is_the_accumulated_input(value_dtype, momentum):
    n = 5000
    fb = ErrorFeedback(n, momentum=momentum)
    gen = torch.Generator().manual_seed(3)
    velocity = torch.zeros(n)
    residual = torch.zeros(n)
    for step in range(6):
        grad = torch.randn(n, generator=gen) * (10.0 ** (step - 3))
        velocity = torch.add(grad, velocity, alpha=momentum) if momentum else grad
        expected = residual + velocity
        pending = fb.accumulate(grad)
        assert pending.accumulated.equal(expected)
        assert fb.residual.equal(residual)  # nothing changes before commit (a failed round loses nothing)
        idx = topk_indices(pending.accumulated, 50)
        fb.commit(pending, idx, value_dtype)
        sent = torch.zeros(n)
        sent[idx] = expected[idx].to(value_dtype).float()
        assert (sent + fb.residual).equal(expected)
        residual = fb.residual.clone()
        if momentum:
            assert fb.velocity[idx].eq(0).all()
            velocity = fb.velocity.clone()


def test_clipping_bounds_the_local_gradient():
    fb = ErrorFeedback(100, clip_norm=1.0)
    pending = fb.accumulate(torch.full((100,), 3.0))
    assert torch.linalg.vector_norm(pending.accumulated) == pytest.approx(1.0, rel=1e-5)


async def test_density_one_sparse_path_equals_dense_bitwise(cluster, gather):
    n, world = 30_011, 3
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(i)) for i in range(world)]
    async with cluster(world, segment_bytes=8192) as peers:
        ring = [p.id for p in peers]
        dense = await gather([lambda p=p, x=x: p.collective.allreduce(x, ring, 1) for p, x in zip(peers, xs)])
        reducers = [SparseAllReducer(p.collective, RoundSpec(density=1.0)) for p in peers]
        via_reducer = await gather([lambda r=r, x=x: r.allreduce(x, ring, 2) for r, x in zip(reducers, xs)])
        # The CLT-k machinery itself with every index selected: the same chunks, the same bits.
        all_idx = torch.arange(n)
        clt = await gather(
            [
                lambda p=p, x=x: p.collective.sparse_round(
                    x, ring, 3, RoundSpec(value_dtype=torch.float32), sizes=[n], ks=[n],
                    select=lambda ranges: torch.cat([torch.arange(a, b) for a, b, _ in ranges]),
                )
                for p, x in zip(peers, xs)
            ]
        )
    for i in range(world):
        assert dense[i].equal(dense[0])
        assert via_reducer[i].equal(dense[0])
        assert clt[i][0].equal(all_idx) and clt[i][1].equal(dense[0])
        assert reducers[i].feedback.residual.eq(0).all()


async def test_sparse_rounds_over_hosts_match_the_in_process_ring_bitwise(cluster, gather, local_ring):
    """Same compressor code, network vs in-process arithmetic: identical bits on every step."""
    n, world, steps = 50_000, 4, 4
    grads = [[torch.randn(n, generator=torch.Generator().manual_seed(s * 10 + i)) for i in range(world)] for s in range(steps)]
    local = local_ring(world)
    async with cluster(world, segment_bytes=16_384) as peers:
        ring = [p.id for p in peers]
        net = [SparseAllReducer(p.collective, RoundSpec(density=0.01, value_dtype=torch.float16)) for p in peers]
        sim = [SparseAllReducer(local.member(i), RoundSpec(density=0.01, value_dtype=torch.float16)) for i in range(world)]
        for step in range(steps):
            a = await gather([lambda r=r, g=g: r.allreduce(g, ring, 100 + step) for r, g in zip(net, grads[step])])
            b = await gather([lambda r=r, g=g: r.allreduce(g, ring, 100 + step) for r, g in zip(sim, grads[step])])
            for i in range(world):
                assert a[i].equal(a[0]) and b[i].equal(a[0])
                assert net[i].last_indices.equal(sim[i].last_indices)
                assert net[i].feedback.residual.equal(sim[i].feedback.residual)
                assert net[i].last_indices.numel() == 500  # 1% of the vector, slice by slice
            assert a[0].count_nonzero() <= 500
