"""One role of bench/nat.py's stream measurement, run inside a namespace of the emulated NAT:
``relay`` (serves circuit relay v2; answers each line on stdin with the bytes it relayed), ``sink`` (reserves on a
relay if given one, then counts what
one stream brings and answers with the byte count) or ``source`` (dials a sink, directly or
through a relay, and sends ``--mib`` MiB on one stream). Each prints one JSON line per event.
Real p2ptrain hosts (Noise, yamux) and p2ptrain.net._relay, as a node uses them.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import time

import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from multiaddr import Multiaddr

from p2ptrain.net import Relaying, is_circuit, make_host

PROTO = "/p2ptrain-bench/sink/1"
CHUNK = 65_524 * 4  # whole yamux frames (see FIELD-NOTES: stream throughput)
TIMEOUT_S = 600.0


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


async def main(args: argparse.Namespace) -> None:
    listen = [Multiaddr(f"/ip4/0.0.0.0/tcp/{args.port}")]
    host = make_host(create_new_key_pair(), listen)
    async with host.run(listen_addrs=listen), trio.open_nursery() as nursery:
        relaying = Relaying(host, serve=args.role == "relay", hole_punch=False)  # the relayed path, measured as such
        await nursery.start(relaying.run)
        me = f"/ip4/{args.ip}/tcp/{args.port}/p2p/{host.get_id().to_base58()}"
        with trio.fail_after(TIMEOUT_S):
            if args.role == "relay":
                say(event="ready", addr=me)
                stdin = trio.lowlevel.FdStream(0)
                while await stdin.receive_some():  # each line asks how many bytes were relayed so far
                    say(event="relayed", bytes=relaying.protocol.relayed_bytes)
            if args.role == "sink":
                async def sink(stream) -> None:
                    head = b""
                    while len(head) < 8:
                        head += await stream.read(8 - len(head))
                    want, total = struct.unpack(">Q", head)[0], 0
                    while total < want:
                        total += len(await stream.read(min(1 << 20, want - total)))
                    await stream.write(struct.pack(">Q", total))
                    await stream.close()
                    say(event="received", bytes=total)

                host.set_stream_handler(PROTO, sink)
                if args.relay:
                    relay = info_from_p2p_addr(Multiaddr(args.relay))
                    await host.connect(relay)
                    assert await relaying.reserve(relay.peer_id, Multiaddr(args.relay))
                    me = relaying.addrs[0]
                say(event="ready", addr=me)
                await trio.sleep_forever()
            target = Multiaddr(args.target)
            if is_circuit(target):
                await relaying.dial(target)
                peer_id = ID.from_base58(args.target.rsplit("/p2p/", 1)[1])  # a circuit address ends in the sink's id
            else:
                info = info_from_p2p_addr(target)
                await host.connect(info)
                peer_id = info.peer_id
            stream = await host.new_stream(peer_id, [PROTO])
            data = bytes(CHUNK)
            total = int(args.mib * 2**20)
            started = time.monotonic()
            await stream.write(struct.pack(">Q", total))
            sent = 0
            while sent < total:
                n = min(CHUNK, total - sent)
                await stream.write(data[:n])
                sent += n
            ack = b""
            while len(ack) < 8:
                more = await stream.read(8 - len(ack))
                if not more:
                    break
                ack += more
            elapsed = time.monotonic() - started
            say(event="sent", bytes=sent, acked=struct.unpack(">Q", ack)[0] if len(ack) == 8 else None,
                seconds=round(elapsed, 3), mb_per_s=round(sent / elapsed / 1e6, 2))
            nursery.cancel_scope.cancel()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("role", choices=("relay", "sink", "source"))
    parser.add_argument("--ip", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=4101)
    parser.add_argument("--relay", default=None, help="sink: reserve on this relay (multiaddr with /p2p/)")
    parser.add_argument("--target", default=None, help="source: the sink's address (direct or circuit)")
    parser.add_argument("--mib", type=float, default=32)
    trio.run(main, parser.parse_args())
    sys.exit(0)
