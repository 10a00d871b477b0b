"""The manifest a pipelined run's model CID names: one entry per stage, its pieces and its files.

Canonical JSON ``{"format": "p2ptrain.stages/1", "stages": [{"first": i, "last": j, "model": CID,
"optimizer": CID, "parameters": n}, ...]}``: the stages in order, each the pieces ``first..last``
(inclusive) of the model, its model file (the stage's tensors under their names in the whole model,
with the whole model's card) and its optimizer file by CID, and how many numbers the model file's
tensors hold. Bounded JSON of this exact shape in canonical form (one manifest, one CID), or a
:class:`ManifestError`. No torch here: fetch paths that only look for stage files to fetch (``ipfs
get``) import nothing heavy; :mod:`p2ptrain.training._stage_files` reads the files.

A manifest cannot be mistaken for a model file: safetensors bytes start with their header's length,
which these bytes would make 8.4e18.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from p2ptrain.base import boundedjson
from p2ptrain.ipfs import ContentStore, ContentUnavailable, FileTooLarge, parse_cid
from p2ptrain.task import MAX_STAGES


class ManifestError(ValueError):
    """Bytes that are not a stage manifest (the one error of this module)."""


FORMAT = "p2ptrain.stages/1"
# What every manifest's bytes start with (canonical JSON sorts "format" before "stages").
_PREFIX = b'{"format":"' + FORMAT.encode() + b'"'
# A manifest of MAX_STAGES stages is about 14 KB; nothing larger is read as one.
MAX_MANIFEST_BYTES = 64 * 1024


@dataclass(frozen=True)
class StageFile:
    """One stage's checkpoint: pieces ``first..last`` (inclusive), its model and optimizer files by
    CID, and how many numbers the model file's tensors hold."""

    first: int
    last: int
    model: str
    optimizer: str
    parameters: int


def manifest_bytes(stages: Sequence[StageFile]) -> bytes:
    """The canonical bytes of the manifest of ``stages`` (in order): the same stages, the same CID."""
    body = {"format": FORMAT, "stages": [
        {"first": s.first, "last": s.last, "model": s.model, "optimizer": s.optimizer, "parameters": s.parameters}
        for s in stages]}
    return boundedjson.canonical(body)


def is_manifest(data: bytes) -> bool:
    """Whether ``data`` is a stage manifest's bytes (and so not a model file)."""
    return data.startswith(_PREFIX)


def read_manifest(data: bytes) -> tuple[StageFile, ...]:
    """The stages of a manifest; :class:`ManifestError` for anything that is not one of the shape above
    (the pieces are checked against the architecture when the files are read)."""
    try:
        body = boundedjson.loads(data, max_bytes=MAX_MANIFEST_BYTES, max_depth=3, what="stage manifest")
    except boundedjson.JSONBoundsError as exc:
        raise ManifestError(str(exc)) from None
    if not isinstance(body, dict) or set(body) != {"format", "stages"} or body["format"] != FORMAT:
        raise ManifestError(f"a stage manifest is an object of format {FORMAT!r} and stages")
    raw = body["stages"]
    if not isinstance(raw, list) or not 2 <= len(raw) <= MAX_STAGES:
        raise ManifestError(f"a stage manifest names 2 to {MAX_STAGES} stages")
    stages: list[StageFile] = []
    keys = {"first", "last", "model", "optimizer", "parameters"}
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
        stages.append(StageFile(first, last, entry["model"], entry["optimizer"], count))
    if manifest_bytes(stages) != bytes(data):
        raise ManifestError("a stage manifest must be in canonical form")  # one manifest, one CID
    return tuple(stages)


def stage_file_cids(store: ContentStore, cid: str) -> list[str]:
    """The stage model files of ``cid`` when it is a manifest the store holds, else none (a model
    file, or content this cannot tell: the loader that reads it says what it is)."""
    try:
        data = store.cat(cid, max_bytes=MAX_MANIFEST_BYTES)
    except (FileTooLarge, ContentUnavailable):
        return []
    if not is_manifest(data):
        return []
    try:
        return [stage.model for stage in read_manifest(data)]
    except ManifestError:
        return []
