"""A pipelined run's checkpoints: each stage's files, one manifest naming them all, and a stage
loaded by CID from the manifest of the run's latest confirmed checkpoint (docs/pipeline.md).

At the end of a span every member stores its stage's two files
(:meth:`~p2ptrain.run._stage_trainer.StagedTrainer.stage_files`; the replicas of a stage hold the
same bits, so the same CIDs) and signs its statement that they are its stage's
(:class:`~p2ptrain.wire.StageStatement`). One gather over the plan's members
(:meth:`~p2ptrain.collective.Collective.gather`: each slot its member's own, the same list on every
member, an equivocating member named; nobody's sum to steer) gives every member every statement,
and each stage's entry is what a quorum of *that stage's* planned replicas signed
(:func:`~p2ptrain.protocol.stage_verdicts`). The manifest carries each stage's replicas and their
signatures, so whoever reads the chain can check them (``check_stage_signatures``). Its CID is both
the model and the optimizer CID the member hands to the record and its attestation, as a
data-parallel member hands its files'. Records, attestations and tallies are those of any run.

A stage without such a quorum, or a failed gather, means no checkpoint this span (as a failed
buffer average in a data-parallel run). Whoever signed other files than its stage's quorum
(``stage_diverged``), signed for a stage the plan does not put it in, or put anything but its own
signed statement in the gather (``stage_statement``) is counted and named in the log, and what it
said counts for nothing: the checkpoint goes on when the quorums hold.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import torch
import trio
from libp2p.peer.id import ID

from p2ptrain.base import short_id
from p2ptrain.collective import CollectiveError
from p2ptrain.ipfs import ContentStore, ContentUnavailable
from p2ptrain.protocol import (buffers_round_id, check_statement, plan_cut, RecordError, sign_statement, stage_rings,
                               stage_verdicts, tensors_bytes)
from p2ptrain.protocol.signing import SignatureError
from p2ptrain.run._run_state import RunState
from p2ptrain.run._stage_trainer import StagedTrainer
from p2ptrain.run._step_window import StepWindow
from p2ptrain.training import (check_stage_signatures, ManifestError, manifest_bytes, MAX_MANIFEST_BYTES,
                               read_manifest, StageFile, TrainerError)
from p2ptrain.wire import (MAX_STATEMENT_BYTES, ModelRecord, read_statement, RoundPlan, SignedStageStatement,
                           statement_bytes, StatementError)

logger = logging.getLogger(__name__)

# Fetching a stage's manifest or files: each read is bounded in bytes too, so this only ends a
# transfer that stalls (the resync's bound).
FETCH_TIMEOUT_S = 60.0


async def store_stage_checkpoint(run: RunState, plan: RoundPlan, stage: int, window: StepWindow, *, timeout: float,
                                 start_timeout: float) -> str | None:
    """Store this member's stage files at the end of ``plan``, sign them as its stage's, learn every
    stage's from a quorum of its replicas and store the manifest: its CID (the record's model and
    optimizer CID), or None when the gather failed or a stage has no quorum (no checkpoint). The
    gather is left at once when a member reports the span's last round failed (``window``)."""
    trainer, _ = run.require()
    assert isinstance(trainer, StagedTrainer)
    store = run.content.store
    step = trainer.step
    model_data, optim_data = await trio.to_thread.run_sync(trainer.stage_files, stage)
    own = (str(await trio.to_thread.run_sync(store.add_bytes, model_data)),
           str(await trio.to_thread.run_sync(store.add_bytes, optim_data)))
    mine = sign_statement(run.task_cid, step, stage, own, run.node.key_pair)
    members = [ID.from_base58(m) for m in plan.members]
    try:
        async with window.checkpoint(plan):
            parts = await run.collective.gather(statement_bytes(mine), members, buffers_round_id(plan),
                                                max_bytes=MAX_STATEMENT_BYTES, check=lambda member, raw: None,
                                                timeout=timeout, start_timeout=start_timeout, joined=window.joined)
    except CollectiveError as exc:
        logger.warning("%s: gathering the stages' statements at step %d failed (%s); no checkpoint this span",
                       run.log_prefix, step, exc)
        return None
    verdicts, strangers = stage_verdicts(stage_rings(plan), _statements(run, plan, step, parts))
    for signer, why in strangers.items():
        run.refuse("stage_statement", f"at step {step} {short_id(signer)} {why}")
    for verdict in verdicts:
        # Other files than the stage's quorum signed; without a quorum, a replica of the stage
        # still knows its own files: it names those that signed others.
        agreed = verdict.cids if verdict.cids is not None else own if verdict.stage == stage else None
        if agreed is None:
            continue
        whose = "a quorum of its replicas" if verdict.cids is not None else "this member"
        for replica, cids in verdict.dissent.items():
            if cids != agreed:
                run.refuse("stage_diverged", f"at step {step} {short_id(replica)} signed other files for stage "
                           f"{verdict.stage} ({cids[0]}) than {whose} ({agreed[0]})")
    missing = [v for v in verdicts if v.cids is None]
    if missing:
        v = missing[0]
        said = ", ".join(f"{short_id(r)}: {c[0]}" for r, c in v.dissent.items()) or "none"
        logger.warning("%s: no checkpoint at step %d: no quorum of stage %d's %d replicas signed the same files "
                       "(signed: %s; no statement: %s)", run.log_prefix, step, v.stage, len(v.replicas), said,
                       ", ".join(short_id(r) for r in v.silent) or "none")
        return None
    entries = []
    for i, (s, verdict) in enumerate(zip(trainer.stages, verdicts, strict=True)):
        assert verdict.cids is not None  # every stage has its quorum here
        cids, signatures = verdict.cids, verdict.signatures
        if i == stage and cids != own:
            # This member's stage differs from what a quorum of its replicas signed: it attests a
            # manifest of its own files (a differing attestation, as a member whose bits differ).
            run.refuse("stage_diverged", f"at step {step} this member's stage {stage} differs from what a "
                       "quorum of its replicas signed; attesting its own")
            cids, signatures = own, ((run.me, mine.signature),)
        entries.append(StageFile(s.first, s.last, cids[0], cids[1], trainer.stage_numbers(i), verdict.replicas,
                                 tuple(sorted(signatures))))
    cid = await trio.to_thread.run_sync(store.add_bytes, manifest_bytes(entries))
    logger.info("%s: checkpoint at step %d: stage %d stored, manifest %s", run.log_prefix, step, stage, cid)
    return str(cid)


