"""The node's local control endpoint: a Unix socket that only the node's owner can use.

``<home>/control.sock`` (mode 0600, inside a 0700 home) speaks newline-delimited JSON: a request
``{"op": "status", ...}`` gets one line back, ``{"ok": true, ...}`` or ``{"ok": false, "error":
"..."}``. Why a Unix socket: file permissions are the access control (no token to leak, nothing
on a TCP port), and the kernel tells us the peer is local. Any layer adds an operation with
``control.register("op", handler)``; the CLI and DataLoader worker processes talk to the node
through :class:`ControlClient`, which is synchronous on purpose (no event loop needed there).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from p2ptrain.errors import UserError

logger = logging.getLogger(__name__)

SOCKET_NAME = "control.sock"
MAX_REQUEST_BYTES = 1 << 20
MAX_RESPONSE_BYTES = 64 << 20
# The kernel's limit on a Unix socket path (sun_path is 108 bytes including the final NUL).
MAX_SOCKET_PATH = 107
MAX_CONNECTIONS = 64

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class ControlError(UserError):
    """The node answered a control request with an error."""


def socket_path(home: Path) -> Path:
    path = Path(home) / SOCKET_NAME
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise UserError(f"{path} is longer than the {MAX_SOCKET_PATH} bytes a Unix socket path may have; use a shorter --home")
    return path


def _no_node(home: Path) -> UserError:
    return UserError(f"no node is running for home {home} (start one with: p2ptrain node start --home {home})")


def _is_live(path: Path) -> bool:
    """Whether a node answers on ``path`` (False for a stale file left by a crashed node)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(os.fspath(path))
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTSOCK):
            return False
        raise
    finally:
        probe.close()


class ControlServer:
    """The op registry and the socket server; ``serve`` runs inside the node's nursery."""

    def __init__(self, home: Path) -> None:
        self.home = Path(home)
        self._ops: dict[str, Handler] = {}
        self.register("ops", self._list_ops)

    def register(self, op: str, handler: Handler) -> None:
        """Answer requests ``{"op": op, ...}`` with ``await handler(request)`` (a JSON-able dict).

        Raise :class:`p2ptrain.errors.UserError` (or ValueError) in the handler for an error
        the caller should read; anything else is logged here and reported as an internal error.
        """
        if op in self._ops:
            raise ValueError(f"control op {op!r} registered twice")
        self._ops[op] = handler

    @property
    def ops(self) -> list[str]:
        return sorted(self._ops)

    async def _list_ops(self, request: dict[str, Any]) -> dict[str, Any]:
        return {"ops": self.ops}

    def claim_socket(self) -> Path:
        """Check that no other node serves this home, and clear a stale socket file."""
        path = socket_path(self.home)
        if path.exists() or path.is_symlink():
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise UserError(f"{path} exists and is not a socket; remove it if it is not yours")
            if _is_live(path):
                raise UserError(f"a node is already running for home {self.home} (see: p2ptrain node status --home {self.home})")
            logger.info("removing stale control socket %s left by a node that did not stop cleanly", path)
            path.unlink()
        return path

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Bind the socket (0600), serve until cancelled, then remove the socket file."""
        path = self.claim_socket()
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            old_umask = os.umask(0o177)  # created 0600: no window in which others could connect
            try:
                raw.bind(os.fspath(path))  # synchronous, so the umask change spans no checkpoint
            finally:
                os.umask(old_umask)
            os.chmod(path, 0o600)
            inode = path.stat().st_ino
            raw.listen(MAX_CONNECTIONS)
            listener = trio.SocketListener(trio.socket.from_stdlib_socket(raw))
        except BaseException:
            raw.close()
            raise
        try:
            async with listener, trio.open_nursery() as nursery:
                task_status.started(path)
                while True:
                    stream = await listener.accept()
                    nursery.start_soon(self._serve_connection, stream)
        finally:
            try:
                if path.stat().st_ino == inode:  # never remove a socket another node bound since
                    path.unlink()
            except FileNotFoundError:
                pass

    async def _serve_connection(self, stream: trio.SocketStream) -> None:
        async with stream:
            buffer = bytearray()
            try:
                while True:
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        return
                    buffer += chunk
                    while (end := buffer.find(b"\n")) >= 0:
                        line = bytes(buffer[:end])
                        del buffer[: end + 1]
                        reply = await self.handle_line(line)
                        await stream.send_all(json.dumps(reply, default=str).encode() + b"\n")
                    if len(buffer) > MAX_REQUEST_BYTES:
                        reply = {"ok": False, "error": f"request over {MAX_REQUEST_BYTES} bytes"}
                        await stream.send_all(json.dumps(reply).encode() + b"\n")
                        return
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return  # the client went away

    async def handle_line(self, line: bytes) -> dict[str, Any]:
        """One request line to one reply object; never raises for bad input."""
        if len(line) > MAX_REQUEST_BYTES:
            return {"ok": False, "error": f"request over {MAX_REQUEST_BYTES} bytes"}
        try:
            request = json.loads(line)
        except ValueError as exc:
            return {"ok": False, "error": f"request is not JSON: {exc}"}
        if type(request) is not dict or type(request.get("op")) is not str:
            return {"ok": False, "error": 'request must be an object with a string "op"'}
        handler = self._ops.get(request["op"])
        if handler is None:
            return {"ok": False, "error": f"unknown op {request['op']!r}; known: {', '.join(self.ops)}"}
        try:
            result = await handler(request)
        except (UserError, ValueError, KeyError, TypeError) as exc:
            return {"ok": False, "error": str(exc) or type(exc).__name__}
        except Exception as exc:
            logger.exception("control op %s failed", request["op"])
            return {"ok": False, "error": f"internal error in {request['op']}: {exc}"}
        return {"ok": True, **result}


class ControlClient:
    """Synchronous client of a node's control socket, for the CLI and worker processes."""

    def __init__(self, home: Path, timeout: float | None = 60.0) -> None:
        self.home = Path(home)
        self.timeout = timeout

    def call(self, op: str, **params: Any) -> dict[str, Any]:
        """Send one request; return the reply (without error) or raise :class:`ControlError`."""
        path = socket_path(self.home)
        request = json.dumps({"op": op, **params}).encode() + b"\n"
        if len(request) > MAX_REQUEST_BYTES:
            raise UserError(f"control request {op!r} is over {MAX_REQUEST_BYTES} bytes")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(self.timeout)
            try:
                sock.connect(os.fspath(path))
            except (FileNotFoundError, ConnectionRefusedError):
                raise _no_node(self.home) from None
            except PermissionError:
                raise UserError(f"{path} belongs to another user; only the node's owner may control it") from None
            sock.sendall(request)
            buffer = bytearray()
            while b"\n" not in buffer:
                chunk = sock.recv(1 << 20)
                if not chunk:
                    raise ControlError(f"the node for home {self.home} closed the connection before answering {op!r}")
                buffer += chunk
                if len(buffer) > MAX_RESPONSE_BYTES:
                    raise ControlError(f"reply to {op!r} is over {MAX_RESPONSE_BYTES} bytes")
        reply = json.loads(buffer[: buffer.index(b"\n")])
        if not reply.get("ok"):
            raise ControlError(f"{op}: {reply.get('error', 'failed')}")
        reply.pop("ok")
        return reply
