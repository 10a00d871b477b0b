"""Fuzz target of a pipelined step summary's driver entry (wire/_summary_entries.py): a float64
loss share, a failure byte, (a timed entry's) a stage count and a u32 per stage, and up to 16 u16
accused replica indices, checked against the plan; anything else is a ValueError, the decoder's one error."""

from __future__ import annotations

from _p2ptrain_fuzzing import FuzzTarget

from p2ptrain.wire import read_summary_entry, RoundPlan, summary_entry_bytes

CID = "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o"
# Two drivers (stage 0) and three replicas (stages 1 and 2): indices 2, 3 and 4 may be accused.
PLAN = RoundPlan(task_cid=CID, term=1, round=3, attempt=0, step=3, rounds=1, base_cid=CID, version=1,
                 members=tuple(str(i) * 52 for i in range(5)), stages=(0, 0, 1, 2, 2))

TARGETS = [
    FuzzTarget("wire.summary_entry", lambda data: read_summary_entry(data, PLAN), (ValueError,),
               [summary_entry_bytes(0.25, False), summary_entry_bytes(1.5, True, (2, 4)),
                summary_entry_bytes(0.5, False, (3,), (0, 1200, 900))]),
]