def _statements(run: RunState, plan: RoundPlan, step: int, parts: list[bytes]) -> dict[str, SignedStageStatement]:
    """The gather's parts (in plan order) that are their member's own signed statement of this
    task and step; any other part is counted and named, and counts for nothing."""
    out = {}
    for member, raw in zip(plan.members, parts, strict=True):
        try:
            signed = read_statement(raw)
            statement = check_statement(signed, member)
            if (statement.task_cid, statement.step) != (run.task_cid, step):
                raise StatementError(f"it speaks of step {statement.step} of task {statement.task_cid}")
        except (StatementError, SignatureError) as exc:
            run.refuse("stage_statement", f"at step {step} {short_id(member)} put no statement of its own in the "
                       f"gather: {exc}")
            continue
        out[member] = signed
    return out


def initial_manifest(store: ContentStore, trainer: StagedTrainer, initial: bytes | None = None, *,
                     only_hash: bool = False, scratch: Path | None = None) -> str:
    """The CID of the run's initial model, the root of its chain: the manifest of every stage's
    files at step 0 (no replicas, no signatures: nobody trained them), made one stage at a time
    (``StagedTrainer.initial_stage_files``, each stage's file written in a folder under ``scratch``
    and hashed from there), so a member agrees on it without holding the whole model. Stored with
    its files when they are cut from ``initial`` (the task's ``initial_model``: members take their
    stage from them, :func:`load_confirmed_stage`); from the seed the files are only hashed, since
    every member makes its stage's again from the seed when it takes it. ``only_hash``: nothing is
    stored (``model verify``)."""
    keep = initial is not None and not only_hash
    optim = store.add_bytes(tensors_bytes({"trainer.step": torch.tensor(0, dtype=torch.int64)}), only_hash=not keep)
    entries = []
    with tempfile.TemporaryDirectory(prefix="initial-stages-", dir=scratch) as folder:
        for i, path in enumerate(trainer.initial_stage_files(Path(folder), initial)):
            model = store.add_file(path, only_hash=not keep)
            path.unlink()
            stage = trainer.stages[i]
            entries.append(StageFile(stage.first, stage.last, str(model), str(optim), trainer.stage_numbers(i)))
    return str(store.add_bytes(manifest_bytes(entries), only_hash=only_hash))


def take_plan_cut(run: RunState, plan: RoundPlan) -> bool:
    """Cut this member's model as ``plan`` cuts it (``[pipeline] balance = "recut"``:
    protocol/_recut.py); True when that moved its cut: it then holds no stage, and loads its plan's
    stage from the files of the confirmed checkpoint's stages that cover it (:func:`load_confirmed_stage`;
    its sparse residual goes too: run/_stage_sum.py keys it by the stage's pieces). A plan moves the
    cut only from the confirmed checkpoint of its step (a joiner's or a resumed member's trainer
    has the task's cut and follows any plan's from the checkpoint it holds); a member elsewhere
    cannot follow it: :class:`TrainerError` (it resyncs)."""
    trainer, book = run.require()
    assert isinstance(trainer, StagedTrainer) and run.task.pipeline is not None
    if not run.task.pipeline.recut or (cut := plan_cut(run.task, plan)) == (was := trainer.cut):
        return False
    if not trainer.step == plan.step == book.head_step:
        raise TrainerError(f"plan {plan.round}.{plan.attempt} cuts the model at {list(cut)} from step {plan.step}; "
                           f"this member is at step {trainer.step}, the latest confirmed checkpoint at {book.head_step}")
    trainer.recut(cut)
    logger.info("%s: the model is cut at %s from step %d (was %s)", run.log_prefix, list(cut), plan.step, list(was))
    return True


