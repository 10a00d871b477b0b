"""``model serve`` under slow and big request bodies (issue 27): the chaos bench's hostile clients
(bench/hostile_bounds.py) over real HTTP and TCP against a server running in this trio loop.

- Clients that declare large bodies and trickle them hold no budget for bytes that have not come,
  so honest requests are answered, not refused with 503.
- A body has one deadline for all of it, not one per read: a trickler is cut off with 408.
- Bodies are capped by what a request for the served model can hold, and parsed off the event
  loop: big bodies do not stall the honest requests beside them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import torch
import trio

from p2ptrain.ipfs import EmbeddedStore
from p2ptrain.serve import Server
from p2ptrain.serve._server import load_served
from p2ptrain.models import build_model
from p2ptrain.protocol import model_bytes

from .test_model_bomb import bounds

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


async def test_trickling_clients_that_declare_big_bodies_do_not_get_honest_requests_refused(tmp_path: Path) -> None:
    """Before: the declared length was charged up front, so 32 clients declaring 8 MiB (and 100
    declaring what a digits request may hold) took the 256 MiB budget (254 MiB held here). Now 8 MiB
    is over what this model's requests take (413 at once), and a body in flight is charged only for
    the bytes that came."""
    async with serving(tmp_path) as (host, port, server):
        cap = server.batcher.current.spec.max_body_bytes
        stop = trio.Event()
        statuses: list[int] = []
        with trio.fail_after(DEADLINE_S):
            async with trio.open_nursery() as nursery:
                async def one(declared: int) -> None:
                    statuses.append(await bounds.trickle(host, port, declared, stop))

                for declared in [bounds.TRICKLE_DECLARED] * bounds.TRICKLERS + [cap] * 100:
                    nursery.start_soon(one, declared)
                await trio.sleep(1.0)  # every trickler is in, and sending
                honest = [(await bounds.post(host, port, HONEST))[0] for _ in range(5)]
                held = server.app.reading
                stop.set()
        assert honest == [200] * 5
        assert held < 1 << 20  # the bytes that came, not the 350 MB declared
        assert statuses.count(413) == bounds.TRICKLERS  # over this model's cap


async def test_a_body_that_does_not_arrive_whole_in_time_is_cut_off_with_408(tmp_path: Path) -> None:
    """Before: hypercorn's timeout is per read, so a byte every 0.2 s held the request for ever."""
    async with serving(tmp_path, body_timeout_s=1.0) as (host, port, server):
        with trio.fail_after(DEADLINE_S):
            started = trio.current_time()
            status = await bounds.trickle(host, port, 100_000, trio.Event())
            took = trio.current_time() - started
        assert status == 408
        assert took < 10
        assert server.app.rejected["slow_body"] == 1 and server.app.reading == 0


async def test_big_bodies_beside_honest_requests_leave_their_latency_near_its_baseline(tmp_path: Path) -> None:
    """Before: four 6.7 MB bodies at a time, parsed on the event loop, took honest p50 from ~10 ms
    to ~1 s (100x). Now a body over what 1,024 digits samples take is refused by its length, and
    one that fits is parsed in a worker thread. The bound asserted is the issue's (100x); the chaos
    bench (``serve_bodies``) reports the ratio."""
    big, biggest = bounds.big_body(1024), bounds.big_body()
    async with serving(tmp_path) as (host, port, server):
        assert len(big) <= server.batcher.current.spec.max_body_bytes < len(biggest)
        with trio.fail_after(DEADLINE_S * 2):
            base = await bounds.honest_p50(host, port, HONEST)
            seen = await bounds.slow_and_big_bodies(host, port, 4.0, HONEST, tricklers=0,
                                                    big=(big, big, biggest, biggest))
        assert set(seen["honest"]) == {200}
        assert seen["big"].get(200) and seen["big"].get(413)  # the big ones answered, the biggest refused
        assert seen["honest_p50_s"] / base < 100, (seen, base)
