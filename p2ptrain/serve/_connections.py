"""The model server's accept loop: hypercorn's per-connection HTTP server behind a connection cap.

hypercorn has no setting that caps open connections: its trio worker accepts every connection the
kernel hands it. So the accept loop is ours: :class:`CappedListener` accepts only while fewer than
``limit`` connections are open (``--max-connections``, :data:`p2ptrain.serve.MAX_CONNECTIONS`);
a connection past the cap waits, not accepted, in the kernel's listen backlog until one ends, and
the kernel refuses it once the backlog is full too. The connections already open are served all
along. Each accepted connection is served by hypercorn's own ``TCPServer`` (HTTP/1.1 and HTTP/2,
keep-alive, the read timeout), checked with hypercorn 0.18, the version constraints.txt pins.

One change to it (:class:`_Connection`): once the client has closed its side, the keep-alive timer
stops. hypercorn keeps a connection closed by its client while idle until that timer fires (30 s,
``server.KEEP_ALIVE_S``); under a cap that would hold a slot for nothing.
"""

from __future__ import annotations

import logging
from typing import Any

import trio
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import repr_socket_addr, wrap_app

from p2ptrain.base import UserError

__all__ = ["CappedListener", "serve_capped"]

logger = logging.getLogger(__name__)


class CappedListener(trio.abc.Listener[trio.SocketStream]):
    """A listener that accepts only while fewer than ``limit`` connections are open; the others
    wait in the kernel's backlog. Whoever serves an accepted connection calls :meth:`release`."""

    def __init__(self, inner: trio.SocketListener, limit: int) -> None:
        self.inner = inner
        self.open = 0  # connections accepted and not yet released
        self._slots = trio.Semaphore(limit)

    async def accept(self) -> trio.SocketStream:
        await self._slots.acquire()
        try:
            stream = await self.inner.accept()
        except BaseException:
            self._slots.release()
            raise
        self.open += 1
        return stream

    def release(self) -> None:
        self.open -= 1
        self._slots.release()

    async def aclose(self) -> None:
        await self.inner.aclose()


class _Connection(TCPServer):
    """hypercorn's connection server, ending as soon as the client has closed and nothing runs."""

    async def _read_data(self) -> None:
        await super()._read_data()  # the client closed (or timed out): no request can come
        await self.idle_task.stop()


async def serve_capped(
    app: Any, config: Any, limit: int, what: str, *, task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the ASGI ``app`` on ``config``'s one bind (``what``: the address as the user gave it,
    for the error line) with at most ``limit`` connections open; ``task_status.started`` gets
    ``(url, listener)``. An address that cannot be bound is one UserError line."""
    try:
        (sock,) = config.create_sockets().insecure_sockets  # one bind, no TLS
        sock.listen(config.backlog)
    except OSError as exc:  # gaierror, EADDRINUSE, EADDRNOTAVAIL, EACCES
        raise UserError(f"cannot listen on {what}: {exc.strerror or exc}") from None
    listener = CappedListener(trio.SocketListener(trio.socket.from_stdlib_socket(sock)), limit)
    wrapped = wrap_app(app, config.wsgi_max_body_size, "asgi")
    context = WorkerContext(None)

    async def serve_one(stream: trio.SocketStream) -> None:
        try:
            await _Connection(wrapped, config, context, ConnectionState({}), stream)  # type: ignore[arg-type]  # TLS off
        finally:
            listener.release()

    url = f"http://{repr_socket_addr(sock.family, sock.getsockname())}"
    logger.info("serving on %s (at most %d connections at once)", url, limit)
    task_status.started((url, listener))
    await trio.serve_listeners(serve_one, [listener])
