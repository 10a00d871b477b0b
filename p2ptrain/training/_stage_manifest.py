"""The manifest a pipelined run's model CID names: one entry per stage, its pieces, its files and
the signatures that make them the stage's.

Canonical JSON ``{"format": "p2ptrain.stages/2", "stages": [{"first": i, "last": j, "model": CID,
"optimizer": CID, "parameters": n, "replicas": [peer, ...], "signatures": {peer: signature}}, ...]}``:
the stages in order, each the pieces ``first..last`` (inclusive) of the model, its model file (the
stage's tensors under their names in the whole model, with the whole model's card) and its optimizer
file by CID, how many numbers the model file's tensors hold, the stage's replicas in the span's plan
and the signed statements (:class:`~p2ptrain.wire.StageStatement`) of a quorum of them that these
are their stage's files (issue 31: :func:`check_stage_signatures`). Bounded JSON of this exact shape
in canonical form (one manifest, one CID), or a :class:`ManifestError`. No torch here: fetch paths
that only look for stage files to fetch (``ipfs get``) import nothing heavy;
:mod:`p2ptrain.training._stage_files` reads the files.

A manifest cannot be mistaken for a model file: safetensors bytes start with their header's length,
which these bytes would make 8.4e18.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from p2ptrain.base import boundedjson
from p2ptrain.ipfs import ContentStore, ContentUnavailable, FileTooLarge, parse_cid
from p2ptrain.protocol import signed_entry_problem
from p2ptrain.task import MAX_STAGES
from p2ptrain.wire import ModelRecord


class ManifestError(ValueError):
    """Bytes that are not a stage manifest (the one error of this module)."""


FORMAT = "p2ptrain.stages/2"  # 1 had no replicas nor signatures: its entries proved nothing
# What every manifest's bytes start with, of any version (canonical JSON sorts "format" first).
_PREFIX = b'{"format":"p2ptrain.stages/'
# A run's 1,024 members (a record's bound) listed once and a quorum of each stage's signatures is
# about 160 KB; nothing larger is read as one.
MAX_MANIFEST_BYTES = 256 * 1024
MAX_MEMBERS = 1024


@dataclass(frozen=True)
class StageFile:
    """One stage's checkpoint: pieces ``first..last`` (inclusive), its model and optimizer files by
    CID, how many numbers the model file's tensors hold, the stage's planned replicas and the
    (replica, signature) of those that signed these files (none: an entry nobody vouches for, which
    only a test or a local assembly makes)."""

    first: int
    last: int
    model: str
    optimizer: str
    parameters: int
    replicas: tuple[str, ...] = ()
    signatures: tuple[tuple[str, str], ...] = ()


def manifest_bytes(stages: Sequence[StageFile]) -> bytes:
    """The canonical bytes of the manifest of ``stages`` (in order): the same stages, the same CID."""
    body = {"format": FORMAT, "stages": [
        {"first": s.first, "last": s.last, "model": s.model, "optimizer": s.optimizer, "parameters": s.parameters,
         "replicas": list(s.replicas), "signatures": dict(s.signatures)}
        for s in stages]}
    return boundedjson.canonical(body)


def is_manifest(data: bytes) -> bool:
    """Whether ``data`` is a stage manifest's bytes (and so not a model file)."""
    return data.startswith(_PREFIX)


