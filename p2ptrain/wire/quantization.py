"""Quantized sparse values: int8 and 2-bit codes with one float32 scale per chunk of values.

The values of a sparse all-reduce round (the entries of the agreed top-k index set) can travel as
``int8`` (codes -127..127, scale = max |v| / 127) or ``2bit`` (codes 0..3 for the levels
-1, -1/3, +1/3, +1 times scale = max |v|, four codes to a byte, the first in the low bits), with
one scale per :data:`CHUNK` consecutive values. Bytes: the scales (float32, little-endian) first,
then the codes. The count of values is not in the bytes: both sides know it from the round.

What a peer sends is only ever *dequantized* (``code * scale`` in float32, the same operation on
every member), never trusted for its size: :func:`decode` checks the exact length for the expected
count before it reads anything, and refuses non-finite or negative scales, int8 values that
overflow float32 (a scale above its max / 127), the int8 code -128 and non-zero padding bits, with
one error, :class:`QuantError`. The sender's error feedback keeps ``v - dequantize(quantize(v))``,
so nothing the quantization drops is lost (tests/wire/test_quantized.py pins the bytes).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from p2ptrain.base import all_finite

# Values per scale: 128 keeps the scales' share small (4 bytes per 128 values: 0.25 bits a value)
# while a chunk's largest value, which sets its scale, is local enough to keep small values apart.
CHUNK = 128
KINDS = ("int8", "2bit")
# The 2-bit levels, in units of the chunk's scale (its largest magnitude): uniform on [-1, 1].
_LEVELS = torch.tensor([-1.0, -1.0 / 3.0, 1.0 / 3.0, 1.0], dtype=torch.float32)
_INT8_MAX = 127


class QuantError(ValueError):
    """Bytes that are not the quantized values expected (the only error of :func:`decode`)."""


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise QuantError(f"unknown quantization {kind!r} (known: {', '.join(KINDS)})")


def encoded_size(count: int, kind: str) -> int:
    """The exact length of :func:`encode` of ``count`` values."""
    _check_kind(kind)
    scales = 4 * math.ceil(count / CHUNK)
    return scales + (count if kind == "int8" else math.ceil(count / 4))


def _scales(values: torch.Tensor) -> torch.Tensor:
    """max |v| of every chunk (the last one may be short), float32."""
    count = values.numel()
    chunks = math.ceil(count / CHUNK)
    padded = torch.zeros(chunks * CHUNK, dtype=torch.float32)
    padded[:count] = values.abs()
    return padded.view(chunks, CHUNK).amax(dim=1)


def _per_value(scales: torch.Tensor, count: int) -> torch.Tensor:
    return scales.repeat_interleave(CHUNK)[:count]


def encode(values: torch.Tensor, kind: str) -> bytes:
    """The bytes of ``values`` (flat, finite float32) quantized as ``kind``."""
    _check_kind(kind)
    values = values.detach().to(torch.float32).reshape(-1)
    count = values.numel()
    scales = _scales(values)
    if kind == "int8":
        scales = scales / _INT8_MAX
    each = _per_value(scales, count)
    safe = torch.where(each > 0, each, torch.ones_like(each))
    ratio = values / safe
    if kind == "int8":
        codes = torch.round(ratio).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8).numpy().tobytes()
    else:
        # The nearest of the four levels: (2c - 3) / 3 = r  <=>  c = (3r + 3) / 2.
        c = torch.round((ratio * 3.0 + 3.0) / 2.0).clamp_(0, 3).to(torch.uint8).numpy()
        padded = np.zeros(math.ceil(count / 4) * 4, dtype=np.uint8)
        padded[:count] = c
        quads = padded.reshape(-1, 4)
        codes = (quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)).astype(np.uint8).tobytes()
    return scales.numpy().astype("<f4").tobytes() + codes


def decode(data: bytes, count: int, kind: str) -> torch.Tensor:
    """The float32 values that ``data`` (from :func:`encode` of ``count`` values) stands for."""
    _check_kind(kind)
    if count < 0:
        raise QuantError(f"negative count {count}")
    expected = encoded_size(count, kind)
    if len(data) != expected:
        raise QuantError(f"{len(data)} bytes for {count} {kind} values, expected {expected}")
    chunks = math.ceil(count / CHUNK)
    scales = torch.from_numpy(np.frombuffer(data, dtype="<f4", count=chunks).astype(np.float32))
    if not all_finite(scales) or bool((scales < 0).any()):
        raise QuantError("a scale is negative or not finite")
    each = _per_value(scales, count)
    raw = np.frombuffer(data, dtype=np.uint8, offset=4 * chunks)
    if kind == "int8":
        codes = raw.view(np.int8)
        if codes.size and int(codes.min()) < -_INT8_MAX:
            raise QuantError("int8 code -128 is not used")
        values = torch.from_numpy(codes.astype(np.float32)) * each
        if not all_finite(values):  # 127 x a scale above float32's max / 127
            raise QuantError("a value overflows float32")
        return values
    unpacked = np.stack([(raw >> shift) & 3 for shift in (0, 2, 4, 6)], axis=1).reshape(-1)
    if np.any(unpacked[count:]):
        raise QuantError("padding bits of the last byte are not zero")
    levels = _LEVELS[torch.from_numpy(unpacked[:count].astype(np.int64))]
    return levels * each


def roundtrip(values: torch.Tensor, kind: str) -> torch.Tensor:
    """``decode(encode(values))``: what the members receive for ``values`` (the sender's error
    feedback keeps the difference)."""
    return decode(encode(values, kind), values.numel(), kind)
