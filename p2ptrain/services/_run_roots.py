"""What ``repo gc`` must keep of the runs a home took part in: the roots each task still needs.

A run keeps its confirmed chain in ``tasks/<task CID>/chain.jsonl``; the task file, its dataset and
initial model, and every model and optimizer state the chain names must outlive a collection. A
pipelined run's record names a stage manifest (JSON, not a DAG that links its files), so the stage
files it names are roots too: this member's own stage and the copy it keeps of the next
(run/_stage_copies.py), whatever of them the store holds.
"""

from __future__ import annotations

from pathlib import Path

from p2ptrain.data import MAX_MANIFEST_BYTES, Manifest, ManifestError
from p2ptrain.base import UserError
from p2ptrain.ipfs import ContentStore, ContentUnavailable, DagError
from p2ptrain.protocol import RecordError, chain_lines, entry_from_bytes
from p2ptrain.run import RunDir
from p2ptrain.task import MAX_TASK_BYTES, read_task
from p2ptrain.training import stage_file_cids


class RunStateError(UserError):
    """A task's state under the home cannot be read, so what it needs is unknown (``repo gc`` stops)."""


def run_state_roots(home: Path, store: ContentStore) -> dict[str, list[str]]:
    """The CIDs each task this home took part in still needs, by task CID: the task file, its
    dataset (manifest and every shard) and initial model, every confirmed model and optimizer state
    in ``tasks/<task CID>/chain.jsonl`` (where :class:`TaskRun` keeps them; a pipelined run's: the
    stage files its manifests name) and the chain's own CID.

    What ``repo gc`` must keep besides pins. Content the store does not hold is listed if named, not
    fetched. Raises :class:`RunStateError` for state that cannot be read: a collection that cannot
    tell what a run needs must not delete anything.
    """
    roots: dict[str, list[str]] = {}
    for run_dir in RunDir.runs(home):
        try:
            roots[run_dir.task_cid] = _run_roots(run_dir, store)
        except (UserError, ManifestError, RecordError, DagError, ContentUnavailable, OSError) as exc:
            raise RunStateError(f"cannot tell what task {run_dir.task_cid} needs ({run_dir.path}): {exc}") from None
    return roots


def _run_roots(run_dir: RunDir, store: ContentStore) -> list[str]:
    task_cid = run_dir.task_cid
    cids = [task_cid]
    if store.has(task_cid):
        task = read_task(store.cat(task_cid, max_bytes=MAX_TASK_BYTES + 1))
        if task.initial_model:
            cids.append(task.initial_model)
        if task.model.architecture:
            cids.append(task.model.architecture)
        if task.dataset is not None:
            cids.append(task.dataset.manifest)
            if store.has(task.dataset.manifest):
                manifest = Manifest.from_json(store.cat(task.dataset.manifest, max_bytes=MAX_MANIFEST_BYTES + 1))
                cids.extend(ref.cid for shards in manifest.splits.values() for ref in shards)
    data = run_dir.read_chain()
    if data is not None:
        for line in chain_lines(data):
            record = entry_from_bytes(line).signed.record
            cids += [record.model_cid, record.optimizer_cid, *stage_file_cids(store, record.model_cid, optimizer=True)]
        cids.append(store.add_bytes(data, only_hash=True))  # the chain's CID, as TaskRun stores it
    return cids
