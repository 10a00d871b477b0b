"""One-way stream throughput on loopback: raw trio TCP, a stock py-libp2p stream, our Channel.

Every kind sends the same payload (default 64 MiB) one way and the receiver answers with one byte
once it holds all of it; the time is taken on the sender from the first write to that answer.
Each kind runs in one process (both ends in one trio loop) and across two processes (the receiver
is a child process of this script). All kinds run in the same invocation, so the ratios printed at
the end compare numbers taken on the same machine at the same time.

    .venv/bin/python bench/streams.py                 # table
    .venv/bin/python bench/streams.py --json          # one JSON object
    .venv/bin/python bench/streams.py --repeat 3      # 3 interleaved rounds; medians
    .venv/bin/python bench/streams.py --chunk-kib 64  # 64 KiB messages instead of 1 MiB
    .venv/bin/python bench/streams.py --rtt           # round trip of a 1,000-byte message

"Stock" means what py-libp2p gives by default: ``libp2p.new_host`` with Noise only and yamux, the
library's default environment, one stream, writes of ``--chunk-kib`` and 1 MiB ``read()`` calls
(large reads are already one of the known levers, so the baseline is, if anything, flattered).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import trio

MIB = 1 << 20
PROTO = "/p2ptrain/bench-streams/1.0.0"
KINDS = ("tcp", "stock", "channel")
WHERES = ("1proc", "2proc")


# --------------------------------------------------------------------------------------------
# Receivers: each returns after answering one byte for `total` received bytes.


async def tcp_receive(stream: trio.SocketStream, total: int) -> None:
    got = 0
    while got < total:
        data = await stream.receive_some(4 * MIB)
        if not data:
            raise RuntimeError(f"tcp: stream ended after {got} of {total} bytes")
        got += len(data)
    await stream.send_all(b"k")


async def stock_receive(stream, total: int) -> None:
    got = 0
    while got < total:
        data = await stream.read(MIB)
        got += len(data)
    await stream.write(b"k")


async def channel_receive(channel, total: int, msg_len: int) -> None:
    got = 0
    while got < total:
        got += len(await channel.recv(msg_len))
    await channel.send(b"k")


# --------------------------------------------------------------------------------------------
# Senders: each returns seconds from the first write to the receiver's answer.


async def tcp_send(stream: trio.SocketStream, payload: bytes, chunk: int) -> float:
    view = memoryview(payload)
    start = time.perf_counter()
    for off in range(0, len(view), chunk):
        await stream.send_all(view[off : off + chunk])
    if await stream.receive_some(1) != b"k":
        raise RuntimeError("tcp: no answer")
    return time.perf_counter() - start


async def stock_send(stream, payload: bytes, chunk: int) -> float:
    start = time.perf_counter()
    for off in range(0, len(payload), chunk):
        await stream.write(payload[off : off + chunk])
    if await stream.read(1) != b"k":
        raise RuntimeError("stock: no answer")
    return time.perf_counter() - start


async def channel_send(channel, payload: bytes, chunk: int) -> float:
    view = memoryview(payload)
    start = time.perf_counter()
    for off in range(0, len(view), chunk):
        await channel.send(view[off : off + chunk])
    if await channel.recv(1) != b"k":
        raise RuntimeError("channel: no answer")
    return time.perf_counter() - start


# --------------------------------------------------------------------------------------------
# Hosts


def new_libp2p_host(kind: str):
    from libp2p.crypto.ed25519 import create_new_key_pair

    key_pair = create_new_key_pair()
    if kind == "channel":
        from p2ptrain.net import make_host

        return make_host(key_pair, ["/ip4/127.0.0.1/tcp/0"])
    import libp2p

    from p2ptrain.net import noise_only

    return libp2p.new_host(key_pair=key_pair, sec_opt=noise_only(key_pair), muxer_preference="YAMUX")


def p2p_addr(host) -> str:
    addr = str(host.get_addrs()[0])
    return addr if "/p2p/" in addr else f"{addr}/p2p/{host.get_id().to_base58()}"


async def serve_one(kind: str, total: int, msg_len: int, on_ready, task_status=trio.TASK_STATUS_IGNORED):
    """Listen, report the address through ``on_ready``, receive one transfer, answer, return."""
    done = trio.Event()
    if kind == "tcp":
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        on_ready(f"127.0.0.1:{port}")
        task_status.started()
        stream = await listeners[0].accept()
        async with stream:
            await tcp_receive(stream, total)
            await stream.receive_some(1)  # wait for the sender to hang up
        await listeners[0].aclose()
        return

    from multiaddr import Multiaddr

    host = new_libp2p_host(kind)
    async with host.run(listen_addrs=[Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        if kind == "stock":

            async def handler(stream) -> None:
                await stock_receive(stream, total)
                done.set()
                await trio.sleep(1)  # keep the stream until the answer is read

            host.set_stream_handler(PROTO, handler)
        else:
            from p2ptrain.net import serve_channels

            async def handler(channel) -> None:
                await channel_receive(channel, total, msg_len)
                done.set()
                await trio.sleep(1)

            serve_channels(host, PROTO, handler)
        on_ready(p2p_addr(host))
        task_status.started()
        await done.wait()
        await trio.sleep(0.2)


async def send_one(kind: str, addr: str, payload: bytes, chunk: int) -> float:
    if kind == "tcp":
        hostname, port = addr.rsplit(":", 1)
        stream = await trio.open_tcp_stream(hostname, int(port))
        async with stream:
            return await tcp_send(stream, payload, chunk)

    from libp2p.peer.peerinfo import info_from_p2p_addr
    from multiaddr import Multiaddr

    host = new_libp2p_host(kind)
    async with host.run(listen_addrs=[Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        info = info_from_p2p_addr(Multiaddr(addr))
        await host.connect(info)
        if kind == "stock":
            stream = await host.new_stream(info.peer_id, [PROTO])
            seconds = await stock_send(stream, payload, chunk)
            await stream.close()
        else:
            from p2ptrain.net import open_channel

            async with await open_channel(host, info.peer_id, PROTO) as channel:
                seconds = await channel_send(channel, payload, chunk)
        return seconds


# --------------------------------------------------------------------------------------------
# Round trips of small messages


async def round_trips(kind: str, size: int, count: int) -> float:
    """Median seconds for ``size`` bytes to go to an echo and back, one process."""
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from multiaddr import Multiaddr

    here, there = new_libp2p_host(kind), new_libp2p_host(kind)
    listen = [Multiaddr("/ip4/127.0.0.1/tcp/0")]
    async with here.run(listen_addrs=listen), there.run(listen_addrs=listen):
        if kind == "stock":

            async def echo_stream(stream) -> None:
                while True:
                    await stream.write(await stream.read(size))

            there.set_stream_handler(PROTO, echo_stream)
        else:
            from p2ptrain.net import serve_channels

            async def echo_channel(channel) -> None:
                while True:
                    await channel.send(await channel.recv(size))

            serve_channels(there, PROTO, echo_channel)
        info = info_from_p2p_addr(Multiaddr(p2p_addr(there)))
        await here.connect(info)
        message = b"x" * size
        times = []
        if kind == "stock":
            stream = await here.new_stream(info.peer_id, [PROTO])
            for _ in range(count):
                start = time.perf_counter()
                await stream.write(message)
                got = 0
                while got < size:
                    got += len(await stream.read(size - got))
                times.append(time.perf_counter() - start)
        else:
            from p2ptrain.net import open_channel

            channel = await open_channel(here, info.peer_id, PROTO)
            for _ in range(count):
                start = time.perf_counter()
                await channel.send(message)
                await channel.recv(size)
                times.append(time.perf_counter() - start)
        return statistics.median(times)


def rtt_main(args: argparse.Namespace) -> int:
    out: dict[str, object] = {"rtt_size_bytes": args.rtt_size, "count": 300}
    for kind in ("stock", "channel"):
        seconds = trio.run(lambda k=kind: _bounded(round_trips(k, args.rtt_size, 300)))
        out[f"{kind}_rtt_us"] = round(seconds * 1e6)
    out["channel_vs_stock_rtt"] = round(out["stock_rtt_us"] / out["channel_rtt_us"], 2)
    print(json.dumps(out) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))
    return 0


# --------------------------------------------------------------------------------------------
# Runs


def run_one_process(kind: str, payload: bytes, chunk: int) -> float:
    async def main() -> float:
        addr: list[str] = []
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                await nursery.start(serve_one, kind, len(payload), chunk, addr.append)
                seconds = await send_one(kind, addr[0], payload, chunk)
        return seconds

    return trio.run(main)


def run_two_processes(kind: str, payload: bytes, chunk: int) -> float:
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", kind, "--size-mib", str(len(payload) // MIB),
         "--chunk-kib", str(chunk // 1024)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline().strip()
        if not line.startswith("ADDR "):
            raise RuntimeError(f"receiver did not start: {line!r}")
        seconds = trio.run(lambda: _bounded(send_one(kind, line[5:], payload, chunk)))
        child.wait(timeout=60)
        return seconds
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


async def _bounded(coro) -> float:
    with trio.fail_after(120):
        return await coro


def serve_main(kind: str, total: int, chunk: int) -> None:
    def ready(addr: str) -> None:
        print(f"ADDR {addr}", flush=True)

    trio.run(serve_one, kind, total, chunk, ready)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=64, help="bytes sent one way per run")
    parser.add_argument("--chunk-kib", type=int, default=1024,
                        help="write size (stock/tcp) and message size (channel), KiB")
    parser.add_argument("--repeat", type=int, default=1, help="runs per cell; the median is reported")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--where", default=",".join(WHERES))
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--rtt", action="store_true",
                        help="instead: median round trip of small messages, stock vs channel")
    parser.add_argument("--rtt-size", type=int, default=1000, help="bytes per --rtt message")
    parser.add_argument("--serve", choices=KINDS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rtt:
        return rtt_main(args)
    total, chunk = args.size_mib * MIB, args.chunk_kib * 1024
    if args.serve:
        serve_main(args.serve, total, chunk)
        return 0

    payload = bytes(range(256)) * (total // 256)
    kinds = args.kinds.split(",")
    wheres = args.where.split(",")
    # Rounds interleave the kinds, so a burst of load from other work on this shared machine hits
    # every kind of a round alike; ratios are taken within each round, then the median is reported.
    samples: dict[str, dict[str, list[float]]] = {w: {k: [] for k in kinds} for w in wheres}
    for _ in range(args.repeat):
        for where in wheres:
            runner = run_one_process if where == "1proc" else run_two_processes
            for kind in kinds:
                samples[where][kind].append(total / runner(kind, payload, chunk) / 1e6)

    out: dict[str, object] = {"size_mib": args.size_mib, "chunk_kib": args.chunk_kib,
                              "repeat": args.repeat}
    for where in wheres:
        row = samples[where]
        for kind in kinds:
            out[f"{kind}_{where}_MBps"] = round(statistics.median(row[kind]), 1)
            if not args.json:
                print(f"{where:6} {kind:8} {statistics.median(row[kind]):8.1f} MB/s  "
                      f"(runs: {', '.join(f'{v:.0f}' for v in row[kind])})")
        for base in ("stock", "tcp"):
            if "channel" in row and base in row:
                ratios = [c / b for c, b in zip(row["channel"], row[base])]
                out[f"channel_vs_{base}_{where}"] = round(statistics.median(ratios), 3)
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            if key.startswith("channel_vs"):
                print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
