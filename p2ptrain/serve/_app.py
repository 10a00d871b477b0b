"""The HTTP/JSON interface, as a plain ASGI application that hypercorn runs on trio.

``POST /predict`` {"inputs": [...]} -> {"outputs": [...], "model_cid": "..."}; ``GET /health``;
``GET /model``. Every problem with a request is a 4xx with a one-line reason, counted by reason in
``GET /health``'s ``rejected``. A client that goes away mid-request only ends its own request.

A body comes from anyone who can reach the port, so it is bounded three ways (issue 27): in size,
by what an honest request for the served model takes (``InputSpec.max_body_bytes``: a declared
Content-Length over it is refused before a byte is read, and the bytes are counted as they come);
in time, the whole body within ``body_timeout_s`` (hypercorn's own timeout is per read, so a body
trickled a byte at a time never met it); and in memory, the bytes of all bodies held at once, charged
as they arrive (a declared length charged up front let 32 trickling clients refuse everyone else).
Its JSON is parsed in a worker thread (unless it is tiny), at most PARSERS at a time, so a big body
never stalls the event loop that answers the others.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from p2ptrain.base import count_rejection
from p2ptrain.serve._batcher import Batcher, Busy
from p2ptrain.serve._input_spec import InputError, parse_request

logger = logging.getLogger(__name__)

# Bytes of request bodies held at once (arrived, being parsed), over all connections: each body is
# at most MAX_BODY_BYTES (8 MiB), and 32 such bodies at once (256 MiB) are all the memory bodies may
# hold; a request whose next bytes would pass it is answered 503. Small requests never meet it.
MAX_BODY_BYTES_IN_FLIGHT = 256 * 1024 * 1024
# A request's whole body must arrive within this: 8 MiB at 1 MB/s takes 8 s. A client slower than
# that (or one trickling on purpose) gets 408 and frees its connection.
BODY_TIMEOUT_S = 10.0
# Bodies parsed at once, each in a worker thread: parsing holds the GIL in stretches, so more at once
# only slow each other and the event loop; the others wait their turn (holding their budget).
PARSERS = 2
# A body this small is parsed on the event loop (well under a millisecond: a thread hop would cost
# more than the parse); the bench's requests of 8 digits samples are ~5 KB.
INLINE_PARSE_BYTES = 16 * 1024

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class _Refused(Exception):
    def __init__(self, status: int, reason: str, why: str) -> None:
        super().__init__(why)
        self.status, self.reason = status, reason


class ServeApp:
    """ASGI app over one :class:`Batcher`; ``rejected`` counts refused requests by reason."""

    def __init__(self, batcher: Batcher, body_timeout_s: float = BODY_TIMEOUT_S) -> None:
        self.batcher = batcher
        self.body_timeout_s = body_timeout_s
        self.rejected: Counter[str] = Counter()
        self.reading = 0  # bytes of bodies held now, arrived or being parsed (MAX_BODY_BYTES_IN_FLIGHT)
        self._parsers = trio.CapacityLimiter(PARSERS)

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
        held = [0]  # bytes of this body charged to self.reading
        try:
            body = await self._read_body(scope, receive, loaded.spec.max_body_bytes, held)
            if body is None:
                self.rejected["disconnected"] += 1
                return 0, {}
            try:
                if len(body) <= INLINE_PARSE_BYTES:
                    x = parse_request(body, loaded.spec)
                else:
                    x = await trio.to_thread.run_sync(parse_request, body, loaded.spec, limiter=self._parsers)
            except InputError as exc:
                raise _Refused(400, "bad_input", str(exc)) from None
        finally:
            self.reading -= held[0]
        try:
            outputs, cid = await self.batcher.predict(x)
        except Busy as exc:
            raise _Refused(503, "busy", str(exc)) from None
        except RuntimeError as exc:
            return 500, {"error": str(exc)}
        return 200, {"outputs": outputs.tolist(), "model_cid": cid}

    async def _read_body(self, scope: dict[str, Any], receive: Receive, cap: int, held: list[int]) -> bytes | None:
        """The request body, at most ``cap`` bytes (else 413), whole within ``body_timeout_s`` (else
        408); None if the client disconnected. Each chunk is charged to MAX_BODY_BYTES_IN_FLIGHT as
        it arrives (``held[0]`` says how much; the caller gives it back): past the budget, 503."""
        for name, value in scope["headers"]:
            if name == b"content-length" and (not value.isdigit() or int(value) > cap):
                raise _Refused(413, "too_large", f"the body is over the {cap} B this model's requests take")
        chunks, size = [], 0
        with trio.move_on_after(self.body_timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > cap:
                    raise _Refused(413, "too_large", f"the body is over the {cap} B this model's requests take")
                if self.reading + len(chunk) > MAX_BODY_BYTES_IN_FLIGHT:
                    raise _Refused(503, "busy", "too many request bodies are being read; retry")
                self.reading += len(chunk)
                held[0] += len(chunk)
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
        raise _Refused(408, "slow_body", f"the body did not arrive within {self.body_timeout_s:g} s")


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
