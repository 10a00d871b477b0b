"""Mesh benchmarks: how fast 4 peers find each other, and how fast a control message crosses the mesh.

    .venv/bin/python bench/mesh.py [--runs 3] [--messages 100]

1. Dialing, in one process: a full mesh of 4 hosts connected with py-libp2p's ``host.connect``
   (the baseline: ~250 ms "happy eyeballs" wait per dial) and with our dial path
   (``Swarm.dial_addr`` with the peer ID known), all pairs in parallel. Ratio in the same run.
2. Start-up, 4 ``p2ptrain node start`` processes started at once, each bootstrapping from the other
   three: wall time from launch to "3 peers seen" at every node, and — measured inside each node —
   from its listeners being up (``listening_at``) to its third peer's first heartbeat (``first_seen``).
3. The same for 4 processes that run a bare Node (this script in ``--peer`` mode).
4. Latency, 4 peer processes (this script in ``--peer`` mode, a Node plus a handler): peer 0
   publishes signed control messages; each of the other 3 records arrival time - send time
   (one machine, one clock). Reported as median and p90 over all deliveries.

Every wait is bounded. The machine is small and shared: report medians and the spread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import trio

from p2ptrain.wire import MESSAGES, message

BENCH_MESSAGES = MESSAGES.copy()  # the package's types plus ours; the package's registry is untouched


@message("bench.ping", into=BENCH_MESSAGES)
@dataclass(frozen=True)
class BenchPing:
    n: int
    sent_at: float

TOPIC = "bench/ping"


# -- 1. dialing ---------------------------------------------------------------------------------


async def _dial_full_mesh(use_connect: bool) -> float:
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.peerinfo import PeerInfo
    from multiaddr import Multiaddr

    from p2ptrain.net import make_host

    listen = [Multiaddr("/ip4/127.0.0.1/tcp/0")]
    hosts = [make_host(create_new_key_pair(), listen) for _ in range(4)]
    async with trio.open_nursery() as outer:
        stop = trio.Event()
        ready = []

        async def run(h):
            async with h.run(listen_addrs=listen):
                ev = trio.Event()
                ready.append(ev)
                ev.set()
                await stop.wait()
                await h.close()

        for h in hosts:
            outer.start_soon(run, h)
        with trio.fail_after(20):
            while len(ready) < 4:
                await trio.sleep(0.01)

        async def dial(a, b):
            if use_connect:
                await a.connect(PeerInfo(b.get_id(), b.get_addrs()))
            else:
                a.get_peerstore().add_addrs(b.get_id(), b.get_addrs(), 600)
                await a.get_network().dial_addr(b.get_addrs()[0], b.get_id())

        t0 = time.perf_counter()
        with trio.fail_after(30):
            async with trio.open_nursery() as n:
                for i in range(4):
                    for j in range(i + 1, 4):
                        n.start_soon(dial, hosts[i], hosts[j])
        elapsed = time.perf_counter() - t0
        stop.set()
    return elapsed


def bench_dialing(runs: int) -> dict:
    base = [trio.run(_dial_full_mesh, True) for _ in range(runs)]
    ours = [trio.run(_dial_full_mesh, False) for _ in range(runs)]
    return {"connect_s": base, "dial_addr_s": ours, "ratio": statistics.median(base) / statistics.median(ours)}


# -- 2. start-up of 4 node processes ------------------------------------------------------------


def bench_startup(runs: int) -> list[dict]:
    from p2ptrain.testing import node_processes, wait_for

    results = []
    for _ in range(runs):
        with tempfile.TemporaryDirectory(dir="/tmp") as base:
            launched = time.time()
            with node_processes(4, Path(base)) as procs:
                statuses = wait_for(
                    lambda: (s := [p.status() for p in procs]) and all(len(x["peers"]) == 3 for x in s) and s,
                    timeout=30,
                    interval=0.01,
                )
                all_seen = time.time()
            results.append(_readiness(statuses=statuses, launched=launched, polled_all_seen=all_seen))
    return results


def _readiness(statuses: list[dict], launched: float, polled_all_seen: float | None = None) -> dict:
    """From each node's own clock readings: when its listeners came up, when it first heard its 3rd peer."""
    up = [s["listening_at"] for s in statuses]
    third = [max(p["first_seen"] for p in s["peers"]) for s in statuses]
    return {
        "launch_to_listeners_up_s": [u - launched for u in up],
        # The mesh cannot be complete before the last node listens: measure from there.
        "last_listener_up_to_all_seen_s": max(third) - max(up),
        "launch_to_all_seen_s": (polled_all_seen or max(third)) - launched,
    }


# -- 3. latency ---------------------------------------------------------------------------------


