"""A driver's entry in a pipelined step's summary: what it puts in the summary's
``Collective.gather`` (run/_step_summary.py gathers the entries and computes the step's loss and
verdict; a replica's entry is empty).

An entry is its share of the step's mean loss (float64 little-endian), whether its step failed (one
byte, 0 or 1), then the plan indices of the replicas it accuses (u16 little-endian each, at most
:data:`MAX_ACCUSED`): 9 to 41 bytes. Every member reads every driver's entry, so the decoder takes
nothing on trust: a length that is no entry, a loss share that is not finite and >= 0, a flag that
is not 0 or 1, or (given the plan) an accused index that is not a distinct replica of it is refused
with ``ValueError``, its one error.
"""

from __future__ import annotations

import math
import struct

from p2ptrain.wire._messages import RoundPlan

# A driver's entry: its share of the step's mean loss (float64) and whether its step failed (0 or 1),
# then the plan indices of the replicas it accuses (u16 each).
ENTRY = struct.Struct("<dB")
ACCUSED = struct.Struct("<H")
MAX_ACCUSED = 16
MAX_SUMMARY_ENTRY_BYTES = ENTRY.size + MAX_ACCUSED * ACCUSED.size


def summary_entry_bytes(loss: float, failed: bool, accused: tuple[int, ...] = ()) -> bytes:
    """A driver's entry; ``accused``: the plan indices of the replicas it accuses."""
    return ENTRY.pack(loss, int(failed)) + b"".join(ACCUSED.pack(i) for i in accused)


def read_summary_entry(raw: bytes, plan: RoundPlan | None = None) -> tuple[float, bool, tuple[int, ...]]:
    """A driver's entry: its loss share, its failure, the plan indices it accuses (replicas of
    ``plan``, each once); ``ValueError`` for bytes that are not one."""
    extra = len(raw) - ENTRY.size
    if extra < 0 or extra % ACCUSED.size or extra > MAX_ACCUSED * ACCUSED.size:
        raise ValueError(f"a driver's summary has {ENTRY.size} bytes and at most {MAX_ACCUSED} accused, not {len(raw)} bytes")
    loss, failed = ENTRY.unpack_from(raw)
    if not (math.isfinite(loss) and loss >= 0.0) or failed > 1:
        raise ValueError(f"a driver's summary is a finite loss share >= 0 and a flag 0 or 1, not ({loss}, {failed})")
    accused = tuple(i for (i,) in ACCUSED.iter_unpack(raw[ENTRY.size:]))
    if plan is not None:
        stages = plan.stages or ()
        if len(set(accused)) != len(accused) or any(i >= len(stages) or stages[i] == 0 for i in accused):
            raise ValueError(f"a driver accuses {list(accused)}: not distinct replicas of the plan")
    return loss, bool(failed), accused
