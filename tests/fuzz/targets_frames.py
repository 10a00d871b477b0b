"""Fuzz targets of a sampled robust round's frame payloads (wire/_frames.py): an owner's reported
norms (one float64 per member, each finite and >= 0) and a verifier's draw (a digest and a
signature); anything else is a FrameError."""

from __future__ import annotations

from _p2ptrain_fuzzing import FuzzTarget

from p2ptrain.wire import DRAW_BYTES, FrameError, norms_bytes, parse_draw, parse_norms

MEMBERS = 4

TARGETS = [
    FuzzTarget("wire.frames.norms", lambda data: parse_norms(data, MEMBERS), (FrameError,),
               [norms_bytes([0.0, 1.5, 2.25e-3, 3e300])]),
    FuzzTarget("wire.frames.draw", parse_draw, (FrameError,), [bytes(range(DRAW_BYTES))]),
]
