"""Fuzz target of the stage protocol's frames (wire/activations.py): activations and gradients as
fp32, fp16 or int8, targets as i64, under a receiver's limits; anything malformed is an ActivationError."""

from __future__ import annotations

import torch
from _p2ptrain_fuzzing import FuzzTarget

from p2ptrain.wire.activations import ActivationError, decode_frame, encode_frame, Frame, Kind, Limits

_LIMITS = Limits(max_rank=4, max_elements=1 << 16)
_G = torch.Generator().manual_seed(0)
_A = torch.randn(2, 3, 40, generator=_G)
_SEEDS = [
    encode_frame(Frame(Kind.LOSS, 3, 7, 3, 0.5, (_A, torch.randint(0, 9, (2, 3), generator=_G))), "fp32"),
    encode_frame(Frame(Kind.BACKWARD, 3, 7, 2, 0.0, (_A, _A * 0.1)), "fp16"),
    encode_frame(Frame(Kind.OUTPUT, 3, 7, 1, 0.0, (_A,)), "int8"),
    encode_frame(Frame(Kind.HOLDINGS, 3, 0, 1)),
]

TARGETS = [FuzzTarget("wire.activations", lambda data: decode_frame(data, _LIMITS), (ActivationError,), _SEEDS)]
