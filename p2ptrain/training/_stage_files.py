"""A pipelined run's model assembled from the stage files its manifest names
(:mod:`p2ptrain.training._stage_manifest`).

A member of a pipelined run holds one stage, so its checkpoint is one file per stage and the model
CID of a record names a manifest of those files. Whoever is not a member (``model fetch``,
``load_model``, ``model eval``, ``model serve``) fetches every stage's file and assembles the whole
model, whose bytes are exactly those a data-parallel checkpoint of the same weights has
(:func:`p2ptrain.protocol.state_bytes`), so everything downstream of the bytes is unchanged.

Nothing in a manifest is trusted: its stages must tile the pieces of the architecture their files'
card names, each file must hold exactly its pieces' tensors (names, and the count the manifest
says), every file the same card, each file no more bytes than one member's model file
(``MAX_MODEL_FILE_BYTES``: a stage is what one member holds), and the files together no more than
an honest file of that architecture takes, which may be larger than one member's model (a
pipelined run's, up to ``MAX_PIPELINED_PARAMETERS``: ``models.whole_model_cap``).
"""

from __future__ import annotations

import torch

from p2ptrain.ipfs import ContentStore
from p2ptrain.models import (check_model, file_bytes_bound, HEADER_SLACK, MAX_MODEL_FILE_BYTES, ModelError, meta_model,
                             PartitionError, pieces_of, whole_model_cap)
from p2ptrain.protocol import read_model_card, read_tensors, RecordError, state_bytes
from p2ptrain.training._stage_manifest import is_manifest, ManifestError, read_manifest


def model_file(store: ContentStore, cid: str, max_bytes: int | None = None) -> bytes:
    """The whole model's file of ``cid``: the model file itself (within ``max_bytes``, by default
    one member's model file), or the one assembled from the stage files a manifest names (all in
    ``store``; each verified against its CID as it is read; each within one member's model file,
    together within what their architecture takes and ``max_bytes`` when given). Raises
    :class:`RecordError` for a manifest or files that do not make one model, :class:`FileTooLarge`
    over a bound and :class:`ContentUnavailable` for a stage file the store lacks."""
    data = store.cat(cid, max_bytes=MAX_MODEL_FILE_BYTES if max_bytes is None else max_bytes)
    if not is_manifest(data):
        return data
    try:
        stages = read_manifest(data)
    except ManifestError as exc:
        raise RecordError(str(exc)) from None
    cap = None if max_bytes is None else max_bytes - len(data)  # the caller's, for the files together
    budget = MAX_MODEL_FILE_BYTES if cap is None else min(cap, MAX_MODEL_FILE_BYTES)  # until a card names the model
    tensors: dict[str, torch.Tensor] = {}
    card: dict[str, object] | None = None
    names: list[set[str]] = []
    for i, stage in enumerate(stages):
        part = store.cat(stage.model, max_bytes=max(min(budget, MAX_MODEL_FILE_BYTES), 0))
        budget -= len(part)
        part_card = read_model_card(part)
        if part_card is None or (card is not None and part_card != card):
            raise RecordError(f"stage {i}'s file has {'no' if part_card is None else 'another'} model card")
        if card is None:
            card = part_card
            names, limit = _architecture(card, len(stages))
            budget = (limit if cap is None else min(limit, cap)) - len(part)
            if stages[-1].last != len(names) - 1:
                raise RecordError(f"the manifest's stages cover {stages[-1].last + 1} pieces; the model has {len(names)}")
        own = read_tensors(part)
        want = set().union(*names[stage.first : stage.last + 1])
        if set(own) != want:
            raise RecordError(f"stage {i}'s file does not hold exactly the tensors of pieces {stage.first}..{stage.last}")
        if sum(t.numel() for t in own.values()) != stage.parameters:
            raise RecordError(f"stage {i}'s file holds another count of numbers than the manifest says")
        tensors.update(own)
    return state_bytes(tensors, card)


def _architecture(card: dict[str, object], files: int) -> tuple[list[set[str]], int]:
    """The state dict names of each piece of the architecture ``card`` names (built on the meta
    device: nothing allocated), and the most bytes ``files`` stage files of it honestly take (its
    tensors once, a header each)."""
    name, kwargs = card["name"], card["kwargs"]
    assert isinstance(name, str) and isinstance(kwargs, dict)  # read_model_card checked
    try:
        check_model(name, kwargs, whole_model_cap(name))
        model = meta_model(name, kwargs)
        pieces = pieces_of(model)
    except (ModelError, PartitionError) as exc:
        raise RecordError(f"the stage files' card names no model that is cut into stages: {exc}") from None
    limit = file_bytes_bound(model.state_dict().values()) + files * HEADER_SLACK
    return [set(piece.state_names()) for piece in pieces], limit
