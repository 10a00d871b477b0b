"""What the pipeline tests share: a task of a transformer_lm small enough to cut and plan quickly."""

from __future__ import annotations

from typing import Any

CID = "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o"
LM = {"vocab_size": 61, "context": 16, "width": 16, "depth": 2, "heads": 2}  # 4 pieces
LM_TASK = f"""
name = "t"
[model]
name = "transformer_lm"
kwargs = {{ vocab_size = 61, context = 16, width = 16, depth = 2, heads = 2 }}
[dataset]
manifest = "{CID}"
[optimizer]
name = "sgd"
lr = 0.1
[training]
batch_size = 8
total_steps = 10
[peers]
min = 4
"""


def planned_six(run: Any) -> tuple[list[str], list[str]] | None:
    """Once ``run``'s last plan has six members and a round is done: its drivers (stage 0) and its
    replicas of stage 1 other than the coordinator (the bystanders a hostile-replica test makes lie
    or stall), once stage 1 has three replicas; else None."""
    plan = run.book.last_plan if run.book else None
    if plan is None or plan.stages is None or len(plan.members) < 6 or not run.rounds_done:
        return None
    drivers = [m for m, s in zip(plan.members, plan.stages, strict=True) if s == 0]
    last = [m for m, s in zip(plan.members, plan.stages, strict=True) if s == 1]
    others = [m for m in last if m != run.election.coordinator]
    return (drivers, others) if len(last) >= 3 and others else None
