"""Copies of the following stages' checkpoint files on every member of a pipelined run.

A stage's files are stored by its replicas only (run/_stage_checkpoints.py). When a stage's last
replica dies, the run goes back to the last confirmed checkpoint and a member moved there loads the
stage by CID from that checkpoint's manifest (docs/pipeline.md, "A stage left with no replica"):
someone alive must still provide those files. So after each checkpoint every member of stage ``s``
also fetches the two files of the ``k`` stages after it, cyclically (``[pipeline] copies = k``, 1
by default), by CID and verified, each read bounded by what this architecture's stage state takes.
Every stage's files then live on the replicas of ``k + 1`` stages, and a run survives ``k``
adjacent stages losing every replica between two checkpoints: ``k`` stages' worth of extra download
and disk per member and checkpoint, none of memory (the files are not loaded).
"""

from __future__ import annotations

import logging

from p2ptrain.ipfs import ContentUnavailable
from p2ptrain.run._run_state import RunState
from p2ptrain.run._stage_checkpoints import fetch_stage_files
from p2ptrain.run._stage_trainer import StagedTrainer
from p2ptrain.training import ManifestError

logger = logging.getLogger(__name__)


def copied_stages(stage: int, stages: int, copies: int) -> list[int]:
    """The stages whose files the members of ``stage`` keep a copy of: the ``copies`` after it,
    cyclically (never its own: its replicas hold that)."""
    if not 1 <= copies < stages:
        raise ValueError(f"{copies} copies of the other stages of {stages}")
    return [(stage + i) % stages for i in range(1, copies + 1)]


async def keep_stage_copies(run: RunState, manifest_cid: str, stage: int) -> int:
    """Fetch (and keep) the files of the stages :func:`copied_stages` names that the manifest
    ``manifest_cid`` lists; how many were had. One that cannot be had is logged (a later
    checkpoint tries again) and the others are still fetched."""
    trainer, _ = run.require()
    assert isinstance(trainer, StagedTrainer) and run.task.pipeline is not None
    kept = 0
    for other in copied_stages(stage, len(trainer.stages), run.task.pipeline.stage_copies):
        try:
            await fetch_stage_files(run, trainer, manifest_cid, other)  # fetched: kept in this member's store
        except (ContentUnavailable, ManifestError) as exc:
            logger.warning("%s: could not keep a copy of stage %d of manifest %s: %s", run.log_prefix, other,
                           manifest_cid, exc)
            continue
        logger.info("%s: keeps a copy of stage %d's files of manifest %s", run.log_prefix, other, manifest_cid)
        kept += 1
    return kept
