"""``p2ptrain.load_state(model, cid_or_path)``: a confirmed model's weights into the user's own instance;
and ``p2ptrain.load_model(cid, bootstrap=...)``: a registry model by CID, fetched through the mesh when the
store lacks it (training's ``load_model`` builds it; the fetch paths live here, above training).

A run of the user's own module publishes safetensors whose card names no builder (only the user's
script has the code), so the weights go into an instance the user built: the same class, the same
shapes. Every byte read by CID is verified against the CID by the store; the file must then fit the
instance exactly (every parameter and buffer, by name, shape and dtype), or nothing is loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from torch import nn

from p2ptrain.api._arguments import address_list
from p2ptrain.base import UserError, default_home
from p2ptrain.ipfs import ContentStore, FileTooLarge, not_a_cid, open_store, parse_cid
from p2ptrain.models import file_bytes_bound
from p2ptrain.protocol import RecordError, load_model_bytes
from p2ptrain.training import load_model as build_loaded

__all__ = ["load_model", "load_state"]


def load_model(cid_or_path: str | Path, *, home: str | Path | None = None, store: ContentStore | None = None,
               bootstrap: Sequence[str] = ()) -> nn.Module:
    """:func:`p2ptrain.training.load_model`, and with ``bootstrap`` addresses a CID the home's store
    lacks is first fetched, as :func:`load_state` fetches it: through the home's running node, else
    through a temporary node that joins the mesh by ``bootstrap`` (a fresh machine needs no node of
    its own). With no ``home`` (nor ``store``) it is the first of ``~/.p2ptrain`` and the runs' homes
    under it that holds the CID, as for :func:`load_state`. Without ``bootstrap`` a CID the store lacks raises
    :class:`~p2ptrain.ipfs.ContentUnavailable`, as before; a fetch that fails raises
    :class:`~p2ptrain.base.UserError` in one line.
    """
    where = Path(home).expanduser() if home is not None else None
    by_cid = not Path(cid_or_path).exists() and _is_cid(str(cid_or_path))
    if where is None and store is None and by_cid:
        from p2ptrain.services import home_holding

        where = home_holding(str(cid_or_path))  # it looked in ~/.p2ptrain alone, not where a script's run keeps it
    if bootstrap and by_cid:
        if store is not None:
            raise UserError("load_model: bootstrap fetches into a home's store; pass home=, not store=")
        from p2ptrain.services import ensure_local  # the fetch paths model fetch has

        where = where or default_home()
        ensure_local(where, [str(cid_or_path)], address_list("bootstrap", bootstrap))
    return build_loaded(cid_or_path, home=where, store=store)


def _is_cid(text: str) -> bool:
    try:
        parse_cid(text)
    except Exception:
        return False
    return True


def load_state(model: nn.Module, cid_or_path: str | Path, *, home: str | Path | None = None,
               bootstrap: Sequence[str] = ()) -> nn.Module:
    """Load the model file at a path, or the model ``cid_or_path`` from ``home``'s store, into ``model``.

    ``home``: the home the run used (``p2ptrain.Optimizer(home=...)``); by default the first of
    ``~/.p2ptrain`` and the runs' homes under it (``~/.p2ptrain/runs/<run>``) that holds the CID. A CID
    the store lacks is fetched through the home's running node, or with ``bootstrap`` addresses
    through a temporary node (as ``p2ptrain model fetch`` does). Returns ``model``. Raises
    :class:`~p2ptrain.base.UserError` in one line when the file cannot be had or does not fit
    ``model``; ``model`` is then unchanged.
    """
    path = Path(cid_or_path)
    if path.is_file():
        data = path.read_bytes()
    else:
        cid = str(cid_or_path)
        try:
            parse_cid(cid)
        except Exception:
            raise UserError(f"{cid}: no such file, and {not_a_cid(cid)}") from None
        from p2ptrain.services import ensure_local, home_holding  # the fetch paths model fetch has

        where = Path(home).expanduser() if home is not None else home_holding(cid)
        store = open_store(where)
        if not store.has(cid):
            ensure_local(where, [cid], address_list("bootstrap", bootstrap), runs_looked=home is None)
        # Verified against the CID block by block, and no larger than a file of the instance's tensors.
        try:
            data = store.cat(cid, max_bytes=file_bytes_bound(model.state_dict().values()))
        except FileTooLarge:
            raise UserError(f"{cid} is larger than a model file of this model: it does not fit it") from None
    state = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        load_model_bytes(model, data)
    except RecordError as exc:
        model.load_state_dict(state)  # a file that fit only in part leaves nothing behind
        raise UserError(f"{cid_or_path} does not fit this model: {exc}") from None
    return model
