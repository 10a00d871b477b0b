"""Does the DHT lookup that runs beside every fetch slow a fetch among connected peers?

    PYTHONPATH=. .venv/bin/python bench/dht_fetch.py                 # 3 peers, 30 rounds, table
    PYTHONPATH=. .venv/bin/python bench/dht_fetch.py --rounds 60 --json

Three full peers in this process with the Kad-DHT on (as ``p2ptrain node start`` runs by default),
all connected (heartbeats). Peer A adds fresh files; peer B fetches each one, alternately with the
DHT lookup in parallel (what a fetch does now) and with the connected peers only (what it did
before, ``ContentService.routing`` set aside for that fetch). Both modes run in the same process,
interleaved, so the machine's load hits both alike; report the ratio of the medians.
Sizes: a one-block file (4 KiB: a task file, a manifest) and a 4 MiB DAG (a shard, a checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import trio

from p2ptrain.testing import local_peers, wait_until

SIZES = {"4KiB": 4 * 1024, "4MiB": 4 * 1024 * 1024}


async def bench(rounds: int) -> dict[str, dict[str, float]]:
    times: dict[str, dict[str, list[float]]] = {size: {"connected": [], "parallel": []} for size in SIZES}
    with tempfile.TemporaryDirectory() as tmp:
        async with local_peers(3, Path(tmp), dht=True) as peers:
            a, b = peers[0], peers[1]
            for peer in peers:  # peers join the DHT routing tables DHT_DELAY_S after connecting
                dht = peer.node.discovery.dht  # type: ignore[union-attr]
                await wait_until(lambda: dht.get_routing_table_size() >= 2, 30.0, what="DHT routing tables")
            routing = b.content.routing
            assert routing is not None
            for i in range(rounds):
                for size, n in SIZES.items():
                    for mode in (("connected", "parallel") if i % 2 else ("parallel", "connected")):
                        cid = a.content.store.add_bytes(os.urandom(n))
                        b.content.routing = None if mode == "connected" else routing
                        start = time.perf_counter()
                        await b.content.fetch(cid, timeout=30.0)
                        times[size][mode].append(time.perf_counter() - start)
                        b.content.routing = routing
    out: dict[str, dict[str, float]] = {}
    for size, modes in times.items():
        connected = statistics.median(modes["connected"])
        parallel = statistics.median(modes["parallel"])
        out[size] = {"connected_ms": connected * 1e3, "parallel_ms": parallel * 1e3, "ratio": parallel / connected}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = trio.run(bench, args.rounds)
    if args.json:
        print(json.dumps(out))
        return
    print(f"{'size':>6} {'connected only':>15} {'with DHT lookup':>16} {'ratio':>6}")
    for size, row in out.items():
        print(f"{size:>6} {row['connected_ms']:>12.1f} ms {row['parallel_ms']:>13.1f} ms {row['ratio']:>6.2f}")


if __name__ == "__main__":
    main()
