"""A pipelined run's checkpoints: each stage's files, one manifest naming them all, and a stage
loaded by CID from the manifest of the run's latest confirmed checkpoint (docs/pipeline.md).

At the end of a span every member stores its stage's two files
(:meth:`~p2ptrain.run._stage_trainer.StagedTrainer.stage_files`; the replicas of a stage hold the
same bits, so the same CIDs). Then one exact sum over the plan's members in which the first replica
(in plan order) of every stage contributes its two CIDs, as bytes, one float each (``x + 0`` is
``x``): every member learns every stage's CIDs and computes the same manifest, whose CID is both
the model CID and the optimizer CID it hands to the record and its attestation, as a data-parallel
member hands its files'. Records, attestations and tallies are those of any run.

What each member checks is its own stage: the CIDs the first replica named must be its own, else
it counts ``stage_diverged`` and attests the manifest with its own (a mismatch, as a member whose
bits differ attests in a data-parallel run). The stages it does not hold it cannot check: a first
replica that names files the others of its stage do not hold is refused by them (to come: a quorum
counted per stage).
"""

from __future__ import annotations

import logging

import torch
import trio
from libp2p.peer.id import ID

from p2ptrain.base import short_id
from p2ptrain.collective import CollectiveError, RoundSpec
from p2ptrain.ipfs import ContentUnavailable, parse_cid
from p2ptrain.protocol import buffers_round_id, RecordError, stage_rings
from p2ptrain.run._run_state import RunState
from p2ptrain.run._stage_trainer import StagedTrainer
from p2ptrain.training import (ManifestError, manifest_bytes, MAX_MANIFEST_BYTES, read_manifest, StageFile,
                               TrainerError)
from p2ptrain.wire import RoundPlan

logger = logging.getLogger(__name__)

# The bytes one CID takes in the gather (CIDv0 has 46 characters, a base32 CIDv1 of sha2-256 59).
CID_BYTES = 64
# Fetching a stage's manifest or files: each read is bounded in bytes too, so this only ends a
# transfer that stalls (the resync's bound).
FETCH_TIMEOUT_S = 60.0


def cids_vector(stages: int, stage: int | None, cids: tuple[str, str]) -> torch.Tensor:
    """A member's part of the gather: ``cids`` (model, optimizer) as byte values in ``stage``'s
    slots when it contributes that stage (``stage`` None: zeros, a member that does not)."""
    flat = torch.zeros(stages * 2 * CID_BYTES, dtype=torch.float32)
    if stage is not None:
        for k, cid in enumerate(cids):
            raw = cid.encode("ascii")
            if len(raw) > CID_BYTES:
                raise ValueError(f"CID {cid} is longer than {CID_BYTES} characters")
            offset = (2 * stage + k) * CID_BYTES
            flat[offset : offset + len(raw)] = torch.tensor(list(raw), dtype=torch.float32)
    return flat


def read_cids_vector(flat: torch.Tensor, stages: int) -> list[tuple[str, str]]:
    """Every stage's (model, optimizer) CIDs from the summed gather; ``ValueError`` for a sum that
    names no CID somewhere (a stage nobody contributed, or a member that added garbage)."""
    if flat.shape != (stages * 2 * CID_BYTES,):
        raise ValueError(f"the gathered CIDs have shape {tuple(flat.shape)}")
    values = flat.tolist()
    if any(not (0 <= v < 128 and v == int(v)) for v in values):
        raise ValueError("the gathered CIDs are not ASCII bytes")
    out: list[tuple[str, str]] = []
    for stage in range(stages):
        pair = []
        for k in range(2):
            offset = (2 * stage + k) * CID_BYTES
            cid = bytes(int(v) for v in values[offset : offset + CID_BYTES]).rstrip(b"\0").decode("ascii")
            try:
                parse_cid(cid)
            except Exception:
                raise ValueError(f"stage {stage}'s gathered CID {cid!r} is no CID") from None
            pair.append(cid)
        out.append((pair[0], pair[1]))
    return out


