"""``p2ptrain model serve``: a real server process answered over real HTTP.

One server process (module-scoped) is checked several ways: its predictions equal ``model eval``'s
on the same inputs (also through ``model predict``), hostile requests get a 4xx with a reason and
leave it serving, and a client that disconnects mid-request ends only its own request. The head
swap under a burst runs in-process (the server's own trio nursery, real HTTP from threads), driven
through the same follower path ``--latest`` uses.
"""

from __future__ import annotations

import json
import select
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from libp2p.crypto.ed25519 import create_new_key_pair
import trio

import p2ptrain

from p2ptrain.cli.main import main
from p2ptrain.data import IPFSDataset, build_dataset, load_source
from p2ptrain.base import load_or_create_identity
from p2ptrain.ipfs import open_store
from p2ptrain.serve import ServeError, predict
from p2ptrain.serve._server import load_served
from p2ptrain.serve._input_spec import MAX_BODY_BYTES, InputError, parse_request, spec_for
from p2ptrain.testing import attestations_for, proven_record, start_forked, wait_until
from p2ptrain.models import build_model
from p2ptrain.protocol._lineage import entry_bytes
from p2ptrain.protocol import model_bytes
from p2ptrain.wire import ConfirmedRecord, ModelRecord

P2PTRAIN = str(Path(sys.executable).with_name("p2ptrain"))
CARD = {"name": "mlp", "kwargs": {"in_features": 64, "hidden": [32], "out_features": 10}}
# The server process prints its URL once listening: importing torch and hypercorn on a loaded
# 2-core machine takes a few seconds.
START_DEADLINE_S = 60.0
# Any one request or CLI call in these tests.
CALL_DEADLINE_S = 60.0


