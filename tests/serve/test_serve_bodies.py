"""``model serve`` under slow and big request bodies (issue 27): real HTTP over TCP to a server
running in this process's trio loop, the attackers' sockets and the honest client's side by side.

- Clients that declare large bodies and trickle them hold no budget for bytes that have not come,
  so honest requests are answered, not refused with 503.
- A body has one deadline for all of it, not one per read: a trickler is cut off with 408.
- Bodies are capped by what a request for the served model can hold, and parsed off the event
  loop: big bodies do not stall the honest requests beside them.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import torch
import trio

from p2ptrain.ipfs.embedded import EmbeddedStore
from p2ptrain.serve.server import Server, load_served
from p2ptrain.training.models import build_model
from p2ptrain.training.records import model_bytes

CARD = {"name": "mlp", "kwargs": {"in_features": 64, "hidden": [32], "out_features": 10}}
DEADLINE_S = 60.0
HONEST = json.dumps({"inputs": [[0.5] * 64] * 4}).encode()


@asynccontextmanager
async def serving(tmp_path: Path, **kwargs) -> AsyncIterator[tuple[str, int, Server]]:
    store = EmbeddedStore(tmp_path)
    cid = store.add_bytes(model_bytes(build_model(CARD["name"], CARD["kwargs"], 1), CARD))
    server = Server(load_served(store, cid, torch.device("cpu")), listen="127.0.0.1:0", max_wait_ms=1, **kwargs)
    async with trio.open_nursery() as nursery:
        host, port = (await nursery.start(server.run)).removeprefix("http://").split(":")
        yield host, int(port), server
        nursery.cancel_scope.cancel()


def head(length: int) -> bytes:
    return (b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: " + str(length).encode() + b"\r\n\r\n")


async def answer(stream: trio.SocketStream) -> bytes:
    """Everything the server sends until it closes (a request sent with Connection: close)."""
    data = b""
    try:
        while chunk := await stream.receive_some(65536):
            data += chunk
    except trio.BrokenResourceError:
        pass
    return data


async def post(host: str, port: int, body: bytes) -> tuple[int, float]:
    """One request: its status and its latency in seconds."""
    started = time.perf_counter()
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        try:
            await stream.send_all(head(len(body)) + body)
        except trio.BrokenResourceError:
            pass  # answered (413) and closed before the body was taken
        data = await answer(stream)
    return int(data.split(b" ", 2)[1]), time.perf_counter() - started


async def trickle(host: str, port: int, declared: int, stop: trio.Event, every_s: float = 0.2) -> bytes:
    """Declare ``declared`` bytes and send one every ``every_s`` until ``stop`` or the server answers."""
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        await stream.send_all(head(declared) + b'{"inputs": [')
        async with trio.open_nursery() as nursery:
            got: list[bytes] = []

            async def read() -> None:
                got.append(await answer(stream))
                nursery.cancel_scope.cancel()

            nursery.start_soon(read)
            while not stop.is_set():
                with trio.move_on_after(every_s):
                    await stop.wait()
                try:
                    await stream.send_all(b" ")
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    break
            nursery.cancel_scope.cancel()
        return got[0] if got else b""


async def test_trickling_clients_that_declare_big_bodies_do_not_get_honest_requests_refused(tmp_path: Path) -> None:
    """Before: the declared length was charged up front, so 32 clients declaring 8 MiB (or 100
    declaring what a digits request may hold) took the whole 256 MiB budget and every honest request
    got 503 until they went away. Now 8 MiB is over what this model's requests take (413 at once),
    and a body in flight is charged only for the bytes that came."""
    async with serving(tmp_path) as (host, port, server):
        cap = server.batcher.current.spec.max_body_bytes
        stop = trio.Event()
        answers: list[bytes] = []
        with trio.fail_after(DEADLINE_S):
            async with trio.open_nursery() as nursery:
                async def one(declared: int) -> None:
                    answers.append(await trickle(host, port, declared, stop))

                for declared in [8 << 20] * 32 + [cap] * 100:
                    nursery.start_soon(one, declared)
                await trio.sleep(1.0)  # every trickler is in, and sending
                statuses = [(await post(host, port, HONEST))[0] for _ in range(5)]
                held = server.app.reading
                stop.set()
        assert statuses == [200] * 5
        assert held < 1 << 20  # the bytes that came, not the 350 MB declared
        assert sum(a.startswith(b"HTTP/1.1 413") for a in answers) == 32  # over this model's cap


async def test_a_body_that_does_not_arrive_whole_in_time_is_cut_off_with_408(tmp_path: Path) -> None:
    """Before: hypercorn's timeout is per read, so a byte every 0.2 s held the request forever."""
    async with serving(tmp_path, body_timeout_s=1.0) as (host, port, server):
        stop = trio.Event()
        with trio.fail_after(DEADLINE_S):
            started = trio.current_time()
            got = await trickle(host, port, 100_000, stop)
            took = trio.current_time() - started
        assert got.startswith(b"HTTP/1.1 408"), got[:200]
        assert "did not arrive within 1 s" in json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]
        assert took < 10
        assert server.app.rejected["slow_body"] == 1 and server.app.reading == 0


def big_body(samples: int) -> bytes:
    """Digits-shaped samples of long floats: 1,024 of them are the largest request allowed (2.3 MB);
    more are what the issue sent (6.7 MB, refused for their count only after parsing)."""
    rng = random.Random(0)
    return json.dumps({"inputs": [[rng.random() * 1e-300 for _ in range(64)] for _ in range(samples)]}).encode()


async def test_big_bodies_beside_honest_requests_leave_their_latency_near_its_baseline(tmp_path: Path) -> None:
    """Before: four 6.7 MB bodies at a time, parsed on the event loop, took honest p50 from ~10 ms
    to ~1 s (100x). Now a body over what 1,024 digits samples take is refused by its length, and
    one that fits is parsed in a worker thread. The bound asserted is the issue's (100x); the
    bench (chaos ``serve_big_bodies``) reports the ratio."""
    big, biggest = big_body(1024), big_body(2600)
    async with serving(tmp_path) as (host, port, server):
        assert len(big) <= server.batcher.current.spec.max_body_bytes < len(biggest)
        with trio.fail_after(DEADLINE_S * 2):
            base = [(await post(host, port, HONEST))[1] for _ in range(30)]
            stop = trio.Event()
            statuses: list[int] = []
            async with trio.open_nursery() as nursery:
                async def attacker(body: bytes) -> None:
                    while not stop.is_set():
                        statuses.append((await post(host, port, body))[0])

                for body in (big, big, biggest, biggest):
                    nursery.start_soon(attacker, body)
                await trio.sleep(0.5)
                loaded = [(await post(host, port, HONEST)) for _ in range(30)]
                stop.set()
        assert all(status == 200 for status, _ in loaded)
        assert 200 in statuses and 413 in statuses  # the big ones answered, the biggest refused
        ratio = statistics.median(t for _, t in loaded) / statistics.median(base)
        assert ratio < 100, f"honest p50 {ratio:.0f}x its baseline under big bodies"