async def load_confirmed_stage(run: RunState, stage: int) -> None:
    """Load ``stage`` from the manifest of the latest confirmed checkpoint, which must be at this
    member's step (a joiner, a member that resumed or resynced, one moved to another stage): the
    manifest, then that stage's two files, each fetched by CID within what it can honestly take
    (before the first record: from the run's initial manifest, whose files this member stored at its
    start; a run from the seed never comes here at step 0: its members make any stage from the seed).
    :class:`TrainerError` naming why not (the span then resyncs)."""
    trainer, book = run.require()
    assert isinstance(trainer, StagedTrainer)
    if not book.chain.records and trainer.step == 0:  # the run's first step: its initial model's manifest
        try:
            parts = await fetch_stage_parts(run, trainer, run.initial_cid, stage)
            await trio.to_thread.run_sync(trainer.load_parts, stage, parts, 0)
        except (ContentUnavailable, ManifestError, RecordError) as exc:
            raise TrainerError(f"could not load stage {stage} of the initial model: {exc}") from None
        return
    if not book.chain.records or book.head_step != trainer.step:
        raise TrainerError(f"holds no stage {stage} at step {trainer.step}, and the latest confirmed checkpoint "
                           f"is at step {book.head_step}")
    record = book.chain.records[-1].record
    try:
        parts = await fetch_stage_parts(run, trainer, record.model_cid, stage, record)
        await trio.to_thread.run_sync(trainer.load_parts, stage, parts, record.step)
    except (ContentUnavailable, ManifestError, RecordError) as exc:
        raise TrainerError(f"could not load stage {stage} of model v{record.version}: {exc}") from None
    logger.info("%s: loaded stage %d of model v%d (step %d)", run.log_prefix, stage, record.version, record.step)


async def fetch_stage_files(run: RunState, trainer: StagedTrainer, manifest_cid: str, stage: int,
                            record: ModelRecord | None = None) -> tuple[bytes, bytes]:
    """The model and optimizer files of the manifest ``manifest_cid``'s entry ``stage``: the
    manifest, then the two files, each fetched by CID within what it can honestly take (with
    ``record``: the manifest's signatures checked against it first). :class:`ContentUnavailable`
    or :class:`ManifestError`."""
    entry = (await _entries(run, trainer, manifest_cid, record))[stage]
    return await _files(run, trainer, entry)


async def fetch_stage_parts(run: RunState, trainer: StagedTrainer, manifest_cid: str, stage: int,
                            record: ModelRecord | None = None) -> list[tuple[int, int, bytes, bytes]]:
    """The files of the manifest ``manifest_cid``'s entries that cover the pieces of this member's
    ``stage`` (as its trainer cuts the model now: the manifest's own cut, or a plan's new one), as
    ``(first, last, model file, optimizer file)`` for ``StagedTrainer.load_parts``; fetched as
    :func:`fetch_stage_files` fetches one entry's."""
    want = trainer.stages[stage]
    parts = []
    for entry in await _entries(run, trainer, manifest_cid, record):
        if entry.first <= want.last and want.first <= entry.last:
            parts.append((entry.first, entry.last, *await _files(run, trainer, entry)))
    return parts


async def _entries(run: RunState, trainer: StagedTrainer, manifest_cid: str,
                   record: ModelRecord | None) -> tuple[StageFile, ...]:
    entries = read_manifest(await run.content.read(manifest_cid, max_bytes=MAX_MANIFEST_BYTES, timeout=FETCH_TIMEOUT_S))
    problem = trainer.manifest_problem(entries)  # as StagedTrainer.load_manifest
    if problem is not None:
        raise ManifestError(f"its stages are not a cut of the task's pieces: {problem}")
    if record is not None:
        check_stage_signatures(entries, record)
    return entries


async def _files(run: RunState, trainer: StagedTrainer, entry: StageFile) -> tuple[bytes, bytes]:
    max_model, max_optim = trainer.part_limits(entry.first, entry.last)  # its pieces' (in range: _entries), not the model's
    return (await run.content.read(entry.model, max_bytes=max_model, timeout=FETCH_TIMEOUT_S),
            await run.content.read(entry.optimizer, max_bytes=max_optim, timeout=FETCH_TIMEOUT_S))
