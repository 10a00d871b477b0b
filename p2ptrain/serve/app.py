"""The HTTP/JSON interface, as a plain ASGI application that hypercorn runs on trio.

``POST /predict`` {"inputs": [...]} -> {"outputs": [...], "model_cid": "..."}; ``GET /health``;
``GET /model``. The body is read with a bound (Content-Length checked before reading, the bytes
counted while reading), parsed by :func:`p2ptrain.serve.spec.parse_request`, and every problem with
a request is a 4xx with a one-line reason, counted by reason in ``GET /health``'s ``rejected``. A
client that goes away mid-request only ends its own request.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from p2ptrain.logs import count_rejection
from p2ptrain.serve.batcher import Batcher, Busy
from p2ptrain.serve.spec import MAX_BODY_BYTES, InputError, parse_request

logger = logging.getLogger(__name__)

# Bytes of request bodies being read at once, over all connections: each body is at most
# MAX_BODY_BYTES (8 MiB), and 32 such uploads at once (256 MiB) are all the memory bodies may hold; a
# request that would pass it is answered 503 before its body is read. Small requests never meet it.
MAX_BODY_BYTES_IN_FLIGHT = 256 * 1024 * 1024

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class _Refused(Exception):
    def __init__(self, status: int, reason: str, why: str) -> None:
        super().__init__(why)
        self.status, self.reason = status, reason


class ServeApp:
    """ASGI app over one :class:`Batcher`; ``rejected`` counts refused requests by reason."""

    def __init__(self, batcher: Batcher) -> None:
        self.batcher = batcher
        self.rejected: Counter[str] = Counter()
        self.reading = 0  # bytes of bodies being read now (MAX_BODY_BYTES_IN_FLIGHT)

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        try:
            status, doc = await self._route(scope, receive)
        except _Refused as refused:
            count_rejection(self.rejected, refused.reason, logger, logging.INFO, "refused a request: %s", refused)
            status, doc = refused.status, {"error": str(refused)}
        if status == 0:  # the client went away: nobody to answer
            return
        body = json.dumps(doc).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def _route(self, scope: dict[str, Any], receive: Receive) -> tuple[int, dict[str, Any]]:
        path, method = scope["path"], scope["method"]
        routes = {"/predict": "POST", "/health": "GET", "/model": "GET"}
        if path not in routes:
            raise _Refused(404, "not_found", f"no such path {path[:64]!r} (try POST /predict, GET /health, GET /model)")
        if method != routes[path]:
            raise _Refused(405, "method", f"{path} takes {routes[path]}")
        loaded = self.batcher.current
        if path == "/health":
            return 200, {"status": "ok", "model_cid": loaded.cid, "queued": self.batcher.queued,
                         "served": dict(self.batcher.counts), "rejected": dict(self.rejected)}
        if path == "/model":
            return 200, {"model_cid": loaded.cid, **loaded.info, "input": loaded.spec.describe()}
        body = await self._read_body(scope, receive)
        if body is None:
            self.rejected["disconnected"] += 1
            return 0, {}
        try:
            x = parse_request(body, loaded.spec)
        except InputError as exc:
            raise _Refused(400, "bad_input", str(exc)) from None
        try:
            outputs, cid = await self.batcher.predict(x)
        except Busy as exc:
            raise _Refused(503, "busy", str(exc)) from None
        except RuntimeError as exc:
            return 500, {"error": str(exc)}
        return 200, {"outputs": outputs.tolist(), "model_cid": cid}


    async def _read_body(self, scope: dict[str, Any], receive: Receive) -> bytes | None:
        """The request body, at most MAX_BODY_BYTES (else 413); None if the client disconnected.

        Its bytes count against MAX_BODY_BYTES_IN_FLIGHT while it is read (a declared length up front):
        past that, 503."""
        declared = 0
        for name, value in scope["headers"]:
            if name == b"content-length":
                if not value.isdigit() or int(value) > MAX_BODY_BYTES:
                    raise _Refused(413, "too_large", f"the body is over the {MAX_BODY_BYTES} B limit")
                declared = int(value)
        held = 0
        try:
            chunks, size = [], 0
            while True:
                if max(size, declared) > held:
                    if self.reading + max(size, declared) - held > MAX_BODY_BYTES_IN_FLIGHT:
                        raise _Refused(503, "busy", "too many request bodies are being read; retry")
                    self.reading += max(size, declared) - held
                    held = max(size, declared)
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise _Refused(413, "too_large", f"the body is over the {MAX_BODY_BYTES} B limit")
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
        finally:
            self.reading -= held


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
