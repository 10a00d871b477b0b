"""The control socket: owner-only, line-delimited JSON, an op registry, stale sockets, clear errors."""

from __future__ import annotations

import json
import os
import socket
import stat

import pytest
import trio

from p2ptrain.errors import UserError
from p2ptrain.net.control import MAX_REQUEST_BYTES, ControlClient, ControlError, ControlServer, socket_path


@pytest.fixture
def home(tmp_path):
    h = tmp_path / "h"
    h.mkdir(mode=0o700)
    return h


async def call(home, op, **kw):
    return await trio.to_thread.run_sync(lambda: ControlClient(home, timeout=10).call(op, **kw))


async def test_registered_ops_answer_and_errors_are_clear(home):
    server = ControlServer(home)

    async def echo(req):
        return {"echo": req["text"]}

    async def fails(req):
        raise UserError("no such model")

    server.register("echo", echo)
    server.register("fails", fails)
    with pytest.raises(ValueError):
        server.register("echo", echo)
    async with trio.open_nursery() as nursery:
        path = await nursery.start(server.serve)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        with trio.fail_after(10):
            assert await call(home, "echo", text="hi") == {"echo": "hi"}
            assert "echo" in (await call(home, "ops"))["ops"]
            with pytest.raises(ControlError, match="no such model"):
                await call(home, "fails")
            with pytest.raises(ControlError, match="unknown op 'nope'"):
                await call(home, "nope")
            with pytest.raises(ControlError, match="text"):  # KeyError in a handler: the caller's mistake
                await call(home, "echo")
        nursery.cancel_scope.cancel()
    assert not path.exists(), "the socket file is removed on stop"


def raw_exchange(path, payload: bytes) -> list[dict]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(os.fspath(path))
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return [json.loads(line) for line in data.splitlines()]


async def test_garbage_and_oversized_requests_get_errors_and_the_server_keeps_serving(home):
    server = ControlServer(home)
    async with trio.open_nursery() as nursery:
        path = await nursery.start(server.serve)
        with trio.fail_after(10):
            replies = await trio.to_thread.run_sync(
                raw_exchange, path, b'not json\n[1,2]\n{"op": 5}\n{"op": "ops"}\n'
            )
            assert [r["ok"] for r in replies] == [False, False, False, True]
            big = await trio.to_thread.run_sync(raw_exchange, path, b"x" * (MAX_REQUEST_BYTES + 100))
            assert big[0]["ok"] is False and "bytes" in big[0]["error"]
            assert (await call(home, "ops"))["ops"]
        nursery.cancel_scope.cancel()


async def test_stale_socket_from_a_crashed_node_is_replaced(home):
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(os.fspath(socket_path(home)))
    stale.close()  # bound but nobody listening: what a killed node leaves behind
    assert socket_path(home).exists()
    server = ControlServer(home)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        with trio.fail_after(10):
            assert (await call(home, "ops"))["ops"]
        nursery.cancel_scope.cancel()


async def test_a_second_server_on_a_live_home_is_refused(home):
    first = ControlServer(home)
    async with trio.open_nursery() as nursery:
        await nursery.start(first.serve)
        with pytest.raises(UserError, match="already running"):
            ControlServer(home).claim_socket()
        nursery.cancel_scope.cancel()


def test_client_without_a_node_says_how_to_start_one(home):
    with pytest.raises(UserError, match=f"no node is running for home {home}.*p2ptrain node start --home {home}"):
        ControlClient(home).call("status")


def test_socket_path_too_long_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="shorter --home"):
        socket_path(tmp_path / ("x" * 120))
