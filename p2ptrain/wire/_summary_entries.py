"""A driver's entry in a pipelined step's summary: what it puts in the summary's
``Collective.gather`` (run/_step_summary.py gathers the entries and computes the step's loss and
verdict; a replica's entry is empty).

An entry is its share of the step's mean loss (float64 little-endian), whether its step failed (one
byte, 0 or 1), then the plan indices of the replicas it accuses (u16 little-endian each, at most
:data:`MAX_ACCUSED`): 9 to 41 bytes, always an odd count. A *timed* entry (a task with ``[pipeline]
balance = "measured"`` only) has, between the flag and the accused, the count of its stages (one
byte, 2 to :data:`MAX_TIMED_STAGES`: a pipeline's) and, per stage, the microseconds a microbatch took there as
this driver measured it (u32 little-endian each; 0: not measured): an even count of bytes, so an
entry of the first kind reads as it always did and is never taken for a timed one. Every member
reads every driver's entry, so the decoder takes nothing on trust: a length that is no entry, a
loss share that is not finite and >= 0, a flag that is not 0 or 1, a stage count out of its range
or (given the plan) not the plan's, or (given the plan) an accused index that is not a distinct
replica of it is refused with ``ValueError``, its one error.
"""

from __future__ import annotations

import math
import struct
from typing import NamedTuple

from p2ptrain.wire._messages import RoundPlan

# A driver's entry: its share of the step's mean loss (float64) and whether its step failed (0 or 1),
# then the plan indices of the replicas it accuses (u16 each).
ENTRY = struct.Struct("<dB")
ACCUSED = struct.Struct("<H")
MAX_ACCUSED = 16
MAX_SUMMARY_ENTRY_BYTES = ENTRY.size + MAX_ACCUSED * ACCUSED.size
# A timed entry: the stage count (u8), then each stage's microseconds per microbatch (u32).
STAGE_COUNT = struct.Struct("<B")
MICROSECONDS = struct.Struct("<I")
MAX_TIMED_STAGES = 64  # the task's MAX_STAGES (wire does not import task)
MAX_TIMED_ENTRY_BYTES = MAX_SUMMARY_ENTRY_BYTES + STAGE_COUNT.size + MAX_TIMED_STAGES * MICROSECONDS.size


class SummaryEntry(NamedTuple):
    """A driver's entry, read: its loss share, its failure, the plan indices it accuses, and (a
    timed entry's) each stage's microseconds per microbatch, empty for an entry of the first kind."""

    loss: float
    failed: bool
    accused: tuple[int, ...]
    micros: tuple[int, ...] = ()


def summary_entry_bytes(loss: float, failed: bool, accused: tuple[int, ...] = (), micros: tuple[int, ...] = ()) -> bytes:
    """A driver's entry; ``accused``: the plan indices of the replicas it accuses; ``micros``: each
    stage's microseconds per microbatch (a timed entry; none: the entry of the first kind, whose
    bytes are those it had before timed entries existed)."""
    timing = (STAGE_COUNT.pack(len(micros)) + b"".join(MICROSECONDS.pack(m) for m in micros)) if micros else b""
    return ENTRY.pack(loss, int(failed)) + timing + b"".join(ACCUSED.pack(i) for i in accused)


def read_summary_entry(raw: bytes, plan: RoundPlan | None = None) -> SummaryEntry:
    """A driver's entry: its loss share, its failure, the plan indices it accuses (replicas of
    ``plan``, each once) and its stages' times (``plan``'s stage count of them, or none);
    ``ValueError`` for bytes that are not one."""
    start, micros = ENTRY.size, ()
    if len(raw) % 2 == 0 and len(raw) > ENTRY.size:  # a timed entry
        (count,) = STAGE_COUNT.unpack_from(raw, start)
        start += STAGE_COUNT.size + count * MICROSECONDS.size
        if not 2 <= count <= MAX_TIMED_STAGES or len(raw) < start:
            raise ValueError(f"a driver's timed summary names 2 to {MAX_TIMED_STAGES} stages' times, "
                             f"not {count} in {len(raw)} bytes")
        micros = tuple(m for (m,) in MICROSECONDS.iter_unpack(raw[ENTRY.size + STAGE_COUNT.size:start]))
    extra = len(raw) - start
    if extra < 0 or extra % ACCUSED.size or extra > MAX_ACCUSED * ACCUSED.size:
        raise ValueError(f"a driver's summary has {ENTRY.size} bytes and at most {MAX_ACCUSED} accused, not {len(raw)} bytes")
    loss, failed = ENTRY.unpack_from(raw)
    if not (math.isfinite(loss) and loss >= 0.0) or failed > 1:
        raise ValueError(f"a driver's summary is a finite loss share >= 0 and a flag 0 or 1, not ({loss}, {failed})")
    accused = tuple(i for (i,) in ACCUSED.iter_unpack(raw[start:]))
    if plan is not None:
        stages = plan.stages or ()
        if len(set(accused)) != len(accused) or any(i >= len(stages) or stages[i] == 0 for i in accused):
            raise ValueError(f"a driver accuses {list(accused)}: not distinct replicas of the plan")
        if micros and len(micros) != max(stages, default=-1) + 1:
            raise ValueError(f"a driver times {len(micros)} stages of a plan of {max(stages, default=-1) + 1}")
    return SummaryEntry(loss, bool(failed), accused, micros)