async def _peer(index: int, home: Path, port: int, bootstrap: list[str], messages: int, interval: float) -> None:
    import torch  # noqa: F401  (as `node start` does; else the node's GPU probe imports it mid-measurement)

    from p2ptrain.node import Node, NodeConfig

    node = Node(home, NodeConfig(listen=[f"/ip4/127.0.0.1/tcp/{port}"], bootstrap=bootstrap), messages=BENCH_MESSAGES)
    received: list[tuple[int, float]] = []
    node.on(BenchPing, lambda signed, topic: received.append((signed.msg.n, time.time() - signed.msg.sent_at)))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            await node.subscribe(TOPIC)
            with trio.fail_after(60):
                await node.membership.wait_until(lambda m: len(m.alive()) >= 3)
                for rec in node.membership.alive():
                    await node.pubsub.wait_for_subscription(rec.peer_id, TOPIC, timeout=30)
            print(json.dumps({"event": "ready", "peer": index, "status": node.status().to_json()}), flush=True)
            if index == 0:
                await trio.sleep(1.0)  # everyone ready and meshed
                for n in range(messages):
                    await node.publish(TOPIC, BenchPing(n=n, sent_at=time.time()))
                    await trio.sleep(interval)
                await trio.sleep(2.0)
            else:
                with trio.move_on_after(60):
                    while len(received) < messages:
                        await trio.sleep(0.05)
                latencies = [latency for _, latency in received]
                print(json.dumps({"event": "received", "peer": index, "latencies": latencies}), flush=True)
            node.stop()

    await main()


def bench_latency(messages: int, interval: float) -> dict:
    from p2ptrain.base import load_or_create_identity, peer_id_of
    from p2ptrain.testing import free_port

    with tempfile.TemporaryDirectory(dir="/tmp") as base:
        homes = [Path(base) / f"p{i}" for i in range(4)]
        ports = [free_port() for _ in homes]
        ids = [peer_id_of(load_or_create_identity(h)).to_base58() for h in homes]
        addrs = [f"/ip4/127.0.0.1/tcp/{p}/p2p/{i}" for p, i in zip(ports, ids)]
        procs = []
        for i, home in enumerate(homes):
            boot = [a for j, a in enumerate(addrs) if j != i]
            cmd = [sys.executable, __file__, "--peer", str(i), "--home", str(home), "--port", str(ports[i]),
                   "--messages", str(messages), "--interval", str(interval), "--bootstrap", *boot]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
        launched = time.time()
        latencies: list[float] = []
        counts = []
        statuses = []
        for p in procs:
            out, _ = p.communicate(timeout=180)
            print(out, file=sys.stderr) if os.environ.get("BENCH_DEBUG") else None
            for line in out.splitlines():
                event = json.loads(line)
                if event["event"] == "ready":
                    statuses.append(event["status"])
                if event["event"] == "received":
                    latencies += event["latencies"]
                    counts.append(len(event["latencies"]))
    latencies.sort()
    return {
        "messages": messages,
        "delivered_per_peer": counts,
        "median_ms": 1000 * statistics.median(latencies),
        "p90_ms": 1000 * latencies[int(0.9 * (len(latencies) - 1))],
        "max_ms": 1000 * latencies[-1],
        "readiness": _readiness(statuses, launched),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--messages", type=int, default=100)
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between control messages")
    parser.add_argument("--only-latency", action="store_true", help="skip parts 1 and 2")
    parser.add_argument("--peer", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--home", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap", nargs="*", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer is not None:
        import logging

        logging.getLogger("libp2p").setLevel(logging.CRITICAL)  # redials of a stopped peer are expected
        trio.run(_peer, args.peer, args.home, args.port, args.bootstrap, args.messages, args.interval)
        return

    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start")
    if not args.only_latency:
        _dial_and_startup(args.runs)
    lat = bench_latency(args.messages, args.interval)
    print("3. 4 processes running a bare Node (no content/task services), started at once:")
    _print_readiness(lat["readiness"])
    print(f"4. control message every {args.interval} s, publish -> delivery at 3 peers ({lat['messages']} messages, "
          f"delivered {lat['delivered_per_peer']}): median {lat['median_ms']:.1f} ms, p90 {lat['p90_ms']:.1f} ms, "
          f"max {lat['max_ms']:.1f} ms")
    print(f"load average {os.getloadavg()[0]:.1f} at end")


def _dial_and_startup(runs: int) -> None:
    dial = bench_dialing(runs)
    print("1. full mesh of 4 hosts, all 6 dials in parallel:")
    print(f"   host.connect (baseline) {_fmt(dial['connect_s'])}   dial_addr (ours) {_fmt(dial['dial_addr_s'])}"
          f"   -> {dial['ratio']:.1f}x faster")
    print("2. 4 `p2ptrain node start` processes started at once:")
    for r in bench_startup(runs):
        _print_readiness(r)


def _print_readiness(r: dict) -> None:
    print(f"   launch -> listeners up {_fmt(r['launch_to_listeners_up_s'])}; last listener up -> every node has "
          f"seen 3 peers {r['last_listener_up_to_all_seen_s']:.3f} s; launch -> all seen {r['launch_to_all_seen_s']:.2f} s")


def _fmt(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in values) + "] s"


if __name__ == "__main__":
    main()
