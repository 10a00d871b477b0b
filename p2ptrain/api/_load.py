"""``p2ptrain.load_state(model, cid_or_path)``: a confirmed model's weights into the user's own instance.

A run of the user's own module publishes safetensors whose card names no builder (only the user's
script has the code), so the weights go into an instance the user built: the same class, the same
shapes. Every byte read by CID is verified against the CID by the store; the file must then fit the
instance exactly (every parameter and buffer, by name, shape and dtype), or nothing is loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from torch import nn

from p2ptrain.base import UserError, default_home
from p2ptrain.ipfs import FileTooLarge, open_store, parse_cid
from p2ptrain.models import file_bytes_bound
from p2ptrain.protocol import RecordError, load_model_bytes

__all__ = ["load_state"]


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
            raise UserError(f"{cid}: no such file, and not a CID") from None
        where = Path(home).expanduser() if home is not None else _home_holding(cid)
        store = open_store(where)
        if not store.has(cid):
            from p2ptrain.api._fetching import ensure_local  # the fetch paths model fetch has

            ensure_local(where, [cid], list(bootstrap))
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


# Run homes looked through for a CID when no home is given (one directory listing, bounded).
MAX_RUN_HOMES = 256


def _home_holding(cid: str) -> Path:
    """The default home, or the first run home under it (``Optimizer``'s default) holding ``cid``."""
    base = default_home()
    runs = base / "runs"
    candidates = [base] + (sorted(p for p in runs.iterdir() if p.is_dir())[:MAX_RUN_HOMES] if runs.is_dir() else [])
    for home in candidates:
        if (home / "blocks").is_dir() and open_store(home).has(cid):
            return home
    return base
