"""What ``repo gc`` must keep of the runs a home took part in: the roots each task still needs.

A run keeps its confirmed chain in ``tasks/<task CID>/chain.jsonl``; the task file, its dataset and
initial model, and every model and optimizer state the chain names must outlive a collection.
"""

from __future__ import annotations

from pathlib import Path

from p2ptrain.base import UserError
from p2ptrain.ipfs import ContentStore, ContentUnavailable, DagError, InvalidCID, parse_cid


class RunStateError(UserError):
    """A task's state under the home cannot be read, so what it needs is unknown (``repo gc`` stops)."""


def run_state_roots(home: Path, store: ContentStore) -> dict[str, list[str]]:
    """The CIDs each task this home took part in still needs, by task CID: the task file, its
    dataset (manifest and every shard) and initial model, every confirmed model and optimizer state
    in ``tasks/<task CID>/chain.jsonl`` (where :class:`TaskRun` keeps them) and the chain's own CID.

    What ``repo gc`` must keep besides pins. Content the store does not hold is listed if named, not
    fetched. Raises :class:`RunStateError` for state that cannot be read: a collection that cannot
    tell what a run needs must not delete anything.
    """
    tasks_dir = Path(home) / "tasks"
    runs = [d for d in sorted(tasks_dir.iterdir()) if _named_by_cid(d)] if tasks_dir.is_dir() else []
    roots: dict[str, list[str]] = {}
    if not runs:
        return roots
    # Reading a run (its task builds the model on the meta device, its chain's records) imports torch
    # and libp2p, seconds of start-up: only for a home that has runs.
    from p2ptrain.data import ManifestError
    from p2ptrain.protocol import RecordError

    for run_dir in runs:
        try:
            roots[run_dir.name] = _run_roots(run_dir, store)
        except (UserError, ManifestError, RecordError, DagError, ContentUnavailable, OSError) as exc:
            raise RunStateError(f"cannot tell what task {run_dir.name} needs ({run_dir}): {exc}") from None
    return roots


def _named_by_cid(run_dir: Path) -> bool:
    """Whether ``run_dir`` is a run's folder: TaskRun names them by task CID."""
    try:
        parse_cid(run_dir.name)
    except InvalidCID:
        return False
    return True


def _run_roots(run_dir: Path, store: ContentStore) -> list[str]:
    from p2ptrain.data import MAX_MANIFEST_BYTES, Manifest
    from p2ptrain.protocol import MAX_CHAIN_BYTES, RecordError, chain_lines, entry_from_bytes
    from p2ptrain.task import MAX_TASK_BYTES, read_task

    task_cid = run_dir.name
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
    chain_file = run_dir / "chain.jsonl"
    if chain_file.exists():
        with open(chain_file, "rb") as f:
            data = f.read(MAX_CHAIN_BYTES + 1)  # the one limit on a chain's bytes, on disk or fetched
        if len(data) > MAX_CHAIN_BYTES:
            raise RecordError(f"chain.jsonl is over {MAX_CHAIN_BYTES} bytes")
        for line in chain_lines(data):
            record = entry_from_bytes(line).signed.record
            cids += [record.model_cid, record.optimizer_cid]
        cids.append(store.add_bytes(data, only_hash=True))  # the chain's CID, as TaskRun stores it
    return cids
