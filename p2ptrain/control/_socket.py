"""The node's local control endpoint: a Unix socket that only the node's owner can use.

``<home>/control.sock`` (mode 0600, inside a 0700 home) speaks newline-delimited JSON: a request
``{"op": "status", ...}`` gets one line back, ``{"ok": true, ...}`` or ``{"ok": false, "error":
"..."}``. Why a Unix socket: file permissions are the access control (no token to leak, nothing
on a TCP port), and the kernel tells us the peer is local. Any layer adds an operation with
``control.register(name, handler)``, the name a constant in :mod:`p2ptrain.control.ops` that
clients import too; the CLI and DataLoader worker processes talk to the node
through :class:`ControlClient`, which is synchronous on purpose (no event loop needed there).

The server is one boundary: whatever a client sends (a 100,000-deep ``[[[…``, a line that never
ends, nothing at all) and whatever an op's handler raises or returns becomes an error reply to that
client, counted in :attr:`ControlServer.rejected` and logged, never an exception in the node's
nursery. Requests are bounded in size (:data:`MAX_REQUEST_BYTES`), nesting (parsed with
:mod:`p2ptrain.base.boundedjson`) and time (:data:`REQUEST_TIMEOUT_S`); at most :data:`MAX_CONNECTIONS`
clients are served at once.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import stat
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from p2ptrain.base import ArgumentError, UserError, boundedjson
from p2ptrain.control import ops as control_ops

logger = logging.getLogger(__name__)

SOCKET_NAME = "control.sock"
# 1 MiB per request line: the largest request we send is a task file (64 KiB at most) in JSON.
MAX_REQUEST_BYTES = 1 << 20
# Requests are flat objects of scalars and short lists; 8 levels leave room and refuse a ``[[[…``
# bomb before the JSON decoder sees it.
MAX_REQUEST_DEPTH = 8
# 64 MiB per reply: what the client reads at most (a status of a large mesh is well under 1 MiB).
MAX_RESPONSE_BYTES = 64 << 20
# The kernel's limit on a Unix socket path (sun_path is 108 bytes including the final NUL).
MAX_SOCKET_PATH = 107
# Clients served at once (the CLI, a few DataLoader workers per training script); one more is
# answered "busy" and closed at once, so a leaking script cannot pile up tasks in the node.
MAX_CONNECTIONS = 64
# A request line must arrive whole within 10 s of connecting (or of the previous reply). Our
# clients write theirs in one call right after connecting; a client that sends nothing, or
# dribbles a byte at a time, would otherwise hold one of the MAX_CONNECTIONS slots forever.
REQUEST_TIMEOUT_S = 10.0
# A reply must be taken by the client within 30 s (a status reply is small; 30 s covers a client
# paused in a debugger for a moment); one that never reads would otherwise hold its slot forever.
REPLY_TIMEOUT_S = 30.0
# A "busy" answer to a connection over MAX_CONNECTIONS gets 1 s to be written before we close it.
BUSY_REPLY_TIMEOUT_S = 1.0

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class ControlError(UserError):
    """The node answered a control request with an error."""


class ControlRequestError(ValueError):
    """A control request line that is not a bounded JSON object with a string ``op``.

    ``reason`` is a short stable tag, the key of the server's rejection counter.
    """

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def parse_request(line: bytes) -> dict[str, Any]:
    """One request line (without its newline) to a request object; :class:`ControlRequestError` otherwise.

    The one decoder of control input, a pure function so that it can be fuzzed without a socket.
    """
    if len(line) > MAX_REQUEST_BYTES:
        raise ControlRequestError(f"request over {MAX_REQUEST_BYTES} bytes", "oversize")
    try:
        request = boundedjson.loads(line, max_depth=MAX_REQUEST_DEPTH, what="request")
    except boundedjson.JSONBoundsError as exc:
        raise ControlRequestError(str(exc), "not_json") from None
    if type(request) is not dict or type(request.get("op")) is not str:
        raise ControlRequestError('request must be an object with a string "op"', "bad_request")
    return request


def encode_reply(reply: dict[str, Any]) -> bytes:
    """One reply line; a reply that cannot be encoded (or is too big) becomes an error reply."""
    try:
        data = json.dumps(reply, default=str).encode() + b"\n"
    except (TypeError, ValueError, RecursionError) as exc:
        raise ControlRequestError(f"reply could not be encoded: {type(exc).__name__}", "bad_reply") from None
    if len(data) > MAX_RESPONSE_BYTES:
        raise ControlRequestError(f"reply of {len(data)} bytes is over {MAX_RESPONSE_BYTES}", "bad_reply")
    return data


def _error(message: str) -> dict[str, Any]:
    return {"ok": False, "error": message}


def socket_path(home: Path) -> Path:
    path = Path(home) / SOCKET_NAME
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise ArgumentError("{path} is longer than the {limit} bytes a Unix socket path may have; use a shorter {home}",
                            path=path, limit=MAX_SOCKET_PATH)
    return path


def _no_node(home: Path) -> UserError:
    return UserError(f"no node is running for home {home} (start one with: p2ptrain node start --home {home})")


def is_live(path: Path) -> bool:
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
        self.request_timeout = REQUEST_TIMEOUT_S
        self.reply_timeout = REPLY_TIMEOUT_S
        self.connections = 0
        self.served = 0
        # reason -> requests or connections refused for it (oversize, not_json, bad_request,
        # unknown_op, op_error, internal_error, bad_reply, timeout, busy, connection_error).
        self.rejected: Counter[str] = Counter()
        self.register(control_ops.OPS, self._list_ops)
        self.register(control_ops.CONTROL_STATS, self._stats_op)

    def register(self, op: str, handler: Handler) -> None:
        """Answer requests ``{"op": op, ...}`` with ``await handler(request)`` (a JSON-able dict).

        Raise :class:`p2ptrain.base.UserError` (or ValueError) in the handler for an error
        the caller should read; anything else is logged here and reported as an internal error.
        """
        if op in self._ops:
            raise ValueError(f"control op {op!r} registered twice")
        self._ops[op] = handler

    @property
    def ops(self) -> list[str]:
        return sorted(self._ops)

    def stats(self) -> dict[str, Any]:
        """Counters for ``node status``: requests served, rejections by reason, open connections."""
        return {"served": self.served, "connections": self.connections, "rejected": dict(self.rejected)}

    async def _list_ops(self, request: dict[str, Any]) -> dict[str, Any]:
        return {"ops": self.ops}

    async def _stats_op(self, request: dict[str, Any]) -> dict[str, Any]:
        return self.stats()

    def _reject(self, reason: str, message: str, level: int = logging.WARNING) -> dict[str, Any]:
        """Count and log one refused request (or connection); the error reply that tells the client."""
        self.rejected[reason] += 1
        logger.log(level, "control request rejected (%s): %s", reason, message[:200])
        return _error(message)

    def claim_socket(self) -> Path:
        """Check that no other node serves this home, and clear a stale socket file."""
        path = socket_path(self.home)
        if path.exists() or path.is_symlink():
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise UserError(f"{path} exists and is not a socket; remove it if it is not yours")
            if is_live(path):
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
                    if self.connections >= MAX_CONNECTIONS:
                        nursery.start_soon(self._refuse_busy, stream)
                    else:
                        self.connections += 1
                        nursery.start_soon(self._serve_connection, stream)
        finally:
            try:
                if path.stat().st_ino == inode:  # never remove a socket another node bound since
                    path.unlink()
            except FileNotFoundError:
                pass

    async def _refuse_busy(self, stream: trio.SocketStream) -> None:
        """Tell a connection over the cap that we are busy, then close it (all within 1 s).

        What the client already sent is read and dropped first: closing a Unix socket with unread
        data resets it, and the client would see a reset instead of the reason.
        """
        reply = self._reject("busy", f"busy: {MAX_CONNECTIONS} control connections are open; try again")
        async with stream:
            with trio.move_on_after(BUSY_REPLY_TIMEOUT_S):
                try:
                    await stream.send_all(encode_reply(reply))
                    await stream.send_eof()
                    while await stream.receive_some(65536):
                        pass
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass

    async def _serve_connection(self, stream: trio.SocketStream) -> None:
        """Serve one client until it goes away or breaks a bound; nothing it does escapes."""
        try:
            async with stream:
                await self._converse(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client went away
        except Exception as exc:  # the boundary: a bug here must not stop the node
            self.rejected["connection_error"] += 1
            logger.exception("control connection failed: %s", type(exc).__name__)
        finally:
            self.connections -= 1

    async def _converse(self, stream: trio.SocketStream) -> None:
        buffer = bytearray()
        while True:
            line = None
            with trio.move_on_after(self.request_timeout):
                while (end := buffer.find(b"\n")) < 0:
                    if len(buffer) > MAX_REQUEST_BYTES:
                        reply = self._reject("oversize", f"request over {MAX_REQUEST_BYTES} bytes")
                        await self._send(stream, encode_reply(reply))
                        return
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        return
                    buffer += chunk
                line = bytes(buffer[:end])
                del buffer[: end + 1]
            if line is None:
                reply = self._reject("timeout", f"no complete request line within {self.request_timeout:g} s")
                await self._send(stream, encode_reply(reply))
                return
            await self._send(stream, await self.reply_line(line))

    async def _send(self, stream: trio.SocketStream, data: bytes) -> None:
        with trio.move_on_after(self.reply_timeout) as scope:
            await stream.send_all(data)
        if scope.cancelled_caught:
            self._reject("timeout", f"client took no reply within {self.reply_timeout:g} s")
            raise trio.ClosedResourceError("reply not taken")

    async def reply_line(self, line: bytes) -> bytes:
        """One request line to one encoded reply line; never raises for bad input or a failing op."""
        reply = await self.handle_line(line)
        try:
            data = encode_reply(reply)
        except ControlRequestError as exc:
            data = encode_reply(self._reject(exc.reason, str(exc)))
        if reply.get("ok") is True:
            self.served += 1
        return data

    async def handle_line(self, line: bytes) -> dict[str, Any]:
        """One request line to one reply object; never raises for bad input or a failing op."""
        try:
            request = parse_request(line)
        except ControlRequestError as exc:
            return self._reject(exc.reason, str(exc))
        op = request["op"]
        handler = self._ops.get(op)
        if handler is None:
            return self._reject("unknown_op", f"unknown op {op[:64]!r}; known: {', '.join(self.ops)}")
        try:
            result = await handler(request)
        except (UserError, ValueError, KeyError, TypeError) as exc:  # the caller's mistake, as the op says
            return self._reject("op_error", _describe(exc), logging.DEBUG)  # an answer, not an attack
        except Exception as exc:
            logger.exception("control op %s failed", op)
            return self._reject("internal_error", f"internal error in {op}: {_describe(exc)}")
        if not isinstance(result, dict):
            return self._reject("internal_error", f"internal error in {op}: it answered {type(result).__name__}, not an object")
        return {"ok": True, **result}


def _describe(exc: BaseException) -> str:
    """The message of ``exc`` for a reply; an exception whose ``str`` fails is named by its type."""
    try:
        return str(exc) or type(exc).__name__
    except Exception:
        return type(exc).__name__


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
            buffer = bytearray()
            try:
                sock.sendall(request)
                while b"\n" not in buffer:
                    chunk = sock.recv(1 << 20)
                    if not chunk:
                        raise ControlError(f"the node for home {self.home} closed the connection before answering {op!r}")
                    buffer += chunk
                    if len(buffer) > MAX_RESPONSE_BYTES:
                        raise ControlError(f"reply to {op!r} is over {MAX_RESPONSE_BYTES} bytes")
            except ConnectionResetError:
                raise ControlError(f"the node for home {self.home} reset the connection before answering {op!r}") from None
        reply = json.loads(buffer[: buffer.index(b"\n")])
        if not isinstance(reply, dict):
            raise ControlError(f"reply to {op!r} is not a JSON object")
        if not reply.get("ok"):
            raise ControlError(f"{op}: {reply.get('error', 'failed')}")
        reply.pop("ok")
        return reply
