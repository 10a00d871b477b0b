"""Bitswap interop with Helia (JS IPFS on js-libp2p 3), both directions, in one bounded test.

Helia runs as a Node 22 process (ipfs/helia-peer.mjs, installed by ipfs/install-helia.sh, which `make
test` runs when npm is present) on 127.0.0.1 with TCP, Noise and yamux, nothing else: no DHT, no HTTP
routing or gateways. Our side is a real p2ptrain host with a BlockExchange and a BlockStore on disk.
js-libp2p 3 half-closes every incoming Bitswap stream and sends each message on a fresh stream of its
own: what this test exists to keep working (docs/content.md, "Interop rules").
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

import pytest
import trio
from libp2p.peer.peerinfo import info_from_p2p_addr
from multiaddr import Multiaddr

from p2ptrain.ipfs import BlockExchange, BlockStore, cid_str, import_stream, parse_cid, read_file
from p2ptrain.testing import connected_hosts

ROOT = Path(__file__).resolve().parents[2]
HELIA_DIR = ROOT / "ipfs" / ".helia"
NODE = HELIA_DIR / "node_modules" / ".bin" / "node"
SCRIPT = ROOT / "ipfs" / "helia-peer.mjs"
MiB = 1 << 20
# A file of one block (under the 256 KiB chunk) and one of two levels of links: more than 174 leaves
# (Kubo's and Helia's widest node) of 256 KiB needs a second level, i.e. more than 43.5 MiB.
SIZES = (100_000, 45 * MiB + 12_345)
# The whole test (Helia's start, four 45 MiB transfers, hashing) took 8-12 s here; the bound is generous
# for a loaded 2-core CI box but stops a hung transfer.
DEADLINE_S = 120
# Helia's start (Node loads ~1,000 modules) and each request's answer.
STARTUP_S = 30

# npm: ipfs/install-helia.sh installs Node 22 and Helia with it (make test does, when npm is present).
pytestmark = pytest.mark.needs("npm", "helia")  # tests/conftest.py decides


class Helia:
    """The ipfs/helia-peer.mjs process: one JSON request per line in, one JSON answer per line out."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self._buffer = b""

    async def _line(self) -> dict:
        while b"\n" not in self._buffer:
            chunk = await self.process.stdout.receive_some(65536)
            if not chunk:
                raise RuntimeError(f"Helia exited (rc {self.process.poll()}); see its stderr above")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"Helia: {answer['error']}")
        return answer

    async def ask(self, **request) -> dict:
        await self.process.stdin.send_all(json.dumps(request).encode() + b"\n")
        return await self._line()


def random_file(path: Path, size: int) -> bytes:
    data = os.urandom(size)
    path.write_bytes(data)
    return data


async def test_bitswap_with_helia_both_directions(tmp_path):
    link = HELIA_DIR / "helia-peer.mjs"  # ESM resolves packages from the script's own folder
    if not link.is_symlink():
        link.symlink_to(SCRIPT)
    # the node process writes its log here; closed when the test ends
    with open(tmp_path / "helia.log", "wb") as stderr, trio.fail_after(DEADLINE_S):  # noqa: ASYNC230
        async with connected_hosts(1, connected=False) as (ours,), trio.open_nursery() as nursery:
            store = BlockStore(tmp_path / "blocks")
            exchange = BlockExchange(ours.host, store)
            await ours.start(exchange.run)
            process = await trio.lowlevel.open_process(
                [str(NODE), "--preserve-symlinks-main", str(link)],
                stdin=-1, stdout=-1, stderr=stderr,  # -1: subprocess.PIPE
            )
            helia = Helia(process)
            try:
                with trio.fail_after(STARTUP_S):
                    hello = await helia._line()
                theirs = info_from_p2p_addr(Multiaddr(hello["addrs"][0]))
                await ours.host.connect(theirs)
                our_addr = f"{ours.host.get_addrs()[0]}"
                if "/p2p/" not in our_addr:
                    our_addr += f"/p2p/{ours.host.get_id()}"
                await helia.ask(op="dial", addr=our_addr)
                for cid_version in (0, 1):
                    for size in SIZES:
                        what = f"{size} B, CIDv{cid_version}"
                        # Helia holds, p2ptrain fetches.
                        data = random_file(tmp_path / "theirs", size)
                        root = parse_cid((await helia.ask(
                            op="add", path=str(tmp_path / "theirs"), cid_version=cid_version
                        ))["cid"])
                        expected = [c for c, _ in import_stream(io.BytesIO(data), cid_version=cid_version)][-1]
                        assert root == expected, f"{what}: Helia and p2ptrain name the file differently"
                        stats = await exchange.fetch_dag(root, [theirs.peer_id])
                        assert b"".join(read_file(root, store.get)) == data, what
                        assert stats.failed == {}, what
                        # p2ptrain holds, Helia fetches.
                        data = os.urandom(size)
                        for cid, block in import_stream(io.BytesIO(data), cid_version=cid_version):
                            store.put(cid, block)
                        got = await helia.ask(op="cat", cid=cid_str(cid), timeout_ms=DEADLINE_S * 1000)
                        assert got == {"bytes": size, "sha256": hashlib.sha256(data).hexdigest()}, what
            finally:
                with trio.move_on_after(5):
                    await process.stdin.aclose()
                    await process.wait()
                if process.poll() is None:
                    process.kill()
                await process.wait()
                nursery.cancel_scope.cancel()
