"""``p2ptrain.serve.predict``: send samples to a model server, read its answer (stdlib only, no torch:
``model predict`` starts fast).

The server may be one a peer announced on the mesh, so it is not trusted (issue 27): its answer is
read within one deadline for the whole exchange (a per-read timeout let a server that trickles its
answer a byte at a time hold the client for ever), and a redirect is refused, not followed (an
announced server answering 303 must not make the client post to, or fetch from, a URL of its
choosing, such as a service on the client's own machine).
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from p2ptrain.base import UserError

# A client waits this long for an answer, all of it (connecting, sending, the answer's last byte):
# a batch of MAX_INPUTS_PER_REQUEST samples on a loaded CPU takes well under a second; a minute
# means the server is gone, stuck, or trickling on purpose.
CLIENT_TIMEOUT_S = 60.0
# An answer larger than this is not read (a 1024-sample batch of 1,000 logits is ~20 MB of JSON).
MAX_ANSWER_BYTES = 64 * 1024 * 1024
# An error answer is one JSON line with a reason: more is not read.
MAX_ERROR_BYTES = 64 * 1024
_READ_CHUNK = 1 << 16


class ServeError(UserError):
    """A prediction request failed: the server's reason (4xx/5xx) or why it could not be reached
    or believed (``status`` 0: another server of the model may answer)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


def predict(url: str, inputs: Sequence[Any], timeout: float = CLIENT_TIMEOUT_S) -> dict[str, Any]:
    """POST ``inputs`` (a list of samples) to a server's ``/predict``; its answer
    ``{"outputs": [...], "model_cid": ...}`` within ``timeout`` seconds in all. :class:`ServeError`
    with the server's reason otherwise; a redirect is an error, never followed."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ServeError(f"{url}: a server URL is http(s)://host:port")
    body = json.dumps({"inputs": list(inputs)}).encode()
    connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    try:
        connection = connection_class(parts.hostname, parts.port, timeout=timeout)
    except ValueError as exc:  # a port that is not a number
        raise ServeError(f"{url}: {exc}") from None
    expired = threading.Event()
    watchdog = threading.Timer(timeout, _cut, (connection, expired))
    watchdog.daemon = True
    watchdog.start()
    try:
        status, reason, data = _exchange(connection, parts.path.rstrip("/") + "/predict", body, expired)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        failure: str | None = f"{getattr(exc, 'reason', None) or exc or type(exc).__name__}"
    else:
        failure = None
    finally:
        watchdog.cancel()
        connection.close()
    if expired.is_set():  # a cut answer may look whole (a read at the cut returns what came)
        raise ServeError(f"{url}: no whole answer within {timeout:g} s")
    if failure is not None:
        raise ServeError(f"{url}: {failure}")
    if 300 <= status < 400:
        raise ServeError(f"{url}: the server answered {status} {reason} (a redirect): model predict follows none")
    if status >= 400:
        try:
            reason = json.loads(data).get("error", reason)
        except (ValueError, AttributeError):
            pass
        raise ServeError(f"{url}: {status} {reason}", status)
    try:
        doc = json.loads(data)
    except ValueError:
        doc = None
    if status != 200 or not isinstance(doc, dict) or not isinstance(doc.get("outputs"), list):
        raise ServeError(f"{url}: the answer is not a prediction")
    return doc


def _exchange(connection: http.client.HTTPConnection, path: str, body: bytes,
              expired: threading.Event) -> tuple[int, str, bytes]:
    """Send the request; the answer's status, reason and body (at most MAX_ANSWER_BYTES, or
    MAX_ERROR_BYTES for an error); ValueError for one over its bound. Past the deadline ``expired``
    is set and the socket shut down: whatever was blocked on it fails."""
    connection.connect()
    if expired.is_set():  # the deadline passed while connecting, before there was a socket to cut
        raise TimeoutError("connecting took the whole deadline")
    connection.request("POST", path, body=body, headers={"content-type": "application/json"})
    answer = connection.getresponse()
    limit = MAX_ANSWER_BYTES if answer.status < 300 else MAX_ERROR_BYTES
    chunks, size = [], 0
    while chunk := answer.read(_READ_CHUNK):
        size += len(chunk)
        if size > limit:
            if answer.status >= 300:
                break  # the reason is in the first bytes, if anywhere
            raise ValueError(f"the answer is over {limit} bytes")
        chunks.append(chunk)
    return answer.status, answer.reason, b"".join(chunks)


def _cut(connection: http.client.HTTPConnection, expired: threading.Event) -> None:
    """The deadline passed: shut the socket down, which ends any read or write blocked on it."""
    expired.set()
    sock = connection.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed
