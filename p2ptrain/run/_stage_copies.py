"""A copy of the next stage's checkpoint files on every member of a pipelined run.

A stage's files are stored by its replicas only (run/_stage_checkpoints.py). When a stage's last
replica dies, the run goes back to the last confirmed checkpoint and a member moved there loads the
stage by CID from that checkpoint's manifest (docs/pipeline.md, "A stage left with no replica"):
someone alive must still provide those files. So after each checkpoint every member of stage ``s``
also fetches stage ``s + 1``'s two files (the last stage's members fetch stage 0's), by CID and
verified, each read bounded by what this architecture's stage state takes. Every stage's files then
live on the replicas of two stages: one stage's worth of extra download and disk per member and
checkpoint, none of memory (the files are not loaded), instead of the whole model's.
"""

from __future__ import annotations

import logging

from p2ptrain.ipfs import ContentUnavailable
from p2ptrain.run._run_state import RunState
from p2ptrain.run._stage_checkpoints import fetch_stage_files
from p2ptrain.run._stage_trainer import StagedTrainer
from p2ptrain.training import ManifestError

logger = logging.getLogger(__name__)


def copied_stage(stage: int, stages: int) -> int:
    """The stage whose files the members of ``stage`` keep a copy of: the next one, cyclically."""
    return (stage + 1) % stages


async def keep_next_stage(run: RunState, manifest_cid: str, stage: int) -> bool:
    """Fetch (and keep) the files of the stage after ``stage`` that the manifest ``manifest_cid``
    names; False, logged, when they cannot be had (a later checkpoint tries again)."""
    trainer, _ = run.require()
    assert isinstance(trainer, StagedTrainer)
    other = copied_stage(stage, len(trainer.stages))
    try:
        await fetch_stage_files(run, trainer, manifest_cid, other)  # fetched: kept in this member's store
    except (ContentUnavailable, ManifestError) as exc:
        logger.warning("%s: could not keep a copy of stage %d of manifest %s: %s", run.log_prefix, other,
                       manifest_cid, exc)
        return False
    logger.info("%s: keeps a copy of stage %d's files of manifest %s", run.log_prefix, other, manifest_cid)
    return True
