"""Stage-protocol frames (wire/activations.py): round trips within their error bounds, and every
malformed frame refused with the one declared error before anything large is allocated."""

from __future__ import annotations

import struct

import pytest
import torch

from p2ptrain.wire import quantization
from p2ptrain.wire.activations import (
    ActivationError,
    decode_frame,
    encode_frame,
    Frame,
    HEADER,
    Kind,
    Limits,
)

G = torch.Generator().manual_seed(0)


def _activation(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=G) * 3


def test_fp32_round_trip_is_exact_and_keeps_the_header():
    a, targets = _activation(2, 5, 7), torch.randint(0, 50, (2, 5), generator=G)
    frame = Frame(Kind.LOSS, step=9, microbatch=(9 << 20) | 3, stage=3, value=0.25, tensors=(a, targets))
    out = decode_frame(encode_frame(frame, "fp32"))
    assert (out.kind, out.step, out.microbatch, out.stage, out.value) == (Kind.LOSS, 9, (9 << 20) | 3, 3, 0.25)
    assert torch.equal(out.tensors[0], a) and out.tensors[0].dtype == torch.float32
    assert torch.equal(out.tensors[1], targets) and out.tensors[1].dtype == torch.int64


def test_fp16_round_trip_is_within_half_precision():
    a = _activation(4, 33)
    data = encode_frame(Frame(Kind.FORWARD, 1, 2, 1, tensors=(a,)), "fp16")
    out = decode_frame(data).tensors[0]
    assert out.dtype == torch.float32 and out.shape == a.shape
    assert torch.all((out - a).abs() <= a.abs() * 2**-11 + 2**-24)
    assert len(data) < len(encode_frame(Frame(Kind.FORWARD, 1, 2, 1, tensors=(a,)), "fp32")) * 0.55


def test_int8_round_trip_is_within_half_a_code_of_each_blocks_scale():
    a = _activation(3, 100)  # 300 values: three blocks of 128, the last one short
    a[1, 7] = 500.0  # one outlier only coarsens its own block
    data = encode_frame(Frame(Kind.OUTPUT, 1, 2, 1, tensors=(a,)), "int8")
    out = decode_frame(data).tensors[0]
    flat, got = a.reshape(-1), out.reshape(-1)
    for start in range(0, 300, quantization.CHUNK):
        block = slice(start, start + quantization.CHUNK)
        bound = flat[block].abs().max() / 127 / 2 * (1 + 1e-6)
        assert torch.all((got[block] - flat[block]).abs() <= bound), start
    assert len(data) == HEADER.size + 2 + 2 * 4 + 8 + 300 + 3 * 4


def test_an_activation_that_does_not_fit_its_encoding_is_refused_at_the_sender():
    with pytest.raises(ActivationError, match="not finite"):
        encode_frame(Frame(Kind.FORWARD, 1, 1, 1, tensors=(torch.tensor([1.0, float("nan")]),)))
    with pytest.raises(ActivationError, match="overflows fp16"):
        encode_frame(Frame(Kind.FORWARD, 1, 1, 1, tensors=(torch.tensor([1e6]),)), "fp16")
    with pytest.raises(ActivationError, match="unknown activation encoding"):
        encode_frame(Frame(Kind.FORWARD, 1, 1, 1, tensors=(torch.ones(2),)), "fp8")


def _tensor_bytes(code: int, shape: tuple[int, ...], length: int, payload: bytes) -> bytes:
    return bytes([code, len(shape)]) + b"".join(struct.pack(">I", d) for d in shape) + struct.pack(">Q", length) + payload


def _frame(*tensors: bytes, kind: int = Kind.FORWARD, value: float = 0.0) -> bytes:
    return HEADER.pack(b"PP", 1, kind, 1, 5, 2, value, len(tensors)) + b"".join(tensors)


def test_a_hand_built_frame_decodes():
    out = decode_frame(_frame(_tensor_bytes(1, (2,), 8, struct.pack("<2f", 1.5, -2.0))))
    assert out.tensors[0].tolist() == [1.5, -2.0]


MALFORMED = [
    (b"PP\x01", "shorter than"),
    (b"PC" + _frame()[2:], "not a stage-protocol frame"),
    (_frame(kind=99), "unknown frame kind 99"),
    (_frame(value=float("nan")), "value is not finite"),
    (HEADER.pack(b"PP", 1, 1, 1, 1, 1, 0.0, 3), "3 tensors"),
    (_frame(_tensor_bytes(9, (2,), 8, b"\0" * 8)), "unknown tensor encoding"),
    (_frame(_tensor_bytes(1, (1,) * 5, 4, b"\0" * 4)), "rank 5"),
    (_frame(_tensor_bytes(1, (), 0, b"")), "rank 0"),
    (_frame(_tensor_bytes(1, (0, 4), 0, b"")), "empty or over"),
    # A shape whose product is astronomical is refused from its dimensions, before any payload.
    (_frame(_tensor_bytes(1, (1 << 31, 1 << 31, 1 << 31), 8, b"\0" * 8)), "empty or over"),
    # A length claim that the shape does not take, or that the frame does not hold.
    (_frame(_tensor_bytes(1, (2,), 1 << 60, b"\0" * 8)), "claims 1152921504606846976 bytes"),
    (_frame(_tensor_bytes(1, (4,), 16, b"\0" * 8)), "the frame has 8"),
    (_frame(_tensor_bytes(1, (2,), 8, b"\0" * 8) + b"x"), "1 bytes after"),
    (_frame(_tensor_bytes(1, (2,), 8, struct.pack("<2f", 1.0, float("inf")))), "not finite"),
    (_frame(_tensor_bytes(2, (1,), 2, struct.pack("<e", float("nan")))), "not finite"),
    # int8: a NaN scale, a negative scale, the unused code -128.
    (_frame(_tensor_bytes(3, (2,), 6, struct.pack("<f", float("nan")) + b"\1\1")), "scale is negative or not finite"),
    (_frame(_tensor_bytes(3, (2,), 6, struct.pack("<f", -1.0) + b"\1\1")), "scale is negative or not finite"),
    (_frame(_tensor_bytes(3, (2,), 6, struct.pack("<f", 1.0) + b"\x80\1")), "-128"),
    (_frame(_tensor_bytes(1, (2,), 8, b"\0" * 4)), "the frame has 4"),
    (_frame(_tensor_bytes(1, (2,), 8, b"\0" * 8), b"\1"), "inside a tensor header"),
]


@pytest.mark.parametrize(("data", "why"), MALFORMED, ids=[why for _, why in MALFORMED])
def test_malformed_frames_are_refused_with_the_one_error(data, why):
    with pytest.raises(ActivationError, match=why):
        decode_frame(data)


def test_the_receivers_limits_bound_every_tensor():
    a = torch.zeros(4, 4, 4)
    data = encode_frame(Frame(Kind.OUTPUT, 1, 1, 1, tensors=(a,)))
    assert decode_frame(data, Limits(max_rank=3, max_elements=64)).tensors[0].shape == (4, 4, 4)
    with pytest.raises(ActivationError, match="rank 3"):
        decode_frame(data, Limits(max_rank=2, max_elements=64))
    with pytest.raises(ActivationError, match="over 63 values"):
        decode_frame(data, Limits(max_rank=3, max_elements=63))
    assert len(data) <= Limits(max_rank=3, max_elements=64).max_frame_bytes()
