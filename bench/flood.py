"""Flood a real node with hostile pubsub traffic and measure whether it keeps answering.

    PYTHONPATH=. .venv/bin/python bench/flood.py [--rate 1000] [--seconds 10] [--mix junk,fresh,oversized] [--json]

One ``p2ptrain node start`` process is the victim. This process runs the attacker: a bare libp2p
host that opens a pubsub stream to the victim and writes pre-built, pre-signed messages on it, in
one RPC of ``rate * TICK_S`` messages every ``TICK_S`` (py-libp2p's own publish path could not send
more than ~400 msg/s here, and dropped the rest in its outbound queue), at ``--rate`` messages a
second for ``--seconds``, round-robin over the kinds in ``--mix``:

- ``junk``: pubsub-signed by the attacker, payload not a wire frame (dropped as ``malformed``);
- ``fresh``: a wire Heartbeat signed by a fresh identity, relayed under that identity (pubsub
  checks only that the message's origin signed it), 4 closed-port addresses each: what found 7 of
  issue 13 did with 9,000 identities;
- ``oversized``: a signed 80 KB wire frame, over our 64 KiB cap and under pubsub's 1 MiB.

Gossipsub's per-peer rate limit (10 msg/s by default, 1,000 in p2ptrain.net._pubsub) only gates what
a node *forwards*: a message is handed to the node's subscriptions first. So one attacker peer can
deliver 1,000 msg/s to one victim; fresh identities need no connection of their own.
The attacker runs on the same 2-core machine as the victim and competes with it for CPU.

A second process (this script with ``--poll-status``) calls ``node status`` every ``--interval`` s
and records each answer's latency; the calls from the flood's start until the victim has worked
off its backlog (its counters stop moving) are reported, so the measurement does not share the
attacker's interpreter. Reported: status latency p50 and max (and how many calls failed), the
victim's RSS before and after, messages sent, and what the victim counted, by reason.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

MESH_READY_TIMEOUT_S = 30.0
STATUS_TIMEOUT_S = 10.0
SETTLE_S = 3.0  # after the flood, time for the victim to drain its queues before the last count
# Before the flood, the victim's RSS is sampled every RSS_SETTLE_STEP_S until it grows by less than
# RSS_SETTLED_DELTA between samples (bounded by RSS_SETTLE_TIMEOUT_S).
RSS_SETTLE_STEP_S, RSS_SETTLED_DELTA, RSS_SETTLE_TIMEOUT_S = 2.0, 1 << 20, 60.0
TICK_S = 0.01  # the attacker writes one RPC of rate * TICK_S messages every tick
# After the flood: the victim's counters are read every DRAIN_STEP_S until they stop moving.
DRAIN_STEP_S, DRAIN_TIMEOUT_S = 1.0, 120.0


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class _Stop(BaseException):
    """SIGTERM to the poller: report and exit."""


def _settled_rss(pid: int) -> int:
    """The victim's RSS once its start-up is over: a node imports torch a few seconds after it
    is ready (its capability probe), ~100 MB that must not be counted against the flood."""
    last, deadline = -(2**40), time.monotonic() + RSS_SETTLE_TIMEOUT_S
    while (now := _rss_bytes(pid)) - last > RSS_SETTLED_DELTA and time.monotonic() < deadline:
        last = now
        time.sleep(RSS_SETTLE_STEP_S)
    return now


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time the process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def poll_status(home: Path, interval: float) -> None:
    """Child mode: call `node status` every ``interval`` s until SIGTERM; print each call's wall
    time and latency (JSON)."""
    from p2ptrain.control import ControlClient, ops as control_ops

    def stop(signum: int, frame: object) -> None:
        raise _Stop

    signal.signal(signal.SIGTERM, stop)
    client = ControlClient(home, timeout=STATUS_TIMEOUT_S)
    calls: list[tuple[float, float]] = []
    failures: list[tuple[float, str]] = []
    sizes: list[int] = []
    try:
        while True:
            t0, wall = time.monotonic(), time.time()
            try:
                sizes.append(len(json.dumps(client.call(control_ops.STATUS))))
                calls.append((wall, time.monotonic() - t0))
            except Exception as exc:  # a failure is a data point of this bench
                failures.append((wall, f"{type(exc).__name__}: {exc}"[:200]))
            time.sleep(max(0.0, interval - (time.monotonic() - t0)))
    except _Stop:
        pass
    print(json.dumps({"calls": calls, "failures": failures, "max_size": max(sizes, default=0)}))


def _build(kinds: list[str], count: int, attacker_key, topic: str) -> list[tuple[str, Any]]:  # (kind, rpc_pb2.Message)
    """Pre-built, pre-signed pubsub messages, so the attacker spends the flood sending."""
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.pubsub.pb import rpc_pb2
    from libp2p.pubsub.validators import PUBSUB_SIGNING_PREFIX

    from p2ptrain.base import peer_id_of
    from p2ptrain.testing import free_port
    from p2ptrain.wire import Capabilities, Heartbeat, encode

    caps = Capabilities(device="cpu", cpu_count=1, free_ram_bytes=1, version="0")
    addrs = tuple(f"/ip4/127.0.0.1/tcp/{free_port()}" for _ in range(4))
    big = encode(Heartbeat(addrs=(), caps=caps), attacker_key, seq=1) + b"\x00" * 80_000

    def signed(key, data: bytes, seqno: int) -> rpc_pb2.Message:
        msg = rpc_pb2.Message(
            data=data, topicIDs=[topic], from_id=peer_id_of(key).to_bytes(), seqno=seqno.to_bytes(8, "big")
        )
        msg.signature = key.private_key.sign(PUBSUB_SIGNING_PREFIX.encode() + msg.SerializeToString())
        msg.key = key.public_key.serialize()
        return msg

    out = []
    for i in range(count):
        kind = kinds[i % len(kinds)]
        if kind == "junk":
            out.append((kind, signed(attacker_key, b"junk %d" % i, i)))
        elif kind == "oversized":
            out.append((kind, signed(attacker_key, big, i)))
        elif kind == "fresh":
            key = create_new_key_pair()
            hb = encode(Heartbeat(addrs=addrs, caps=caps), key, seq=time.time_ns() // 1000)
            out.append((kind, signed(key, hb, 0)))
        else:
            raise SystemExit(f"unknown --mix kind {kind!r} (junk, fresh, oversized)")
    return out


def _frames(messages: list, per_frame: int) -> list[bytes]:
    """Length-prefixed pubsub RPCs of ``per_frame`` messages each (RPC.publish is a list)."""
    from libp2p.pubsub.pb import rpc_pb2
    from libp2p.utils.varint import encode_uvarint

    frames = []
    for i in range(0, len(messages), per_frame):
        rpc = rpc_pb2.RPC(publish=[m for _, m in messages[i : i + per_frame]]).SerializeToString()
        frames.append(encode_uvarint(len(rpc)) + rpc)
    return frames


def _counted(home: Path) -> int:
    """Every message the victim's router has seen so far (dropped or delivered, any reason)."""
    from p2ptrain.control import ControlClient, ops as control_ops

    messages = ControlClient(home, timeout=STATUS_TIMEOUT_S).call(control_ops.STATUS)["messages"]
    return sum(sum(messages[k].values()) for k in ("dropped", "delivered", "dropped_below_router"))


