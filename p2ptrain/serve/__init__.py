"""Serving trained models by CID over HTTP/JSON, batched (``p2ptrain model serve``); see docs/serving.md.

``spec``: what a sample must look like; ``batcher``: dynamic batching and head swaps; ``app``: the
ASGI app; ``server``: hypercorn on trio around them; ``api``: serving from Python; ``client``:
``predict`` (stdlib only).

``p2ptrain.serve`` is this package and also the function ``p2ptrain.serve(model_cid, ...)``: the
module is callable (its class is swapped for one with ``__call__``), because importing any submodule
binds the name ``serve`` on ``p2ptrain`` to the package, which would otherwise hide a function of
that name. The server's parts (torch, trio, hypercorn) are imported on first use, so the client
stays light.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from p2ptrain.serve.client import ServeError, predict

__all__ = ["ServeError", "Server", "open_model", "predict", "serve"]


def serve(model_cid: str | None = None, **options: Any) -> None:
    """Serve ``model_cid`` (or ``latest=TASK_CID``) over HTTP until interrupted: :func:`p2ptrain.serve.api.serve`."""
    from p2ptrain.serve.api import serve as run

    run(model_cid, **options)


def __getattr__(name: str) -> Any:
    if name in ("Server", "open_model"):
        from p2ptrain.serve import api

        return getattr(api, name)
    raise AttributeError(f"module 'p2ptrain.serve' has no attribute {name!r}")


class _CallablePackage(types.ModuleType):
    def __call__(self, model_cid: str | None = None, **options: Any) -> None:
        serve(model_cid, **options)


sys.modules[__name__].__class__ = _CallablePackage
