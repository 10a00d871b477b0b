"""Memory one hostile peer can pin through Bitswap streams (issue 13, found #5).

A node (a child process: a host with our BlockExchange over an on-disk store) is attacked by one
peer that opens ``--streams`` Bitswap streams, each announcing a 4 MiB message and sending all of it
but the last byte, then holding the streams open. The node's resident memory (VmRSS) is read before
the attack and ``--hold`` seconds after the last write; the node also reports what its exchange
tracks for the attacker (bytes held, streams open, refusals).

    .venv/bin/python bench/hostile_streams.py                     # this checkout
    .venv/bin/python bench/hostile_streams.py --code /work/main   # another checkout's node (before)
    .venv/bin/python bench/hostile_streams.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import trio

MIB = 1 << 20

# The node under attack: prints its address, then one JSON line of its exchange's view on each
# peer ID read from stdin.
NODE = r"""
import json, sys, trio
from multiaddr import Multiaddr
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from p2ptrain.ipfs import BlockStore
from p2ptrain.ipfs import BlockExchange
from p2ptrain.net import make_host

async def main():
    host = make_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"])
    exchange = BlockExchange(host, BlockStore(sys.argv[1]))
    async with host.run(listen_addrs=[Multiaddr("/ip4/127.0.0.1/tcp/0")]), trio.open_nursery() as n:
        await n.start(exchange.run)
        print(f"{host.get_addrs()[0]}/p2p/{host.get_id().to_base58()}", flush=True)
        stdin = trio.lowlevel.FdStream(0)
        buf = b""
        while True:
            chunk = await stdin.receive_some()
            if not chunk:
                break
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                peer = ID.from_base58(line.decode().strip())
                view = {}
                if hasattr(exchange, "stats"):
                    view = {"held_bytes": exchange.inbound_bytes(peer),
                            "open_streams": exchange.inbound_streams(peer), **exchange.stats()}
                print(json.dumps(view), flush=True)
        n.cancel_scope.cancel()

trio.run(main)
"""


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def attack(addr: str, streams: int, hold: float, node: subprocess.Popen) -> dict:
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from multiaddr import Multiaddr

    from p2ptrain.ipfs import MAX_MESSAGE_SIZE, PROTOCOLS, varint
    from p2ptrain.net import make_host

    attacker = make_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"])
    info = info_from_p2p_addr(Multiaddr(addr))
    outcome = {"written": 0, "refused": 0}
    async with attacker.run(listen_addrs=[Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        await attacker.connect(info)
        before = rss_mib(node.pid)
        began = time.perf_counter()

        async def one() -> None:
            try:
                stream = await attacker.new_stream(info.peer_id, [PROTOCOLS[0]])
                await stream.write(varint(MAX_MESSAGE_SIZE) + bytes(MAX_MESSAGE_SIZE - 1))
                outcome["written"] += 1
            except Exception:
                outcome["refused"] += 1

        with trio.fail_after(600):
            async with trio.open_nursery() as nursery:
                for _ in range(streams):
                    nursery.start_soon(one)
        attack_s = time.perf_counter() - began
        await trio.sleep(hold)  # let the node settle with the streams still open (a measurement)
        after = rss_mib(node.pid)
        node.stdin.write((attacker.get_id().to_base58() + "\n").encode())
        node.stdin.flush()
        view = json.loads(await trio.to_thread.run_sync(node.stdout.readline))
    return {
        "streams": streams, "partial_bytes_each": MAX_MESSAGE_SIZE - 1, "written": outcome["written"],
        "refused": outcome["refused"], "attack_s": round(attack_s, 2), "rss_before_mib": round(before, 1),
        "rss_after_mib": round(after, 1), "rss_growth_mib": round(after - before, 1), "node_view": view,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--hold", type=float, default=2.0, help="seconds between the attack and the RSS reading")
    parser.add_argument("--code", default=os.getcwd(), help="checkout whose node code is attacked")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, "PYTHONPATH": args.code}
        node = subprocess.Popen([sys.executable, "-c", NODE, home], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env, cwd=args.code)
        try:
            addr = node.stdout.readline().decode().strip()
            result = trio.run(attack, addr, args.streams, args.hold, node)
        finally:
            node.kill()
            node.wait()
    result["code"] = args.code
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:>20}: {value}")


if __name__ == "__main__":
    main()
