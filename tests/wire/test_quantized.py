"""The quantized sparse values (wire/quantization.py): bytes pinned, decoder bounded, error feedback exact."""

from __future__ import annotations

import math

import pytest
import torch

from p2ptrain.collective import ErrorFeedback
from p2ptrain.wire.quantization import CHUNK, KINDS, QuantError, decode, encode, encoded_size, roundtrip

VALUES = torch.tensor([1.0, -0.5, 0.2, 0.0, -1.0])


def test_the_bytes_of_each_quantization_are_pinned() -> None:
    # int8: scale max/127 (float32 LE), then one signed code per value (-0.5 * 127 rounds to -64).
    assert encode(VALUES, "int8").hex() == "0402013c" + "7fc0190081"
    # 2bit: scale max, then codes 3,1,2,2 | 0 (levels -1, -1/3, 1/3, 1), four a byte, low bits first.
    assert encode(VALUES, "2bit").hex() == "0000803f" + "a700"
    assert decode(bytes.fromhex("0000803fa700"), 5, "2bit").tolist() == pytest.approx([1, -1 / 3, 1 / 3, 1 / 3, -1])


@pytest.mark.parametrize("kind", KINDS)
def test_a_scale_per_chunk_and_the_exact_size(kind: str) -> None:
    values = torch.cat([torch.full((CHUNK,), 100.0), torch.full((CHUNK + 3,), 0.01)])
    data = encode(values, kind)
    assert len(data) == encoded_size(values.numel(), kind) == 4 * 3 + (
        values.numel() if kind == "int8" else math.ceil(values.numel() / 4))
    back = decode(data, values.numel(), kind)
    # The small chunk keeps its own scale: its values are not flushed to zero by the large one.
    assert back[CHUNK:].eq(0.01).all() if kind == "2bit" else torch.allclose(back[CHUNK:], values[CHUNK:], rtol=1e-2)


@pytest.mark.parametrize("kind", KINDS)
def test_hostile_bytes_are_one_declared_error(kind: str) -> None:
    count = 199  # not a multiple of four: the last 2-bit byte has padding bits
    good = encode(torch.randn(count), kind)
    bad = [
        good[:-1], good + b"\0", b"",  # not the exact size for the count
        b"\x00\x00\xc0\x7f" + good[4:],  # a NaN scale
        b"\x00\x00\x80\xbf" + good[4:],  # a negative scale
        good[:-1] + bytes([0x80]) if kind == "int8" else good[:-1] + bytes([good[-1] | 0xC0]),  # -128; padding
    ]
    if kind == "int8":
        bad.append(b"\xff\xff\x7f\x7f" + good[4:])  # float32's max as a scale: 127 codes of it overflow
    for data in bad:
        with pytest.raises(QuantError):
            decode(data, count, kind)
    with pytest.raises(QuantError):
        decode(good, count, "int4")


@pytest.mark.parametrize("kind", ["fp16", *KINDS])
def test_error_feedback_keeps_what_each_quantizer_does_not_send(kind: str) -> None:
    """Sent + residual == accumulated input, exactly: a round's rounding is in the next round."""
    n = 1000
    feedback = ErrorFeedback(n)
    grad = torch.randn(n, generator=torch.Generator().manual_seed(7))
    pending = feedback.accumulate(grad)
    accumulated = pending.accumulated.clone()
    indices = torch.arange(0, n, 10)
    chosen = accumulated[indices]
    if kind == "fp16":
        sent = chosen.to(torch.float16).to(torch.float32)
        feedback.commit(pending, indices, torch.float16)
    else:
        sent = roundtrip(chosen, kind)
        feedback.commit(pending, indices, torch.float32, sent)
    assert not sent.equal(chosen)  # each quantizer does drop something here
    total = feedback.residual.clone()
    total[indices] += sent
    assert torch.allclose(total, accumulated, rtol=0, atol=1e-6)
    assert feedback.residual[indices].equal(chosen - sent)
    untouched = torch.ones(n, dtype=torch.bool)
    untouched[indices] = False
    assert feedback.residual[untouched].equal(accumulated[untouched])
