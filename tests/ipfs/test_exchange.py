"""Bitswap block exchange between real libp2p hosts on 127.0.0.1, with real stores on disk."""

from __future__ import annotations

import io
import math
from contextlib import asynccontextmanager

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import PeerInfo
from multiaddr import Multiaddr

from p2ptrain.ipfs._bitswap_wire import WantEntry, decode_message, encode_message
from p2ptrain.ipfs import BlockExchange, BlockStore, FetchError, import_stream, make_cid, parse_cid, read_file
from p2ptrain.base import short_id
from p2ptrain.net import make_host
from p2ptrain.testing import connected_hosts

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
DEADLINE = 60
MiB = 1024 * 1024


def content(n: int, seed: int = 0) -> bytes:
    """Bytes that differ block to block (identical leaves would be deduplicated)."""
    return bytes((i * 7 + seed + i // 251) % 256 for i in range(n)) if n < 4096 else _big(n, seed)


def _big(n: int, seed: int) -> bytes:
    import hashlib

    out = bytearray()
    counter = 0
    while len(out) < n:
        out += hashlib.sha512(f"{seed}:{counter}".encode()).digest() * 64
        counter += 1
    return bytes(out[:n])


def add(store: BlockStore, data: bytes, cid_version: int = 0):
    root = None
    for cid, block in import_stream(io.BytesIO(data), cid_version=cid_version):
        store.put(cid, block)
        root = cid
    return root


class Node:
    def __init__(self, host, store: BlockStore, exchange: BlockExchange, scope: trio.CancelScope):
        self.host, self.store, self.exchange, self.scope = host, store, exchange, scope

    @property
    def info(self) -> PeerInfo:
        return PeerInfo(self.host.get_id(), self.host.get_addrs())


@asynccontextmanager
async def nodes(tmp_path, *store_classes):
    """Running hosts, one per store class, each with its own exchange; ``node.scope.cancel()`` kills one."""
    async with connected_hosts(len(store_classes), connected=False) as hosts:
        started = []
        for i, (local, store_class) in enumerate(zip(hosts, store_classes)):
            store = store_class(tmp_path / f"node{i}" / "blocks")
            exchange = BlockExchange(local.host, store)
            await local.start(exchange.run)
            started.append(Node(local.host, store, exchange, local.scope))
        yield started


def bytes_of(store: BlockStore, root) -> bytes:
    return b"".join(read_file(root, store.get))


def test_message_roundtrip_computes_cids_from_data():
    leaf = make_cid(b"leaf", version=1)
    wire = encode_message(
        wants=[WantEntry(leaf, send_dont_have=True)], blocks=[(leaf, b"leaf")], dont_haves=[leaf]
    )
    msg = decode_message(wire[1:] if wire[0] < 0x80 else wire[2:])
    assert msg.wants == [WantEntry(leaf, send_dont_have=True)]
    assert [(b.cid(), b.data) for b in msg.blocks] == [(leaf, b"leaf")]
    assert msg.dont_haves == [leaf]
    # A block named by a prefix is named by its own hash: swapping the data renames it.
    forged = encode_message(blocks=[(leaf, b"evil")])
    (block,) = decode_message(forged[1:]).blocks
    assert block.data == b"evil" and block.cid() != leaf


@pytest.mark.parametrize("cid_version", [0, 1])
async def test_fetch_dag_from_one_provider(tmp_path, cid_version):
    data = content(3 * MiB + 12345, seed=cid_version)
    async with nodes(tmp_path, BlockStore, BlockStore) as (provider, fetcher):
        root = add(provider.store, data, cid_version)
        with trio.fail_after(DEADLINE):
            stats = await fetcher.exchange.fetch_dag(root, [provider.info])
        assert bytes_of(fetcher.store, root) == data
        assert stats.blocks == 13 + 1  # 12 full leaves + a short one, plus the root
        with trio.fail_after(DEADLINE):  # the provider counts a block once its write returned
            while provider.exchange.stats()["served_blocks"] < stats.blocks:
                await trio.sleep(0.01)
        assert provider.exchange.stats()["served_bytes"] == stats.bytes
        with trio.fail_after(DEADLINE):  # everything is local now: nothing goes over the wire
            again = await fetcher.exchange.fetch_dag(root, [provider.info])
        assert again.blocks == 0 and again.local_blocks == 14


async def test_fetch_survives_provider_killed_mid_fetch(tmp_path):
    data = content(20 * MiB, seed=1)
    async with nodes(tmp_path, BlockStore, BlockStore, BlockStore) as (a, b, fetcher):
        root = add(a.store, data)
        add(b.store, data)
        killed_at = None

        def kill_a_after_5_mib(n: int) -> None:
            nonlocal killed_at
            got = fetcher_bytes.append(n) or sum(fetcher_bytes)
            if killed_at is None and got >= 5 * MiB:
                killed_at = got
                a.scope.cancel()  # a's host stops: its connections close under the fetch

        fetcher_bytes: list[int] = []
        with trio.fail_after(DEADLINE):
            stats = await fetcher.exchange.fetch_dag(
                root, [a.info, b.info], progress=kill_a_after_5_mib
            )
        assert killed_at is not None
        assert bytes_of(fetcher.store, root) == data
        assert short_id(a.host.get_id()) in stats.failed
        assert stats.per_provider[short_id(b.host.get_id())] > 0


class LyingStore(BlockStore):
    """A provider's store that serves every leaf with one byte flipped (a malicious or broken peer)."""

    def get(self, cid):
        data = super().get(cid)
        if parse_cid(cid).codec.name == "raw" or len(data) > 1000:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        return data


async def test_corrupted_block_rejected_and_fetched_from_other(tmp_path):
    data = content(2 * MiB, seed=2)
    async with nodes(tmp_path, LyingStore, BlockStore, BlockStore) as (liar, honest, fetcher):
        root = add(liar.store, data, cid_version=1)
        add(honest.store, data, cid_version=1)
        with trio.fail_after(DEADLINE):
            stats = await fetcher.exchange.fetch_dag(root, [liar.info, honest.info])
        assert bytes_of(fetcher.store, root) == data
        liar_id = short_id(liar.host.get_id())
        assert "sent block" in stats.failed[liar_id]
        assert fetcher.exchange.strikes[liar_id] >= 1
        assert short_id(honest.host.get_id()) not in stats.failed


async def test_only_a_lying_provider_is_a_clear_error(tmp_path):
    data = content(MiB, seed=3)
    async with nodes(tmp_path, LyingStore, BlockStore) as (liar, fetcher):
        root = add(liar.store, data, cid_version=1)
        with trio.fail_after(DEADLINE), pytest.raises(FetchError) as err:
            await fetcher.exchange.fetch_dag(root, [liar.info])
        assert short_id(liar.host.get_id()) in str(err.value)
        leaves = [c for c in fetcher.store.iter_cids()]
        for cid in leaves:  # whatever was stored is genuine
            fetcher.store.get(cid)


async def test_missing_block_is_dont_have_then_error(tmp_path):
    async with nodes(tmp_path, BlockStore, BlockStore) as (provider, fetcher):
        absent = make_cid(b"nobody has this", version=1)
        with trio.fail_after(DEADLINE), pytest.raises(FetchError) as err:
            await fetcher.exchange.fetch_dag(absent, [provider.info])
        assert "DontHave" in str(err.value)


async def test_dead_provider_list_is_an_error_not_a_hang(tmp_path):
    async with nodes(tmp_path, BlockStore, BlockStore) as (provider, fetcher):
        root = add(provider.store, content(300_000))
        provider.scope.cancel()
        await trio.sleep(0.2)
        with trio.fail_after(DEADLINE), pytest.raises(FetchError):
            await fetcher.exchange.fetch_dag(root, [provider.info])


async def test_fetch_block_fetches_one_block_not_the_dag(tmp_path):
    data = content(MiB, seed=4)
    async with nodes(tmp_path, BlockStore, BlockStore) as (provider, fetcher):
        root = add(provider.store, data)
        with trio.fail_after(DEADLINE):
            block = await fetcher.exchange.fetch_block(root, [provider.info])
        assert block == provider.store.get(root)
        assert len(list(fetcher.store.iter_cids())) == 1  # the root only, not its leaves


def test_wants_for_other_codecs_are_ignored_not_fatal():
    """Kubo asks every peer for whatever it wants, dag-cbor included: skip those entries, keep the rest."""
    from libp2p.bitswap.pb.bitswap_pb2 import Message
    from multiformats import CID, multihash

    cbor = CID("base32", 1, "dag-cbor", multihash.digest(b"x", "sha2-256"))
    ours = make_cid(b"y", version=1)
    msg = Message()
    msg.wantlist.entries.add(block=bytes(cbor))
    msg.wantlist.entries.add(block=bytes(ours), sendDontHave=True)
    decoded = decode_message(msg.SerializeToString())
    assert decoded.ignored_wants == 1
    assert decoded.wants == [WantEntry(ours, send_dont_have=True)]


class ChunkedStream:
    """Bytes delivered in given read sizes, then end of stream (how a muxer hands data over)."""

    def __init__(self, data: bytes, sizes):
        self.data, self.sizes = data, list(sizes)

    async def read(self, n):
        if not self.data:
            return b""
        k = min(self.sizes.pop(0) if self.sizes else len(self.data), n)
        out, self.data = self.data[:k], self.data[k:]
        return out


@pytest.mark.parametrize("sizes", [[1] * 64, [3, 700_000, 5], [10_000_000]])
async def test_message_reader_reassembles_across_any_read_boundaries(sizes):
    from p2ptrain.ipfs._bitswap_wire import MessageReader, WireError

    blocks = [content(n, seed=n) for n in (0, 5, 300_000, 7)]
    wire = b"".join(encode_message(blocks=[(make_cid(b), b)]) for b in blocks)
    reader = MessageReader(ChunkedStream(wire, sizes))
    got = []
    while (body := await reader.next_body()) is not None:
        got.extend(b.data for b in decode_message(body).blocks)
    assert got == blocks
    with pytest.raises(WireError, match="inside a message"):
        truncated = MessageReader(ChunkedStream(wire[:-1], sizes))
        while await truncated.next_body() is not None:
            pass


async def test_interrupted_fetch_resumes_with_only_the_missing_blocks(tmp_path):
    data = content(2 * MiB, seed=5)
    async with nodes(tmp_path, BlockStore, BlockStore) as (provider, fetcher):
        root = add(provider.store, data, cid_version=1)
        with trio.fail_after(DEADLINE):
            await fetcher.exchange.fetch_dag(root, [provider.info])
        leaves = [c for c in fetcher.store.iter_cids() if c.digest != root.digest]
        for cid in leaves[::2]:  # as if the first fetch had stopped half way
            fetcher.store.delete(cid)
        with trio.fail_after(DEADLINE):
            stats = await fetcher.exchange.fetch_dag(root, [provider.info])
        assert stats.blocks == len(leaves[::2])
        assert stats.local_blocks == 1 + len(leaves) - len(leaves[::2])
        assert bytes_of(fetcher.store, root) == data


# ---- hostile peers (issue 13, found #5) ---------------------------------------------------------

HOSTILE_STREAMS = 200


async def _hostile_streams(attacker, target_id, count: int, partial: int, opened: list) -> None:
    """``count`` Bitswap streams, each announcing a 4 MiB message and sending ``partial`` bytes of it,
    then holding it open; returns once every stream was refused or has its bytes written."""
    from p2ptrain.ipfs import MAX_MESSAGE_SIZE, PROTOCOLS, varint

    async def one() -> None:
        try:
            stream = await attacker.new_stream(target_id, [PROTOCOLS[0]])
            opened.append(stream)
            await stream.write(varint(MAX_MESSAGE_SIZE) + bytes(partial))
        except Exception:
            pass  # reset by the node: refused

    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(one)


async def test_hostile_streams_pin_at_most_the_per_peer_budget(tmp_path):
    from p2ptrain.ipfs import MAX_MESSAGE_SIZE
    from p2ptrain.ipfs._exchange import MAX_INBOUND_BYTES_PER_PEER, MAX_INBOUND_STREAMS_PER_PEER

    data = content(MiB + 7, seed=5)
    async with nodes(tmp_path, BlockStore, BlockStore) as (node, honest):
        root = add(node.store, data)
        attacker = make_host(create_new_key_pair(), [LOOPBACK])
        async with attacker.run(listen_addrs=[Multiaddr(LOOPBACK)]):
            await attacker.connect(node.info)
            opened: list = []
            with trio.fail_after(DEADLINE):
                await _hostile_streams(attacker, node.host.get_id(), HOSTILE_STREAMS, MAX_MESSAGE_SIZE - 1, opened)
            who = attacker.get_id()
            held = node.exchange.inbound_bytes(who)
            stats = node.exchange.stats()
            # Two 4 MiB messages fit the budget; every other stream was refused at once.
            assert held == MAX_INBOUND_BYTES_PER_PEER == 2 * MAX_MESSAGE_SIZE
            assert node.exchange.inbound_streams(who) <= MAX_INBOUND_STREAMS_PER_PEER
            # (A burst can also meet the muxer's cap on inbound streams per connection first.)
            at_muxer = sum(
                conn.muxed_conn.refused["over_inbound_streams"] if hasattr(conn.muxed_conn, "refused") else 0
                for conn in node.host.get_network().get_connections(who)
            )
            assert stats["over_stream_cap"] + stats["rejected_bad_message"] + at_muxer == HOSTILE_STREAMS - 2
            # The node still serves an honest peer meanwhile.
            with trio.fail_after(DEADLINE):
                await honest.exchange.fetch_dag(root, [node.info])
            assert bytes_of(honest.store, root) == data
            for stream in opened:
                with trio.move_on_after(1):
                    try:
                        await stream.reset()
                    except Exception:
                        pass
            with trio.fail_after(5):  # the node lets go of the bytes once the streams are reset
                while node.exchange.inbound_bytes(who):
                    await trio.sleep(0.01)


async def test_a_stalled_message_is_dropped_after_the_message_timeout(tmp_path, monkeypatch):
    from p2ptrain.ipfs import _exchange as exchange_module

    monkeypatch.setattr(exchange_module, "MESSAGE_TIMEOUT_S", 0.5)
    async with nodes(tmp_path, BlockStore) as (node,):
        attacker = make_host(create_new_key_pair(), [LOOPBACK])
        async with attacker.run(listen_addrs=[Multiaddr(LOOPBACK)]):
            await attacker.connect(node.info)
            opened: list = []
            with trio.fail_after(DEADLINE):
                await _hostile_streams(attacker, node.host.get_id(), 1, 1000, opened)
                (stream,) = opened
                with pytest.raises(Exception):  # reset by the node once the message is overdue
                    while await stream.read(1024):
                        pass
                while node.exchange.inbound_bytes(attacker.get_id()):
                    await trio.sleep(0.01)
            assert node.exchange.stats()["rejected_bad_message"] == 1


async def test_a_handler_exception_is_a_counted_reset_and_the_node_keeps_serving(tmp_path, monkeypatch):
    """The Bitswap handler's boundary: an unexpected error while handling one message resets that
    stream, is counted, and the node serves the next request."""
    from p2ptrain.ipfs import PROTOCOLS, _exchange as exchange_module

    real_decode = exchange_module.decode_message

    def broken(body):
        raise RuntimeError("injected")

    data = content(300_000, seed=9)
    async with nodes(tmp_path, BlockStore, BlockStore) as (node, honest):
        root = add(node.store, data)
        attacker = make_host(create_new_key_pair(), [LOOPBACK])
        async with attacker.run(listen_addrs=[Multiaddr(LOOPBACK)]):
            await attacker.connect(node.info)
            monkeypatch.setattr(exchange_module, "decode_message", broken)
            with trio.fail_after(DEADLINE):
                stream = await attacker.new_stream(node.host.get_id(), [PROTOCOLS[0]])
                await stream.write(encode_message(wants=[WantEntry(root)]))
                with pytest.raises(Exception):  # reset by the node's boundary
                    while await stream.read(1024):
                        pass
            monkeypatch.setattr(exchange_module, "decode_message", real_decode)
            assert node.exchange.stats()["handler_error"] == 1
            with trio.fail_after(DEADLINE):
                await honest.exchange.fetch_dag(root, [node.info])
            assert bytes_of(honest.store, root) == data


async def test_a_stopped_exchange_answers_nothing_and_fails_nothing(tmp_path):
    """A node stops its exchange before its host. Before, the exchange removed its Bitswap handlers:
    a stream negotiated in that moment found none (libp2p looks the handler up again once agreed:
    KeyError out of the swarm's task, which ended a stopping peer's run with an error, seen in
    tests/pipeline/test_recut_run.py), and a want on a stream opened before the stop raised
    'BlockExchange is not running' (an ERROR with a traceback, counted as a handler error). Now a
    stream after the stop is reset, and a want on an older one is dropped."""
    from p2ptrain.ipfs import PROTOCOLS

    store = BlockStore(tmp_path / "blocks")
    root = add(store, content(50_000, seed=3))
    async with connected_hosts(1, connected=False) as (local,):
        exchange = BlockExchange(local.host, store)
        attacker = make_host(create_new_key_pair(), [LOOPBACK])
        async with attacker.run(listen_addrs=[Multiaddr(LOOPBACK)]):
            await attacker.connect(local.info)
            with trio.fail_after(DEADLINE):
                async with trio.open_nursery() as running:
                    await running.start(exchange.run)
                    early = await attacker.new_stream(local.id, [PROTOCOLS[0]])
                    running.cancel_scope.cancel()
                await early.write(encode_message(wants=[WantEntry(root)]))
                await early.close()
                while exchange.inbound_streams(attacker.get_id()):  # its handler read it to the end
                    await trio.sleep(0.01)
                late = await attacker.new_stream(local.id, [PROTOCOLS[0]])
                with pytest.raises(Exception):  # reset: nothing serves it any more
                    await late.write(encode_message(wants=[WantEntry(root)]))
                    while await late.read(1024):
                        pass
    assert exchange.stats().get("handler_error", 0) == 0, exchange.stats()


async def test_fetches_work_across_idle_timeouts(tmp_path, monkeypatch):
    """Idle streams are closed on both sides (the sender first), and a later fetch from the same
    provider opens fresh ones instead of failing on a stream the provider dropped."""
    from p2ptrain.ipfs import _exchange as exchange_module, _senders as senders_module

    monkeypatch.setattr(senders_module, "_SEND_IDLE_S", 0.2)
    monkeypatch.setattr(exchange_module, "INBOUND_IDLE_S", 0.4)
    first, second = content(300_000, seed=11), content(300_000, seed=12)
    async with nodes(tmp_path, BlockStore, BlockStore) as (provider, fetcher):
        roots = add(provider.store, first), add(provider.store, second)
        with trio.fail_after(DEADLINE):
            await fetcher.exchange.fetch_dag(roots[0], [provider.info])
            while provider.exchange.inbound_streams(fetcher.host.get_id()):
                await trio.sleep(0.05)  # both sides went idle and closed their streams
            await fetcher.exchange.fetch_dag(roots[1], [provider.info])
        assert bytes_of(fetcher.store, roots[1]) == second


# ---- peers that speak Bitswap as js-libp2p 3 (Helia) does (issue 15) -----------------------------


class JsLikeBitswap:
    """Bitswap as Helia on js-libp2p 3 speaks it, on a real py-libp2p host.

    What matters for interop (read from @helia/bitswap's network.ts): every incoming stream is
    half-closed at once (its write side ends, it stays readable); every message it sends goes on a
    fresh stream of its own, closed after the message; only ``/ipfs/bitswap/1.2.0``; an incoming
    stream with no message for ``idle_reset_s`` is reset (Helia's messageReceiveTimeout, 5 s).
    """

    def __init__(self, host, blocks=(), idle_reset_s: float = math.inf) -> None:
        self.host = host
        self.held = {cid.digest: (cid, data) for cid, data in blocks}
        self.got: dict[bytes, bytes] = {}
        self.haves: list = []
        self.dont_haves: list = []
        self.idle_reset_s = idle_reset_s
        self.resets = 0
        self.changed = trio.Event()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        from p2ptrain.ipfs import PROTOCOLS

        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self.host.set_stream_handler(PROTOCOLS[0], self._on_stream)
            task_status.started()
            await trio.sleep_forever()

    def _poke(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def _on_stream(self, stream) -> None:
        from p2ptrain.ipfs._bitswap_wire import MessageReader

        peer_id = stream.muxed_conn.peer_id
        try:
            await stream.close_write()  # js-libp2p 3: the first thing done with an incoming stream
            reader = MessageReader(stream, idle_timeout=self.idle_reset_s)
            while (body := await reader.next_body()) is not None:
                msg = decode_message(body)
                blocks, donts = [], []
                for want in msg.wants:
                    if want.cancel:
                        continue
                    if want.cid.digest in self.held:
                        blocks.append(self.held[want.cid.digest])
                    elif want.send_dont_have:
                        donts.append(want.cid)
                for block in msg.blocks:
                    self.got[block.multihash] = block.data
                self.haves += msg.haves
                self.dont_haves += msg.dont_haves
                if blocks or donts:
                    await self._send(peer_id, blocks=blocks, dont_haves=donts)
                self._poke()
            if self.idle_reset_s < math.inf:  # idle (or ended): Helia resets it either way
                self.resets += 1
                await stream.reset()
                self._poke()
        except Exception:
            pass  # the other side went away: the test sees it as a missing block

    async def _send(self, peer_id, **message) -> None:
        from p2ptrain.ipfs import PROTOCOLS

        stream = await self.host.new_stream(peer_id, [PROTOCOLS[0]])
        await stream.write(encode_message(**message))
        await stream.close()

    async def fetch(self, root, peer_id) -> bytes:
        """The file under ``root``, level by level: each level's wants in one message on a fresh stream."""
        from p2ptrain.ipfs import decode_node

        level = [root]
        while level:
            await self._send(peer_id, wants=[WantEntry(c, send_dont_have=True) for c in level])
            while not all(c.digest in self.got for c in level):
                await self.changed.wait()
            level = [
                link.cid for c in level if c.codec.name == "dag-pb"
                for link in decode_node(self.got[c.digest]).links
            ]
        return b"".join(read_file(root, lambda cid: self.got[cid.digest]))


@asynccontextmanager
async def js_like_pair(tmp_path, blocks=(), idle_reset_s: float = math.inf):
    """A p2ptrain node (BlockStore + BlockExchange) and a JsLikeBitswap peer, connected."""
    async with connected_hosts(2) as (ours, theirs):
        store = BlockStore(tmp_path / "blocks")
        exchange = BlockExchange(ours.host, store)
        await ours.start(exchange.run)
        js = JsLikeBitswap(theirs.host, blocks, idle_reset_s)
        await theirs.start(js.run)
        yield Node(ours.host, store, exchange, ours.scope), js


def dag_blocks(data: bytes, cid_version: int):
    blocks = list(import_stream(io.BytesIO(data), cid_version=cid_version))
    return blocks, blocks[-1][0]


@pytest.mark.parametrize("cid_version", [0, 1])
async def test_fetch_from_and_serve_to_a_peer_that_half_closes_incoming_streams(tmp_path, cid_version):
    """Issue 15: js-libp2p 3 ends its side of our stream at once; we must keep writing on it.

    Both directions of a 3 MiB file (a root and 13 leaves): each needs at least two messages on the
    stream p2ptrain opened, the second one after the peer's half-close arrived."""
    theirs_data, ours_data = content(3 * MiB + 5, seed=20 + cid_version), content(3 * MiB + 7, seed=30)
    blocks, their_root = dag_blocks(theirs_data, cid_version)
    async with js_like_pair(tmp_path, blocks) as (node, js):
        with trio.fail_after(DEADLINE):
            stats = await node.exchange.fetch_dag(their_root, [js.host.get_id()])
        assert bytes_of(node.store, their_root) == theirs_data
        assert stats.failed == {}
        our_root = add(node.store, ours_data, cid_version)
        with trio.fail_after(DEADLINE):
            assert await js.fetch(our_root, node.host.get_id()) == ours_data


async def test_fetch_after_the_peer_reset_our_idle_stream(tmp_path):
    """Helia resets an incoming Bitswap stream idle for 10 s; our sender keeps its stream up to 60 s.
    The next want must go out on a fresh stream, not fail the fetch (it did: 'stream failed')."""
    first, second = content(300_000, seed=40), content(300_000, seed=41)
    blocks = [*dag_blocks(first, 1)[0], *dag_blocks(second, 1)[0]]
    async with js_like_pair(tmp_path, blocks, idle_reset_s=0.3) as (node, js):
        peer = js.host.get_id()
        with trio.fail_after(DEADLINE):
            await node.exchange.fetch_dag(dag_blocks(first, 1)[1], [peer])
            while not js.resets:  # the peer reset our stream for idling
                await js.changed.wait()
            stats = await node.exchange.fetch_dag(dag_blocks(second, 1)[1], [peer])
        assert stats.failed == {}
        assert bytes_of(node.store, dag_blocks(second, 1)[1]) == second


async def test_a_wantlist_longer_than_one_message_may_carry_is_split(tmp_path):
    """A receiver takes at most MAX_ENTRIES wants a message (go and JS bound theirs too); more queued
    at once went out as one message, which the provider refused and reset (the fetch then failed)."""
    from p2ptrain.ipfs._bitswap_wire import MAX_ENTRIES

    data = content(300_000, seed=50)
    async with nodes(tmp_path, BlockStore, BlockStore) as (provider, fetcher):
        root = add(provider.store, data)
        await fetcher.host.connect(provider.info)
        absent = [make_cid(b"absent %d" % i) for i in range(MAX_ENTRIES + 100)]
        fetcher.exchange.send_wants(provider.host.get_id(), [WantEntry(c) for c in absent])
        with trio.fail_after(DEADLINE):
            await fetcher.exchange.fetch_dag(root, [provider.info])
        assert bytes_of(fetcher.store, root) == data
        assert provider.exchange.stats().get("rejected_bad_message", 0) == 0


async def test_want_have_gets_have_and_send_dont_have_gets_dont_have(tmp_path):
    """Bitswap 1.2 as Kubo and Helia ask: want-have for a held block is answered Have (not the block),
    a want for a missing block with sendDontHave gets DontHave, and one without it gets nothing."""
    held = make_cid(b"held block", version=1)
    missing, quiet = make_cid(b"missing", version=1), make_cid(b"missing, no DontHave wanted", version=1)
    async with js_like_pair(tmp_path) as (node, js):
        node.store.put(held, b"held block")
        with trio.fail_after(DEADLINE):
            await js._send(node.host.get_id(), wants=[
                WantEntry(held, want_have=True, send_dont_have=True),
                WantEntry(quiet),
                WantEntry(missing, send_dont_have=True),
            ])
            while len(js.haves) + len(js.dont_haves) < 2:
                await js.changed.wait()
        assert js.haves == [held] and js.dont_haves == [missing] and js.got == {}