def _model_cid(store, seed: int) -> str:
    return store.add_bytes(model_bytes(build_model(CARD["name"], CARD["kwargs"], seed), CARD), cid_version=1)


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """A home with two models and the digits dataset, and a server process of the first model (started
    before the dataset is built: both take seconds)."""
    home = tmp_path_factory.mktemp("serve-home")
    store = open_store(home)
    h = {"home": home, "model": _model_cid(store, 1), "other": _model_cid(store, 2)}
    proc = start_forked(
        [P2PTRAIN, "model", "serve", h["model"], "--home", str(home), "--listen", "127.0.0.1:0",
         "--max-batch", "64", "--max-wait-ms", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        name, features, labels = load_source("sklearn:digits")
        h["dataset"], _ = build_dataset(store, name, features, labels, 2)
        ready, _, _ = select.select([proc.stdout], [], [], START_DEADLINE_S)
        line = proc.stdout.readline() if ready else ""
        assert line.startswith("serving "), (line, proc.poll(), proc.stderr.read() if proc.poll() is not None else "")
        h["url"] = line.split(" at ")[1].split()[0]
        yield h
    finally:
        proc.terminate()
        proc.wait(timeout=CALL_DEADLINE_S)


@pytest.fixture(scope="module")
def server(home: dict) -> str:
    return home["url"]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=CALL_DEADLINE_S) as answer:
        return json.loads(answer.read())


def _raw(url: str, request: bytes, close_early: bool = False) -> bytes:
    """Send raw bytes to the server; its whole answer (b"" if we hang up first)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=CALL_DEADLINE_S) as sock:
        try:
            sock.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered (413) and closed before taking all of it
        if close_early:
            return b""
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:
            pass
        return b"".join(chunks)


def _post(body: bytes, length: int | None = None) -> bytes:
    length = len(body) if length is None else length
    return (b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: " + str(length).encode() + b"\r\n\r\n" + body)


def test_predictions_equal_model_eval_on_the_same_inputs(home: dict, server: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    rows = [(x, int(y)) for x, y in IPFSDataset(home["dataset"], split="test", home=home["home"], shuffle=False)]
    inputs = [x.tolist() for x, _ in rows]
    labels = torch.tensor([y for _, y in rows])
    chunks = [inputs[i:i + 37] for i in range(0, len(inputs), 37)]  # uneven: the batcher splits and carries
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda chunk: predict(server, chunk), chunks))
    assert {a["model_cid"] for a in answers} == {home["model"]}
    logits = torch.tensor([out for a in answers for out in a["outputs"]])
    assert logits.shape == (len(rows), 10)

    # model eval and model predict run in this process (the CLI's own main): a second interpreter
    # importing torch costs seconds.
    assert main(["model", "eval", home["model"], "--dataset", home["dataset"], "--json", "--home", str(home["home"])]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["samples"] == len(rows)
    assert (logits.argmax(1) == labels).float().mean().item() == pytest.approx(result["accuracy"], abs=1e-9)
    assert torch.nn.functional.cross_entropy(logits, labels).item() == pytest.approx(result["loss"], rel=1e-5)

    (tmp_path / "in.json").write_text(json.dumps({"inputs": inputs[:3]}))
    assert main(["model", "predict", home["model"], str(tmp_path / "in.json"), "--url", server]) == 0
    assert torch.allclose(torch.tensor(json.loads(capsys.readouterr().out)["outputs"]), logits[:3])
    assert main(["model", "predict", home["other"], str(tmp_path / "in.json"), "--url", server]) == 1
    err = capsys.readouterr().err
    assert err.startswith("p2ptrain: error: ") and "serves" in err and len(err.splitlines()) == 1

    info = _get(server + "/model")
    assert info["model_cid"] == home["model"] and info["model"] == CARD and info["input"]["shape"] == [64]


@pytest.mark.parametrize(("body", "status", "says"), [
    (b'{"inputs": [[1, 2', 400, "not JSON"),
    (b'{"inputs": [[1.0, 2.0]]}', 400, "shape [64]"),
    (b'{"inputs": [[' + b"1," * 63 + b'"x"]]}', 400, "lists of numbers"),
    (b'{"inputs": []}', 400, "1 to"),
    (b'{"input": [[0]]}', 400, "JSON object"),
    (b"[" * 10_000, 400, "nested"),
    (b'{"inputs": [' + b",".join([b"[" + b"0," * 63 + b"0]"] * 1025) + b"]}", 400, "1 to 1024"),
])
def test_a_bad_request_gets_a_4xx_with_its_reason_and_the_server_serves_on(server: str, body: bytes, status: int,
                                                                           says: str) -> None:
    answer = _raw(server, _post(body))
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status}".encode()), answer[:200]
    assert says in json.loads(payload)["error"]
    assert len(predict(server, [[0.0] * 64])["outputs"]) == 1


def test_huge_bodies_and_clients_that_hang_up_leave_the_server_serving(server: str) -> None:
    announced = _raw(server, _post(b"", length=MAX_BODY_BYTES + 1))  # refused before a byte is read
    assert announced.startswith(b"HTTP/1.1 413"), announced[:200]
    chunked = (b"POST /predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
               + (b"%x\r\n" % (1 << 20) + b" " * (1 << 20) + b"\r\n") * 9)  # no length given: counted as read
    _raw(server, chunked)  # the 413 may be lost to the reset of a connection closed mid-upload: counted
    rejected = _get(server + "/health")["rejected"]
    assert rejected["too_large"] >= 2
    before = rejected.get("disconnected", 0)
    _raw(server, _post(b'{"inputs": [[0', length=1000), close_early=True)  # gone mid-body
    _raw(server, _post(json.dumps({"inputs": [[0.0] * 64] * 512}).encode()), close_early=True)  # gone before the answer
    for _ in range(int(CALL_DEADLINE_S * 10)):  # the server notices the first hang-up when the socket closes
        if _get(server + "/health")["rejected"].get("disconnected", 0) > before:
            break
        time.sleep(0.1)
    health = _get(server + "/health")
    assert health["status"] == "ok" and health["rejected"]["disconnected"] > before
    assert len(predict(server, [[0.0] * 64] * 3)["outputs"]) == 3
    with pytest.raises(ServeError, match="404"):
        _get_or_raise(server + "/nothing")


def _get_or_raise(url: str) -> None:
    try:
        _get(url)
    except urllib.error.HTTPError as exc:
        raise ServeError(f"{exc.code}") from None


def test_token_inputs_are_checked_for_integers_range_and_length() -> None:
    spec = spec_for({"name": "transformer_lm", "kwargs": {"vocab_size": 50, "context": 8}})
    assert parse_request(b'{"inputs": [[1, 2, 3]]}', spec).dtype == torch.int64
    for body, says in [(b'{"inputs": [[1.5]]}', "integers"), (b'{"inputs": [[50]]}', "[0, 50)"),
                       (b'{"inputs": [[' + b"1," * 8 + b"1]]}", "1 to 8"), (b'{"inputs": [[-1]]}', "[0, 50)")]:
        with pytest.raises(InputError, match=says.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
            parse_request(body, spec)
    big = spec_for({"name": "transformer_lm", "kwargs": {"vocab_size": 4096, "context": 64}})
    assert len(parse_request(json.dumps({"inputs": [[1] * 64] * 7}).encode(), big)) == 7
    with pytest.raises(InputError, match="2097152 numbers"):  # 8 x 64 x 4096 logits: a 40 MB answer
        parse_request(json.dumps({"inputs": [[1] * 64] * 8}).encode(), big)


async def test_a_head_swap_during_a_burst_loses_no_request(home: dict) -> None:
    store = open_store(home["home"])
    # The home holds the chain of a task whose v1 is the second model: GET /model tells its record.
    task = store.add_bytes(b"a task", cid_version=1)
    keys = [load_or_create_identity(home["home"])] + [create_new_key_pair() for _ in range(2)]
    record = ModelRecord(task_cid=task, version=1, parent=home["model"], round=9, step=10, members=(),
                         metrics={"accuracy": 0.5}, model_cid=home["other"], optimizer_cid=home["other"], term=1,
                         coordinator="")
    signed = proven_record(record, keys[0], keys)
    line = entry_bytes(ConfirmedRecord(signed=signed, attestations=attestations_for(signed.record, keys[:2])))
    (home["home"] / "tasks" / task).mkdir(parents=True)
    (home["home"] / "tasks" / task / "chain.jsonl").write_bytes(line + b"\n")
    first = load_served(store, home["model"], torch.device("cpu"), home["home"])
    second = load_served(store, home["other"], torch.device("cpu"), home["home"])
    assert first.info["task_cid"] is None
    assert {k: second.info[k] for k in ("task_cid", "version", "step", "metrics", "members", "attestations")} == {
        "task_cid": task, "version": 1, "step": 10, "metrics": {"accuracy": 0.5}, "members": 3, "attestations": 2}
    head = [home["model"]]
    # The Python API's --latest: resolve() names the task's head (the CLI's resolve asks the node or the mesh).
    server = p2ptrain.serve.open_model(latest=task, resolve=lambda: head[0], home=home["home"], device="cpu",
                                       listen="127.0.0.1:0", max_batch=16, max_wait_ms=1, follow_every_s=0.01)
    assert server.batcher.current.cid == home["model"]
    x = torch.randn(4, 64)
    expected = {cid: loaded.module(x).detach() for cid, loaded in ((home["model"], first), (home["other"], second))}
    answers: list[dict] = []

    async def client(url: str) -> None:
        for _ in range(15):
            answers.append(await trio.to_thread.run_sync(predict, url, x.tolist()))
            if len(answers) == 60:
                head[0] = home["other"]  # the task's next confirmed head: swapped in mid-burst

    with trio.fail_after(CALL_DEADLINE_S):
        async with trio.open_nursery() as nursery:
            url = await nursery.start(server.run)
            async with trio.open_nursery() as clients:
                for _ in range(16):
                    clients.start_soon(client, url)
            nursery.cancel_scope.cancel()
    assert len(answers) == 16 * 15
    seen = [a["model_cid"] for a in answers]
    assert seen[0] == home["model"] and seen[-1] == home["other"], "the burst did not span the swap"
    for answer in answers:
        assert torch.allclose(torch.tensor(answer["outputs"]), expected[answer["model_cid"]], atol=1e-6)
    assert server.batcher.counts["requests"] == len(answers) and server.follow_failures == 0
    assert server.batcher.current.info["step"] == 10


def test_serve_refuses_in_one_line_without_hypercorn_a_device_or_an_address(
        home: dict, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["model", "serve", home["model"], "--home", str(home["home"]), "--listen", "127.0.0.1:0"]
    assert main(argv + ["--device", "tpu:3"]) == 1
    assert capsys.readouterr().err.startswith("p2ptrain: error: --device 'tpu:3'")
    assert main(["model", "serve", "--home", str(home["home"])]) == 1
    assert "one of them" in capsys.readouterr().err
    assert main(argv[:-1] + ["127.0.0.1"]) == 1
    assert capsys.readouterr().err.startswith("p2ptrain: error: --listen '127.0.0.1': give HOST:PORT")
    assert main(argv + ["--max-connections", "0"]) == 1
    assert capsys.readouterr().err.strip() == "p2ptrain: error: --max-connections must be 1 to 4096"
    assert main(argv[:-1] + [home["url"].removeprefix("http://")]) == 1  # the server process holds that port
    err = capsys.readouterr().err
    assert err.startswith(f"p2ptrain: error: cannot listen on {home['url'].removeprefix('http://')}: ")
    assert len(err.splitlines()) == 1
    monkeypatch.setitem(sys.modules, "hypercorn", None)  # import hypercorn raises ImportError
    assert main(argv) == 1
    assert capsys.readouterr().err.strip() == "p2ptrain: error: model serve needs hypercorn: pip install 'p2ptrain[serve]'"


async def test_bodies_in_flight_and_queued_samples_are_bounded_with_503(home: dict) -> None:
    from p2ptrain.serve._app import MAX_BODY_BYTES_IN_FLIGHT, ServeApp
    from p2ptrain.serve._batcher import MAX_QUEUED_SAMPLES, Batcher

    loaded = load_served(open_store(home["home"]), home["model"], torch.device("cpu"))
    app = ServeApp(Batcher(loaded, 64, 0.001))  # its batch loop is not running: requests stay queued
    body = json.dumps({"inputs": [[0.0] * 64] * 1024}).encode()

    async def post() -> int:
        sent: list[dict] = []

        async def receive() -> dict:
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "path": "/predict", "method": "POST",
                 "headers": [(b"content-length", str(len(body)).encode())]}
        async with trio.open_nursery() as nursery:  # a queued request waits for the batch loop: not running
            nursery.start_soon(app, scope, receive, send)
            await wait_until(lambda: sent or app.batcher.queued, CALL_DEADLINE_S, what="answered or queued")
            nursery.cancel_scope.cancel()
        return sent[0]["status"] if sent else 0

    app.reading = MAX_BODY_BYTES_IN_FLIGHT - len(body) + 1  # other uploads hold all but a byte too few
    assert await post() == 503 and app.rejected["busy"] == 1
    app.reading = 0
    app.batcher.queued_samples = MAX_QUEUED_SAMPLES - 1023
    assert await post() == 503 and app.rejected["busy"] == 2
    app.batcher.queued_samples = 0
    assert await post() == 0 and app.batcher.queued_samples == 1024 and app.reading == 0


# How long a connection past the cap is watched for an answer it must not get while the cap is
# full: without the cap it is accepted and answered in milliseconds.
QUEUED_WATCH_S = 1.0
# A connection its client closed frees its slot at once; hypercorn alone keeps one that was idle
# until its keep-alive timer (server.KEEP_ALIVE_S, 30 s) fires.
RELEASE_S = 10.0
HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


async def _response(stream: trio.SocketStream) -> bytes:
    """One HTTP response off a keep-alive connection: head, then Content-Length bytes of body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some(65536)
        assert chunk, f"connection closed after {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += await stream.receive_some(65536)
    return head + b"\r\n\r\n" + body


async def test_connections_past_the_cap_wait_unaccepted_while_the_open_ones_are_served(home: dict) -> None:
    from p2ptrain.serve import Server

    loaded = load_served(open_store(home["home"]), home["model"], torch.device("cpu"))
    server = Server(loaded, listen="127.0.0.1:0", max_connections=2)
    with trio.fail_after(CALL_DEADLINE_S):
        async with trio.open_nursery() as nursery:
            host, port = (await nursery.start(server.run)).removeprefix("http://").split(":")
            kept = await trio.open_tcp_stream(host, int(port))  # a keep-alive client
            await kept.send_all(HEALTH)
            assert (await _response(kept)).startswith(b"HTTP/1.1 200")
            idle = await trio.open_tcp_stream(host, int(port))  # kept alive, idle: holds the second slot
            await idle.send_all(HEALTH)
            assert (await _response(idle)).startswith(b"HTTP/1.1 200")
            assert server.connections == 2
            queued = await trio.open_tcp_stream(host, int(port))  # the kernel takes it; the server does not
            await queued.send_all(HEALTH)
            await kept.send_all(HEALTH)  # the open connections are served meanwhile
            assert (await _response(kept)).startswith(b"HTTP/1.1 200")
            with trio.move_on_after(QUEUED_WATCH_S):
                early = await queued.receive_some(65536)
                pytest.fail(f"a connection past the cap was answered: {early!r}")
            assert server.connections == 2
            await idle.aclose()  # its slot frees: the waiting connection is accepted and answered
            with trio.fail_after(RELEASE_S):
                assert (await _response(queued)).startswith(b"HTTP/1.1 200")
            nursery.cancel_scope.cancel()