def read_manifest(data: bytes) -> tuple[StageFile, ...]:
    """The stages of a manifest; :class:`ManifestError` for anything that is not one of the shape above
    (the pieces are checked against the architecture when the files are read)."""
    try:
        body = boundedjson.loads(data, max_bytes=MAX_MANIFEST_BYTES, max_depth=4, what="stage manifest")
    except boundedjson.JSONBoundsError as exc:
        raise ManifestError(str(exc)) from None
    if not isinstance(body, dict) or set(body) != {"format", "stages"} or body["format"] != FORMAT:
        raise ManifestError(f"a stage manifest is an object of format {FORMAT!r} and stages")
    raw = body["stages"]
    if not isinstance(raw, list) or not 2 <= len(raw) <= MAX_STAGES:
        raise ManifestError(f"a stage manifest names 2 to {MAX_STAGES} stages")
    stages: list[StageFile] = []
    keys = {"first", "last", "model", "optimizer", "parameters", "replicas", "signatures"}
    members = 0
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict) or set(entry) != keys:
            raise ManifestError(f"stage {i} of the manifest must have exactly {sorted(keys)}")
        first, last, count = entry["first"], entry["last"], entry["parameters"]
        if not all(type(v) is int for v in (first, last, count)) or count < 0:
            raise ManifestError(f"stage {i} of the manifest: first, last and parameters are integers >= 0")
        if first != (stages[-1].last + 1 if stages else 0) or last < first:
            raise ManifestError(f"stage {i} of the manifest covers pieces {first}..{last}: the stages must tile the "
                              "pieces in order")
        for key in ("model", "optimizer"):
            try:
                parse_cid(entry[key])
            except Exception:
                raise ManifestError(f"stage {i} of the manifest: {key} is not a CID") from None
        replicas, signatures = entry["replicas"], entry["signatures"]
        if (not isinstance(replicas, list) or not all(isinstance(r, str) and 0 < len(r) <= 128 for r in replicas)
                or not isinstance(signatures, dict)
                or not all(isinstance(v, str) and len(v) <= 128 and len(k) <= 128 for k, v in signatures.items())):
            raise ManifestError(f"stage {i} of the manifest: replicas are a list of peer IDs, signatures an object "
                                "of peer ID to signature")
        members += len(replicas)
        if members > MAX_MEMBERS or len(signatures) > len(replicas):
            raise ManifestError(f"the manifest names more than {MAX_MEMBERS} replicas, or a stage more signatures "
                                "than replicas")
        stages.append(StageFile(first, last, entry["model"], entry["optimizer"], count, tuple(replicas),
                                tuple(sorted(signatures.items()))))
    if manifest_bytes(stages) != bytes(data):
        raise ManifestError("a stage manifest must be in canonical form")  # one manifest, one CID
    return tuple(stages)


def check_stage_signatures(stages: Sequence[StageFile], record: ModelRecord) -> None:
    """Raise :class:`ManifestError` unless every entry of ``record``'s manifest is backed by the
    signatures of a quorum of its stage's replicas, at the record's step of its task, and the
    stages' replicas are exactly the record's members, each in one stage (so no stage's replicas
    are a subset the manifest picked). A quorum of the record's members attested these bytes, and
    a member computes its manifest from the plan's stages: the replicas are the plan's."""
    listed = [r for s in stages for r in s.replicas]
    if len(set(listed)) != len(listed) or set(listed) != set(record.members):
        raise ManifestError(f"the manifest's replicas are not the {len(record.members)} members of model "
                            f"v{record.version}, each in one stage")
    for i, s in enumerate(stages):
        problem = signed_entry_problem(record.task_cid, record.step, i, (s.model, s.optimizer), s.replicas,
                                       s.signatures)
        if problem is not None:
            raise ManifestError(problem)


def stage_signatures_problem(store: ContentStore, record: ModelRecord) -> str | None:
    """Why ``record``'s model, a stage manifest ``store`` holds, is not each stage's files as a
    quorum of its replicas signed them (:func:`check_stage_signatures`); None when it is, or when
    the model is no manifest (a model file: nothing to check here)."""
    data = _held_manifest(store, record.model_cid)
    if data is None:
        return None
    try:
        check_stage_signatures(read_manifest(data), record)
    except ManifestError as exc:
        return f"model {record.model_cid}: {exc}"
    return None


def stage_file_cids(store: ContentStore, cid: str, *, optimizer: bool = False) -> list[str]:
    """The stage model files of ``cid`` (with ``optimizer``, each stage's optimizer file after its
    model file) when it is a manifest the store holds, else none (a model file, or content this
    cannot tell: the loader that reads it says what it is)."""
    data = _held_manifest(store, cid)
    if data is None:
        return []
    try:
        stages = read_manifest(data)
    except ManifestError:
        return []
    return [file for s in stages for file in ((s.model, s.optimizer) if optimizer else (s.model,))]


def _held_manifest(store: ContentStore, cid: str) -> bytes | None:
    """The bytes of ``cid`` when it is a stage manifest ``store`` holds; None for a model file, or
    content this cannot tell (too large to be a manifest, not held)."""
    try:
        data = store.cat(cid, max_bytes=MAX_MANIFEST_BYTES)
    except (FileTooLarge, ContentUnavailable):
        return None
    return data if is_manifest(data) else None
