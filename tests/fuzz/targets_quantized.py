"""Fuzz targets of the quantized sparse values (wire/quantization.py): a peer's int8 or 2-bit values
for a round of a known count; anything but the exact encoding is a QuantError."""

from __future__ import annotations

import torch
from _p2ptrain_fuzzing import FuzzTarget

from p2ptrain.wire.quantization import QuantError, decode, encode

COUNT = 301  # three chunks, the last one short; not a multiple of four (2-bit padding)
_VALUES = torch.randn(COUNT, generator=torch.Generator().manual_seed(0))

TARGETS = [
    FuzzTarget(f"wire.quantized.{kind}", lambda data, kind=kind: decode(data, COUNT, kind), (QuantError,),
               [encode(_VALUES, kind)])
    for kind in ("int8", "2bit")
]
