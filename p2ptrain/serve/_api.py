"""``p2ptrain.serve(cid)``: serve a model by CID from Python (the client is :mod:`p2ptrain.serve._client`).

``serve(cid)`` blocks and serves until interrupted, like ``p2ptrain model serve``. The model must be in
the home's store or fetchable through the home's running node (the CLI can also start a temporary
node with ``--bootstrap``). Inside a trio program, build a :class:`~p2ptrain.serve.Server`
with :func:`open_model` and ``await nursery.start(server.run)`` instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import trio
from torch import nn

from p2ptrain.base import ArgumentError, UserError
from p2ptrain.serve._batcher import Loaded
from p2ptrain.serve._server import LATEST_POLL_S, Server, load_served, resolve_device
from p2ptrain.serve._input_spec import UserModel

def via_node(home: Path, cid: str | None = None, latest: str | None = None) -> str:
    """Make ``cid`` (or ``latest``'s newest confirmed model) local through the home's store or its
    running node; return the CID."""
    from p2ptrain.ipfs import ContentUnavailable, open_store
    from p2ptrain.control import ControlClient, ops as control_ops, socket_path

    store = open_store(home)
    if cid is not None and latest is None and store.has(cid):
        return cid
    if not socket_path(home).exists():
        raise ContentUnavailable(cid or f"latest model of {latest}",
                                 f"not in the store of {home} and no node runs there to fetch it")
    client = ControlClient(home, timeout=600.0)
    if latest is not None:
        status = client.call(control_ops.TASK_STATUS, task_cid=latest)
        cid = status.get("latest_model_cid")
        if not cid:
            raise UserError(f"task {latest} has no confirmed model yet (state: {status.get('state')})")
    client.call(control_ops.IPFS_FETCH, cid=cid, timeout=300.0)
    return str(cid)


def open_model(
    cid: str | None = None, *, latest: str | None = None, home: Path | None = None,
    resolve: Callable[[], str] | None = None, device: str = "auto", model: nn.Module | None = None,
    input_shape: Sequence[int] | None = None, **options: Any,
) -> Server:
    """A :class:`Server` for model ``cid`` (or ``latest=TASK_CID``, followed), not yet running.

    A model trained from the user's own module (``p2ptrain.Optimizer``, ``p2ptrain.train``) has no
    builder in p2ptrain: give the instance as ``model`` (its weights are not used; each model served
    loads into a copy) and one sample's ``input_shape``.

    ``resolve`` makes the model local and returns its CID (default: :func:`via_node`); with
    ``latest`` it is called again every ``LATEST_POLL_S`` and a new CID is swapped in.
    """
    from p2ptrain.base import default_home
    from p2ptrain.ipfs import open_store

    if (cid is None) == (latest is None):
        raise ArgumentError("give a model's CID or {latest:TASK_CID} (one of them)")
    home = (home or default_home()).expanduser()
    resolve = resolve or (lambda: via_node(home, cid, latest))
    store = open_store(home)
    user_model = None
    if model is not None:
        if input_shape is None:
            raise UserError("serving your own module needs input_shape=(one sample's shape), e.g. (1, 28, 28)")
        user_model = UserModel(model, tuple(input_shape))
    loaded = load_served(store, resolve(), resolve_device(device), home, user_model)
    return Server(loaded, follow=resolve if latest else None, store=store, home=home, user_model=user_model,
                  **options)


def serve(model_cid: str | None = None, **options: Any) -> None:
    """Serve ``model_cid`` (or ``latest=TASK_CID``) over HTTP until interrupted.

    Options: ``model`` and ``input_shape`` (a model of your own module), ``home``, ``listen``
    ("127.0.0.1:8080"), ``max_batch`` (64), ``max_wait_ms`` (5),
    ``max_connections`` (256), ``device`` ("auto"), ``on_ready`` (called with the URL once listening).
    """
    on_ready: Callable[[str], None] = options.pop("on_ready", None) or (lambda url: None)
    server = open_model(model_cid, **options)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            on_ready(await nursery.start(server.run))

    trio.run(main)


__all__ = ["LATEST_POLL_S", "Loaded", "Server", "open_model", "serve", "via_node"]
