"""Serving trained models by CID over HTTP/JSON, batched (``p2ptrain model serve``); see docs/serving.md.

Inside: what a sample must look like (the input spec, from the model card), dynamic batching and
head swaps, the ASGI app, hypercorn on trio around them with a connection cap, ``--latest`` through
a temporary node, serving from Python (:class:`Server`, :func:`open_model`), and :func:`predict`
(the client, stdlib only). Imports ``services`` and everything below it.

``p2ptrain.serve`` is this package and also the function ``p2ptrain.serve(model_cid, ...)``: the
module is callable (its class is swapped for one with ``__call__``), because importing any submodule
binds the name ``serve`` on ``p2ptrain`` to the package, which would otherwise hide a function of
that name. The server's parts (torch, trio, hypercorn) are imported on first use, so the client
stays light.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

from p2ptrain.serve._client import ServeError as ServeError, predict as predict

if TYPE_CHECKING:
    from p2ptrain.serve._api import open_model as open_model
    from p2ptrain.serve._connection_limits import MAX_CONNECTIONS as MAX_CONNECTIONS
    from p2ptrain.serve._server import Server as Server
    from p2ptrain.serve._temporary import TemporaryFollower as TemporaryFollower
else:
    from p2ptrain._exports import lazy_exports

    __getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
    __all__ = sorted([*__all__, "ServeError", "predict", "serve"])


def serve(model_cid: str | None = None, **options: Any) -> None:
    """Serve ``model_cid`` (or ``latest=TASK_CID``) over HTTP until interrupted: :func:`p2ptrain.serve._api.serve`."""
    from p2ptrain.serve._api import serve as run

    run(model_cid, **options)


class _CallablePackage(types.ModuleType):
    def __call__(self, model_cid: str | None = None, **options: Any) -> None:
        serve(model_cid, **options)


sys.modules[__name__].__class__ = _CallablePackage
