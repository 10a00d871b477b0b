"""Serving trained models by CID over HTTP/JSON, batched (``p2ptrain model serve``); see docs/serving.md.

``spec``: what a sample must look like; ``batcher``: dynamic batching and head swaps; ``app``: the
ASGI app; ``server``: hypercorn on trio around them; ``api``: serving from Python and the client.

``p2ptrain.serve`` is this package and also the function ``p2ptrain.serve(model_cid, ...)``: the
module is callable (its class is swapped for one with ``__call__``), because importing any submodule
binds the name ``serve`` on ``p2ptrain`` to the package, which would otherwise hide a function of
that name.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from p2ptrain.serve.api import ServeError, Server, open_model, predict, serve

__all__ = ["ServeError", "Server", "open_model", "predict", "serve"]


class _CallablePackage(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> None:
        serve(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
