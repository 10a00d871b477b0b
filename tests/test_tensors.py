"""all_finite: the one-pass NaN/Inf check every layer makes on gradients and payloads; large_empty:
model-sized buffers on huge pages; zero_fill: zero_() by memset."""

import math

import pytest
import torch

from p2ptrain.base import all_finite, large_empty, zero_fill


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n", [1, 7, 64, 4099])
def test_any_nan_or_inf_anywhere_is_caught(dtype, n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    assert all_finite(x)
    for position in {0, n // 2, n - 1}:  # head, middle (inside a vector lane), tail
        for bad in (math.nan, math.inf, -math.inf):
            y = x.clone()
            y[position] = bad
            assert not all_finite(y), (position, bad)


def test_edge_values():
    assert all_finite(torch.empty(0))
    assert all_finite(torch.zeros(1000))
    big = torch.full((10,), torch.finfo(torch.float32).max)
    assert all_finite(big) and all_finite(-big)  # the largest floats are finite
    assert all_finite(torch.zeros(3, 4))  # any shape
    assert not all_finite(torch.tensor([[0.0, 1.0], [math.nan, 2.0]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.uint8])
def test_large_empty_is_a_writable_flat_tensor_of_its_dtype(dtype):
    for n in (0, 5, 3 << 20):  # empty, small, and large enough for huge pages
        t = large_empty(n, dtype)
        assert t.dtype == dtype and t.shape == (n,) and t.is_contiguous()
        t.fill_(3)
        assert bool((t == 3).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_zero_fill_writes_positive_zeros_to_exactly_its_own_bytes_as_an_in_place_op(dtype):
    base = torch.tensor([math.nan, -0.0, math.inf, -1.5, 3.0] * 1001).to(dtype) if dtype.is_floating_point \
        else torch.arange(-2500, 2505, dtype=dtype)
    for t in (base.clone(), base.clone()[1:-1], base.clone()[::2]):  # whole, a contiguous view, strided
        version = t._version
        assert zero_fill(t) is t
        assert t._version > version  # autograd sees an in-place op
        assert t.to(torch.float64).abs().sum() == 0 and not torch.signbit(t.to(torch.float32)).any()
    outer = base.clone()
    zero_fill(outer[10:20])  # a view: its bytes only
    assert (outer[10:20] == 0).all()
    assert torch.equal(outer[:10].to(torch.float64).nan_to_num(), base[:10].to(torch.float64).nan_to_num())
    assert torch.equal(outer[20:].to(torch.float64).nan_to_num(), base[20:].to(torch.float64).nan_to_num())
    assert zero_fill(torch.empty(0, dtype=dtype)).numel() == 0
