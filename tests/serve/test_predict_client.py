"""``model predict`` against hostile servers (issue 27): real HTTP servers on loopback that answer
with a redirect to a local URL, or trickle their answer. The client follows no redirect and gives
up at one deadline for the whole exchange."""

from __future__ import annotations

import json
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from p2ptrain.testing import run_forked
from p2ptrain.serve import ServeError, predict

CID = "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o"
CALL_DEADLINE_S = 60.0


@contextmanager
def http_server(answer: Callable[[socket.socket, bytes], None]) -> Iterator[tuple[str, list[bytes]]]:
    """A threaded server on 127.0.0.1: reads each request's head and body, then ``answer(sock,
    request)``; yields its URL and the requests it got."""
    got: list[bytes] = []
    stop = threading.Event()

    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            data = b""
            self.request.settimeout(5)
            while b"\r\n\r\n" not in data and (chunk := self.request.recv(65536)):
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length")), 0)
            while len(body) < length and (chunk := self.request.recv(65536)):
                body += chunk
            got.append(head + b"\r\n\r\n" + body)
            try:
                answer(self.request, stop)
            except OSError:
                pass  # the client hung up

    class Server(socketserver.ThreadingTCPServer):
        daemon_threads = True
        allow_reuse_address = True

    with Server(("127.0.0.1", 0), Handler) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}", got
        finally:
            stop.set()
            server.shutdown()


def fine(sock: socket.socket, stop: threading.Event) -> None:
    body = json.dumps({"outputs": [[1.0]], "model_cid": CID}).encode()
    sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)


def test_a_redirect_to_a_local_url_is_refused_not_followed(tmp_path: Path) -> None:
    """Before: urllib followed the 303 and fetched the local URL the server named."""
    with http_server(fine) as (local, local_got):
        def redirect(sock: socket.socket, stop: threading.Event) -> None:
            sock.sendall(b"HTTP/1.1 303 See Other\r\nLocation: " + local.encode() + b"/admin?wipe=1\r\n"
                         b"Content-Length: 0\r\nConnection: close\r\n\r\n")

        with http_server(redirect) as (hostile, _):
            with pytest.raises(ServeError, match="303 See Other .a redirect.: model predict follows none") as refused:
                predict(hostile, [[0.0] * 64])
            assert refused.value.status == 0  # not the model's answer: another server may give it
            inputs = tmp_path / "inputs.json"
            inputs.write_text(json.dumps({"inputs": [[0.0] * 64]}))
            done = run_forked([sys.executable, "-m", "p2ptrain.cli.main", "model", "predict", CID, str(inputs),
                               "--url", hostile], capture_output=True, text=True, timeout=CALL_DEADLINE_S)
        assert done.returncode == 1
        assert done.stderr.strip().endswith("(a redirect): model predict follows none"), done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
    assert local_got == []  # the local URL was never asked


def test_an_answer_trickled_past_the_deadline_ends_the_call_at_the_deadline() -> None:
    """Before: the timeout was per read, so a byte every 0.2 s held the client for ever (>200 s)."""
    def trickle(sock: socket.socket, stop: threading.Event) -> None:
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n[")
        while not stop.wait(0.2):
            sock.sendall(b" ")

    with http_server(trickle) as (hostile, got):
        started = time.monotonic()
        with pytest.raises(ServeError, match="no whole answer within 2 s"):
            predict(hostile, [[0.0] * 64], timeout=2.0)
        took = time.monotonic() - started
    assert len(got) == 1
    assert 1.9 < took < 10


def test_headers_trickled_past_the_deadline_end_the_call_too() -> None:
    def trickle(sock: socket.socket, stop: threading.Event) -> None:
        for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 10_000:
            if stop.wait(0.2):
                return
            sock.sendall(bytes([byte]))

    with http_server(trickle) as (hostile, _):
        started = time.monotonic()
        with pytest.raises(ServeError, match="no whole answer within 1 s"):
            predict(hostile, [[0.0] * 64], timeout=1.0)
        assert time.monotonic() - started < 10


def test_an_honest_answer_is_read_whole() -> None:
    with http_server(fine) as (url, got):
        assert predict(url, [[0.0] * 64]) == {"outputs": [[1.0]], "model_cid": CID}
    assert got[0].startswith(b"POST /predict HTTP/1.1")
    assert json.loads(got[0].split(b"\r\n\r\n", 1)[1]) == {"inputs": [[0.0] * 64]}
