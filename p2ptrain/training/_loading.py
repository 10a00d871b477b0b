"""Load a published model by CID (or from a file) into a ready ``torch.nn.Module``.

A model file names its architecture in its safetensors metadata (the registry name and kwargs), so
a model CID alone is enough: the builder comes from p2ptrain's registry, never from the file.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from p2ptrain.base import UserError, default_home
from p2ptrain.ipfs import ContentStore, ContentUnavailable, not_a_cid, open_store, parse_cid
from p2ptrain.models import ModelError, build_model, meta_model, whole_model_cap
from p2ptrain.protocol import RecordError, load_model_bytes, read_model_card, read_tensors
from p2ptrain.task import USER_MODEL
from p2ptrain.training._stage_files import model_file


class NoBuilder(UserError):
    """A model trained from a user's own module: only the user's script can build it (no code
    crosses the network), so it loads into the user's instance, not from its file alone."""


def no_builder(card: dict[str, object]) -> NoBuilder:
    kwargs = card.get("kwargs")
    architecture = kwargs.get("architecture") if isinstance(kwargs, dict) else None
    return NoBuilder(f"this model was trained from a user's own module (architecture card {architecture}): p2ptrain "
                     "has no builder for it; load it into your instance with p2ptrain.load_state(model, CID), or "
                     "serve it with p2ptrain.serve(CID, model=instance)")


def describe_model_file(data: bytes) -> tuple[dict[str, object], int]:
    """The card of a model file and how many numbers its tensors hold; :class:`RecordError` for a
    file that is not a p2ptrain model. A registry model is built and loaded (the file must fit its
    architecture); a user's model is only read (its architecture is the user's script)."""
    card = read_model_card(data)
    if card is None:
        raise RecordError("the model file names no architecture (no p2ptrain.model metadata)")
    if card["name"] == USER_MODEL:
        return card, sum(t.numel() for t in read_tensors(data).values())
    return card, sum(p.numel() for p in model_from_bytes(data).parameters())


def model_from_bytes(data: bytes) -> nn.Module:
    """Build the architecture named in ``data``'s card and load the weights into it (eval mode).

    Raises :class:`RecordError` for any file that is not such a model (the one declared error), and
    :class:`NoBuilder` for a model of a user's own module.
    """
    card = read_model_card(data)
    if card is None:
        raise RecordError("the model file names no architecture (no p2ptrain.model metadata)")
    if card["name"] == USER_MODEL:
        raise no_builder(card)
    name, kwargs = card["name"], card["kwargs"]
    try:
        # Up to a pipelined run's whole model (a manifest's stages made one file), but never more
        # numbers than the file holds: a few bytes whose card names a large model allocate nothing.
        need = sum(t.numel() * t.element_size() for t in meta_model(name, kwargs).state_dict().values())
        if need > len(data):
            raise RecordError(f"the model file's {len(data):,} B cannot hold the {need:,} B of weights its card's "
                              f"{name} has")
        module = build_model(name, kwargs, seed=0, cap=whole_model_cap(name))  # the cap checked there
    except ModelError as exc:  # the card names a model we would not build: the file is at fault
        raise RecordError(f"the model file's card: {exc}") from None
    load_model_bytes(module, data)
    return module.eval()


def load_model(cid_or_path: str | Path, *, home: Path | None = None, store: ContentStore | None = None) -> nn.Module:
    """The model at a path, or by CID from a node home's store (``~/.p2ptrain`` by default).

    Every byte read by CID is verified against it. The CID of a pipelined run's model names a
    manifest of stage files: they are assembled into the whole model. A CID the store does not hold raises
    :class:`ContentUnavailable` saying how to fetch it (``p2ptrain.load_model(cid, bootstrap=...)``).
    """
    path = Path(cid_or_path)
    if path.exists():
        return model_from_bytes(path.read_bytes())
    cid = str(cid_or_path)
    try:
        parse_cid(cid)
    except Exception:
        raise FileNotFoundError(f"{cid}: no such file, and {not_a_cid(cid)}") from None
    if store is None:
        store = open_store(home or default_home())
    if not store.has(cid):
        # It said "fetch it first: p2ptrain model fetch CID", a command that needs -o and a way to the mesh.
        raise ContentUnavailable(cid, "not in the local store: p2ptrain.load_model(cid, bootstrap=[MULTIADDR]) "
                                 f"fetches it through a peer of the mesh (p2ptrain model fetch {cid} -o FILE "
                                 "--bootstrap MULTIADDR on the command line)")
    # No model the registry builds is larger; a pipelined run's manifest is assembled from its stages.
    return model_from_bytes(model_file(store, cid))
