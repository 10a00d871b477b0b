"""The control socket: owner-only, line-delimited JSON, an op registry, stale sockets, clear errors."""

from __future__ import annotations

import json
import os
import socket
import stat

import pytest
import trio

from p2ptrain.base import UserError, command_line_words
from p2ptrain.control import ControlClient, ControlError, ControlServer, ops as control_ops, socket_path
from p2ptrain.control._socket import MAX_CONNECTIONS, MAX_REQUEST_BYTES, ControlRequestError, parse_request
from p2ptrain.testing import NodeProcess, free_port, local_mesh


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
            assert "echo" in (await call(home, control_ops.OPS))["ops"]
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
            assert (await call(home, control_ops.OPS))["ops"]
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
            assert (await call(home, control_ops.OPS))["ops"]
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
        ControlClient(home).call(control_ops.STATUS)


def test_socket_path_too_long_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="shorter home=$") as bad:
        socket_path(tmp_path / ("x" * 120))
    assert command_line_words(bad.value).endswith("shorter --home"), command_line_words(bad.value)


# --- one boundary: nothing a client sends, and nothing an op does, stops the server -------------


async def exchange(path, payload: bytes, *, shut: bool = True) -> list[dict]:
    """Send ``payload`` on a fresh connection; every reply line until the server closes it."""
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with sock:
        await sock.connect(os.fspath(path))
        if payload:
            await sock.send(payload)
        if shut:
            sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := await sock.recv(65536):
            data += chunk
    return [json.loads(line) for line in data.splitlines()]


def test_parse_request_refuses_a_nesting_bomb_with_its_declared_error():
    with pytest.raises(ControlRequestError) as caught:
        parse_request(b"[" * 100_000)
    assert caught.value.reason == "not_json"
    assert parse_request(b'{"op": "ping"}') == {"op": "ping"}


async def test_a_100000_bracket_line_is_refused_and_the_node_process_keeps_answering(tmp_path):
    home = tmp_path / "node"  # no folder yet: NodeProcess makes the home as node start would
    proc = NodeProcess(home, free_port(), extra_args=["--no-dht"]).start()
    try:
        await trio.to_thread.run_sync(proc.wait_ready)
        with trio.fail_after(20):
            replies = await exchange(socket_path(home), b"[" * 100_000 + b"\n" + b'{"op": "ping"}\n')
            assert replies[0]["ok"] is False and "nested" in replies[0]["error"]
            assert replies[1]["ok"] is True, "the same connection goes on after a refused line"
            status = await trio.to_thread.run_sync(proc.status)
        assert proc.proc.poll() is None
        assert status["control"]["rejected"] == {"not_json": 1}
    finally:
        await trio.to_thread.run_sync(proc.terminate)


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no message either")


async def test_an_op_that_fails_in_any_way_is_an_error_reply_and_the_node_keeps_serving(tmp_path):
    async def raises(request):
        raise RuntimeError("injected failure")

    async def unprintable(request):
        raise Unprintable()

    async def not_an_object(request):
        return ["a", "list"]

    async def unencodable(request):
        return {"value": {(1, 2): "tuple keys are not JSON"}}

    async def recursive(request):
        loop: list = []
        loop.append(loop)
        return {"loop": loop}

    async with local_mesh(1, tmp_path, dht=False) as (node,):
        for name, handler in [("t.raises", raises), ("t.unprintable", unprintable), ("t.list", not_an_object),
                              ("t.unencodable", unencodable), ("t.recursive", recursive)]:
            node.control.register(name, handler)
        path = socket_path(node.home)
        with trio.fail_after(20):
            for op, says in [("t.raises", "internal error in t.raises: injected failure"),
                             ("t.unprintable", "internal error in t.unprintable: Unprintable"),
                             ("t.list", "not an object"), ("t.unencodable", "could not be encoded"),
                             ("t.recursive", "could not be encoded")]:
                (reply,) = await exchange(path, json.dumps({"op": op}).encode() + b"\n")
                assert reply == {"ok": False, "error": reply["error"]} and says in reply["error"], reply
                assert (await call(node.home, control_ops.PING))["started"], f"the node stopped answering after {op}"
            status = await call(node.home, control_ops.STATUS)
    assert status["control"]["rejected"] == {"internal_error": 3, "bad_reply": 2}


async def test_a_silent_or_dribbling_client_is_timed_out_while_others_are_served(tmp_path):
    async with local_mesh(1, tmp_path, dht=False) as (node,):
        node.control.request_timeout = 0.5
        path = socket_path(node.home)
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                results: dict[str, list[dict]] = {}

                async def client(name: str, payload: bytes) -> None:
                    results[name] = await exchange(path, payload, shut=False)

                nursery.start_soon(client, "silent", b"")
                nursery.start_soon(client, "dribbling", b'{"op": "pi')
                assert (await call(node.home, control_ops.PING))["started"]
            for name in ("silent", "dribbling"):
                (reply,) = results[name]
                assert reply["ok"] is False and "no complete request line within 0.5 s" in reply["error"], name
            assert (await call(node.home, control_ops.STATUS))["control"]["rejected"] == {"timeout": 2}


async def test_connections_over_the_cap_are_told_busy_and_the_server_recovers(home):
    server = ControlServer(home)
    async with trio.open_nursery() as nursery:
        path = await nursery.start(server.serve)
        held = []
        try:
            with trio.fail_after(20):
                for _ in range(MAX_CONNECTIONS):
                    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    held.append(sock)
                    await sock.connect(os.fspath(path))
                while server.connections < MAX_CONNECTIONS:
                    await trio.sleep(0.01)
                with pytest.raises(ControlError, match="busy: 64 control connections are open"):
                    await call(home, control_ops.OPS)
        finally:
            for sock in held:
                sock.close()
        with trio.fail_after(20):
            while server.connections:
                await trio.sleep(0.01)
            assert (await call(home, control_ops.OPS))["ops"]
            assert server.stats()["rejected"] == {"busy": 1}
        nursery.cancel_scope.cancel()


async def test_every_op_of_a_real_peer_answers_hostile_parameters_and_the_node_keeps_serving(tmp_path):
    from p2ptrain.node import Node, NodeConfig
    from p2ptrain.services import make_peer

    node = Node(tmp_path / "peer", NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], dht=False))
    make_peer(node)
    hostile = [
        {},
        {"cid": [[1]], "task_cid": {"a": 1}, "text": 5, "join": "yes", "timeout": -1},
        {"cid": "x" * 1000, "task_cid": "Qm" + "1" * 44, "text": "[[[[", "timeout": [1.5]},
        {"cid": "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o", "timeout": 2**62, "text": "name = 1e400"},
    ]
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        path = socket_path(node.home)
        with trio.fail_after(60):
            ops = (await call(node.home, control_ops.OPS))["ops"]
            assert set(ops) == set(control_ops.ALL)  # every op it serves is declared where clients find it
            for op in ops:
                for params in hostile:
                    (reply,) = await exchange(path, json.dumps({"op": op, **params}).encode() + b"\n")
                    assert isinstance(reply["ok"], bool), (op, params, reply)
                    assert (await call(node.home, control_ops.PING))["started"], f"{op} {params} stopped the node"
            status = await call(node.home, control_ops.STATUS)
        assert status["control"]["rejected"].get("connection_error", 0) == 0
        node.stop()