async def _drain(home: Path) -> float:
    """Wait (bounded) until the victim's counters stop moving: it has worked off its backlog."""
    start, last = trio.current_time(), -1
    with trio.move_on_after(DRAIN_TIMEOUT_S):
        while (now := await trio.to_thread.run_sync(_counted, home)) != last:
            last = now
            await trio.sleep(DRAIN_STEP_S)
    return trio.current_time() - start


async def _attack(args: argparse.Namespace, victim_addr: str, victim_id: str, home: Path) -> dict:
    """A bare libp2p host (no pubsub of its own: a hostile peer need not run gossipsub properly)
    that writes batches of messages on a raw /meshsub/1.1.0 stream, one batch every TICK_S."""
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID
    from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11
    from multiaddr import Multiaddr

    from p2ptrain.wire import MESH_TOPIC
    from p2ptrain.net import close_host, make_host

    key = create_new_key_pair()
    kinds = args.mix.split(",")
    t0 = time.monotonic()
    messages = _build(kinds, int(args.rate * args.seconds), key, MESH_TOPIC)
    per_tick = max(1, round(args.rate * TICK_S))
    frames = _frames(messages, per_tick)
    build_s = time.monotonic() - t0
    listen = [Multiaddr("/ip4/127.0.0.1/tcp/0")]
    host = make_host(key, listen)
    victim = ID.from_base58(victim_id)
    async with host.run(listen_addrs=listen):
        with trio.fail_after(MESH_READY_TIMEOUT_S):
            await host.get_network().dial_addr(Multiaddr(victim_addr.split("/p2p/")[0]), victim)
            stream = await host.new_stream(victim, [PROTOCOL_ID_V11])
        flood_start = time.time()
        start = trio.current_time()
        every = per_tick / args.rate  # seconds between frames: TICK_S, or longer at rates below 1/TICK_S
        for i, frame in enumerate(frames):
            await stream.write(frame)
            await trio.sleep_until(start + every * (i + 1))
        elapsed = trio.current_time() - start
        # Stay connected until the victim has read it all: closing drops what it has not read yet.
        drain_s = await _drain(home)
        with trio.move_on_after(SETTLE_S):
            await stream.close()
        with trio.move_on_after(SETTLE_S):
            await close_host(host)
    sent: dict[str, int] = {}
    for kind, _ in messages:
        sent[kind] = sent.get(kind, 0) + 1
    return {
        "flood_start": flood_start,
        "flood_end": flood_start + elapsed,
        "sent": sent,
        "sent_total": len(messages),
        "send_s": round(elapsed, 2),
        "build_s": round(build_s, 2),
        "messages_per_rpc": per_tick,
        "drain_s": round(drain_s, 2),
    }