async def store_stage_checkpoint(run: RunState, plan: RoundPlan, stage: int, *, timeout: float,
                                 start_timeout: float) -> str | None:
    """Store this member's stage files at the end of ``plan``, learn every other stage's CIDs and
    store the manifest: its CID (the record's model and optimizer CID), or None when the gather
    failed (no checkpoint this span, as a failed buffer average in a data-parallel run)."""
    trainer, _ = run.require()
    assert isinstance(trainer, StagedTrainer)
    store = run.content.store
    model_data, optim_data = await trio.to_thread.run_sync(trainer.stage_files, stage)
    own = (await trio.to_thread.run_sync(store.add_bytes, model_data),
           await trio.to_thread.run_sync(store.add_bytes, optim_data))
    rings = stage_rings(plan)
    count = len(trainer.stages)
    flat = cids_vector(count, stage if rings[stage][0] == run.me else None, own)
    members = [ID.from_base58(m) for m in plan.members]
    try:
        summed = await run.collective.allreduce(flat, members, buffers_round_id(plan), RoundSpec(
            op="sum", timeout=timeout, start_timeout=start_timeout))
        named = read_cids_vector(summed, count)
    except (CollectiveError, ValueError) as exc:
        logger.warning("%s: gathering the stages' CIDs at step %d failed (%s); no checkpoint this span",
                       run.log_prefix, trainer.step, exc)
        return None
    if named[stage] != own:
        # This member's stage differs from the files its first replica named: one of them went astray.
        run.refuse("stage_diverged", f"at step {trainer.step} this member's stage {stage} differed from "
                   f"{short_id(rings[stage][0])}'s; attesting its own")
        named[stage] = own
    entries = [StageFile(s.first, s.last, m, o, trainer.stage_numbers(i))
               for i, (s, (m, o)) in enumerate(zip(trainer.stages, named, strict=True))]
    cid = await trio.to_thread.run_sync(store.add_bytes, manifest_bytes(entries))
    logger.info("%s: checkpoint at step %d: stage %d stored, manifest %s", run.log_prefix, trainer.step, stage, cid)
    return str(cid)


async def load_confirmed_stage(run: RunState, stage: int) -> None:
    """Load ``stage`` from the manifest of the latest confirmed checkpoint, which must be at this
    member's step (a joiner, a member that resumed or resynced, one moved to another stage): the
    manifest, then that stage's two files, each fetched by CID within what it can honestly take
    (before the first record: from the run's initial model, which this member stored at its start).
    :class:`TrainerError` naming why not (the span then resyncs)."""
    trainer, book = run.require()
    assert isinstance(trainer, StagedTrainer)
    if not book.chain.records and trainer.step == 0:  # the run's first step: its initial model
        try:
            initial = await run.content.read(run.initial_cid, max_bytes=trainer.state_limits()[0],
                                             timeout=FETCH_TIMEOUT_S)
            await trio.to_thread.run_sync(trainer.load_initial_stage, stage, initial)
        except (ContentUnavailable, RecordError) as exc:
            raise TrainerError(f"could not load stage {stage} of the initial model: {exc}") from None
        return
    if not book.chain.records or book.head_step != trainer.step:
        raise TrainerError(f"holds no stage {stage} at step {trainer.step}, and the latest confirmed checkpoint "
                           f"is at step {book.head_step}")
    record = book.chain.records[-1].record
    content = run.content
    try:
        entries = read_manifest(await content.read(record.model_cid, max_bytes=MAX_MANIFEST_BYTES,
                                                   timeout=FETCH_TIMEOUT_S))
        if len(entries) != len(trainer.stages):
            raise ManifestError(f"it names {len(entries)} stages, the task {len(trainer.stages)}")
        max_model, max_optim = trainer.state_limits()
        entry = entries[stage]
        model = await content.read(entry.model, max_bytes=max_model, timeout=FETCH_TIMEOUT_S)
        optim = await content.read(entry.optimizer, max_bytes=max_optim, timeout=FETCH_TIMEOUT_S)
        await trio.to_thread.run_sync(trainer.load_stage, stage, model, optim, record.step)
    except (ContentUnavailable, ManifestError, RecordError) as exc:
        raise TrainerError(f"could not load stage {stage} of model v{record.version}: {exc}") from None
    logger.info("%s: loaded stage %d of model v%d (step %d)", run.log_prefix, stage, record.version, record.step)