def run(args: argparse.Namespace) -> dict:
    from p2ptrain.testing import node_processes

    with tempfile.TemporaryDirectory() as tmp, node_processes(1, Path(tmp)) as (victim,):
        rss_before = _settled_rss(victim.proc.pid)
        cpu_before = _cpu_seconds(victim.proc.pid)
        before = victim.status()["messages"]
        poller = subprocess.Popen(
            [sys.executable, __file__, "--poll-status", str(victim.home), "--interval", str(args.interval)],
            stdout=subprocess.PIPE, text=True,
        )
        try:
            attack = trio.run(_attack, args, victim.addr, victim.peer_id, victim.home)
        finally:
            time.sleep(SETTLE_S)
            poller.terminate()
        out, _ = poller.communicate(timeout=30)
        polled = json.loads(out) if out.strip() else {"calls": [], "failures": [(0, "poller died before reporting")]}
        status = victim.status()
        alive = victim.proc.poll() is None
        rss_after = _rss_bytes(victim.proc.pid) if alive else 0
        cpu_used = _cpu_seconds(victim.proc.pid) - cpu_before if alive else 0.0
    during = lambda wall: attack["flood_start"] <= wall <= attack["flood_end"] + attack["drain_s"]  # noqa: E731
    lat = sorted(latency for wall, latency in polled["calls"] if during(wall))
    failures = [text for wall, text in polled["failures"] if during(wall)]

    def delta(kind: str) -> dict[str, int]:
        now, then = status["messages"].get(kind, {}), before.get(kind, {})
        return {k: v - then.get(k, 0) for k, v in now.items() if v != then.get(k, 0)}

    return {
        "rate": args.rate,
        "seconds": args.seconds,
        "mix": args.mix,
        **{k: v for k, v in attack.items() if not k.startswith("flood_")},
        "victim_alive": alive,
        "status_calls": len(lat),
        "status_failures": len(failures),
        "status_failure_examples": failures[:3],
        "status_p50_s": round(statistics.median(lat), 4) if lat else None,
        "status_max_s": round(lat[-1], 4) if lat else None,
        "status_max_bytes": polled.get("max_size"),
        "rss_before_mb": round(rss_before / 2**20, 1),
        "rss_after_mb": round(rss_after / 2**20, 1),
        # Victim CPU over the whole run (mesh setup, message build, flood, drain, settle).
        "victim_cpu_s": round(cpu_used, 1),
        "victim_cpu_us_per_msg": round(1e6 * cpu_used / max(attack["sent_total"], 1)),
        "dropped": delta("dropped"),
        "dropped_below_router": delta("dropped_below_router"),
        "delivered": delta("delivered"),
        "membership": status.get("membership"),
        "peers_total": status.get("peers_total"),
        "gone_total": status.get("gone_total"),
        "discovery": status.get("discovery"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=1000.0, help="messages per second")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--mix", default="junk,fresh,oversized")
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between status calls")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--poll-status", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.poll_status:
        poll_status(args.poll_status, args.interval)
        return
    result = run(args)
    if args.json:
        print(json.dumps(result))
        return
    print(f"flood: {result['sent_total']} messages ({result['mix']}) in {result['send_s']} s "
          f"(asked {args.rate:.0f}/s for {args.seconds:.0f} s; pre-built in {result['build_s']} s)")
    print(f"victim alive: {result['victim_alive']}; it worked off its backlog {result['drain_s']} s after the flood")
    print(f"node status: {result['status_calls']} calls, p50 {result['status_p50_s']} s, max {result['status_max_s']} s, "
          f"{result['status_failures']} failed, largest answer {result['status_max_bytes']} B")
    print(f"victim RSS: {result['rss_before_mb']} MB before, {result['rss_after_mb']} MB after; "
          f"CPU {result['victim_cpu_s']} s over the run (~{result['victim_cpu_us_per_msg']} us a message)")
    print(f"dropped by the router: {result['dropped']}")
    print(f"dropped below the router: {result['dropped_below_router']}")
    print(f"delivered: {result['delivered']}")
    print(f"membership: {result['membership']}, peers_total {result['peers_total']}, gone_total {result['gone_total']}")
    print(f"discovery: {result['discovery']}")


if __name__ == "__main__":
    main()
