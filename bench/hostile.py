"""A hostile peer for the chaos bench: a real libp2p host that does each attack of issue 13.

It is what an attacker on the network would run, with nothing faked on our side: a Noise/yamux host
(:func:`p2ptrain.net.make_host`), gossipsub set up as the nodes set it up
(:mod:`p2ptrain.net._pubsub`), messages signed by :func:`p2ptrain.wire.encode` (or raw bytes where
the attack is a malformed one), a Bitswap server (:class:`p2ptrain.ipfs.BlockExchange`)
serving the blocks its task announcements name, and channels on the collective protocol.

Each attack is one function taking a :class:`HostilePeer` (or a node's home, for the local control
socket) and returning a small dict of what it sent, for the bench's report. Every attack is bounded
in count and time; nothing here waits without a deadline.

Used by bench/chaos.py; tests/bench_chaos checks that what it sends are real, accepted frames.
"""

from __future__ import annotations

import math
import os
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio
from libp2p.abc import IHost, INetStream
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.validators import PUBSUB_SIGNING_PREFIX
from multiaddr import Multiaddr

from p2ptrain.ipfs import (
    BlockExchange,
    BlockStore,
    DAG_PB,
    EmbeddedStore,
    MAX_MESSAGE_SIZE,
    PROTOCOLS as BITSWAP_PROTOCOLS,
    cid_str,
    encode_file_leaf,
    encode_file_node,
    make_cid,
    varint,
)
from p2ptrain.wire import (
    Capabilities,
    Header,
    Heartbeat,
    Kind,
    MESH_TOPIC,
    PROTOCOL as COLLECTIVE_PROTOCOL,
    TASKS_TOPIC,
    TaskAnnounce,
    encode,
)
from p2ptrain.control import socket_path
from p2ptrain.net import make_host, make_pubsub, open_channel, running_pubsub

# Connecting to a node and seeing it in a topic's gossipsub peers takes ~1 s on loopback (pubsub's
# hello, then the subscription exchange); a loaded shared box takes several.
MESH_WAIT_S = 20.0
# Each attack's own writes and reads are bounded by this (a stuck victim must not stall the bench).
IO_TIMEOUT_S = 10.0
# The rate-paced attacks (flood, fresh identities) send this many messages per gossipsub RPC: a batch
# every 50 ms at 1,000 messages/s.
BATCH = 50
# ... within this many message bytes an RPC: pubsub refuses (and resets the stream of) an RPC over 1 MiB.
RPC_BYTES = 900 * 1024

# Attack sizes from issue 13's "Found" list.
TS_OVERFLOW = 10**400  # finding 1: an int JSON carries but a float cannot hold
BOMB_FANOUT = 174  # finding 3: Kubo's own most links per node, all to the same child
BOMB_LEVELS = 3  # finding 3: 174**3 = 5.3 M leaf visits for a reader that does not deduplicate
HELLO_CHANNELS = 80  # finding 4: more than the 64 pending HELLOs the collective inbox held
BITSWAP_STREAMS = 200  # finding 5
BITSWAP_MESSAGE = 4 * 1024 * 1024  # finding 5: the message size each stream announces
CONTROL_DEPTH = 100_000  # finding 6: '[' repeated, one control request line
WRITE_CHUNK = 256 * 1024  # one write on a Bitswap stream: yamux's initial window
FRESH_IDENTITIES = 9000  # finding 7
FRESH_ADDRS = 16  # finding 7: the most addresses a heartbeat may carry, each one dialed
FLOOD_RATE = 1000.0  # messages per second, the target load for `node status` latency


class HostilePeer:
    """A libp2p host with gossipsub and a Bitswap server, run by :func:`hostile_peer`."""

    def __init__(self, host: IHost, pubsub: Any, key_pair: KeyPair, blocks: BlockStore) -> None:
        self.host = host
        self.pubsub = pubsub
        self.key_pair = key_pair
        self.blocks = blocks
        self.peer_id: ID = host.get_id()
        self._seq = int(time.time() * 1000)  # above anything a replay window saw from an earlier run
        self._gossip_seq = 0

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    @property
    def addr(self) -> str:
        return f"{self.host.get_addrs()[0]}"

    async def connect(self, addr: str) -> ID:
        """Dial a node by its full multiaddr (``.../p2p/<id>``); returns its peer ID."""
        info = info_from_p2p_addr(Multiaddr(addr))
        with trio.fail_after(IO_TIMEOUT_S):
            await self.host.connect(info)
        return info.peer_id

    async def wait_in_topic(self, topic: str, peers: Sequence[ID], timeout: float = MESH_WAIT_S) -> None:
        """Until gossipsub knows each of ``peers`` is subscribed to ``topic`` (so a publish reaches them)."""
        with trio.fail_after(timeout):
            while not all(p in self.pubsub.peer_topics.get(topic, set()) for p in peers):
                await trio.sleep(0.05)

    def signed(self, msg: Any, ts: float | None = None) -> bytes:
        """``msg`` framed and signed by :func:`p2ptrain.wire.encode` with this peer's key."""
        return encode(msg, self.key_pair, self.next_seq(), ts=ts)

    async def publish(self, topic: str, data: bytes) -> None:
        """Publish ``data`` as this peer (gossipsub signs it with our key: strict signing passes)."""
        await self.pubsub.publish(topic, data)

    async def publish_as(self, key_pair: KeyPair, topic: str, data: bytes) -> None:
        """Inject ``data`` into gossipsub with another identity as its origin, signed by that key,
        as a relay would forward it: gossipsub's strict signing accepts it (the signature is the
        origin's), so the honest nodes' routers see a message from a peer that never connected."""
        await self.pubsub.push_msg(self.peer_id, gossip_message(key_pair, topic, data, self._next_gossip_seq()))

    async def send_batch(self, msgs: Sequence[rpc_pb2.Message]) -> None:
        """Write ``msgs`` as one gossipsub RPC straight to every connected pubsub peer: one write per
        peer rather than per message, so a Python attacker can keep up a flood. The receivers check
        each message (signature, seen-cache, rate limits) and relay it as usual."""
        rpc = rpc_pb2.RPC(publish=list(msgs))
        for stream in list(self.pubsub.peers.values()):
            await self.pubsub.write_msg(stream, rpc)

    def _next_gossip_seq(self) -> bytes:
        self._gossip_seq += 1
        return self._gossip_seq.to_bytes(8, "big")

    def put_blocks(self, blocks: Sequence[tuple[Any, bytes]]) -> None:
        """Serve these ``(cid, bytes)`` blocks over Bitswap to whoever asks."""
        for cid, data in blocks:
            self.blocks.put(cid, data)

    @property
    def store(self) -> EmbeddedStore:
        """The files this peer serves (a data set, a task), over the same blocks."""
        return EmbeddedStore(self.blocks.root.parent)


def gossip_message(key_pair: KeyPair, topic: str, data: bytes, seqno: bytes) -> rpc_pb2.Message:
    """A gossipsub message whose origin is ``key_pair``'s peer, signed as strict signing requires."""
    msg = rpc_pb2.Message(
        data=data, topicIDs=[topic], from_id=ID.from_pubkey(key_pair.public_key).to_bytes(), seqno=seqno
    )
    msg.signature = key_pair.private_key.sign(PUBSUB_SIGNING_PREFIX.encode() + msg.SerializeToString())
    msg.key = key_pair.public_key.serialize()
    return msg


@asynccontextmanager
async def hostile_peer(topics: Sequence[str] = (MESH_TOPIC, TASKS_TOPIC)) -> AsyncIterator[HostilePeer]:
    """Run a hostile host on 127.0.0.1 (a fresh identity) with gossipsub joined to ``topics`` and a
    Bitswap server; everything stops when the block exits."""
    key_pair = create_new_key_pair()
    host = make_host(key_pair, ["/ip4/127.0.0.1/tcp/0"])
    pubsub = make_pubsub(host)
    with tempfile.TemporaryDirectory(prefix="p2ptrain-hostile-") as tmp:
        blocks = EmbeddedStore(Path(tmp)).blocks  # files and data sets added to it are served too
        async with host.run(listen_addrs=[Multiaddr("/ip4/127.0.0.1/tcp/0")]):
            async with running_pubsub(pubsub), trio.open_nursery() as nursery:
                exchange = BlockExchange(host, blocks)
                await nursery.start(exchange.run)
                for topic in topics:
                    await pubsub.subscribe(topic)
                try:
                    yield HostilePeer(host, pubsub, key_pair, blocks)
                finally:
                    nursery.cancel_scope.cancel()


def _caps() -> Capabilities:
    return Capabilities(device="cpu", cpu_count=1, free_ram_bytes=1 << 30, version="0.0.0")


# ---- the attacks, in the order of issue 13's "Found" list -------------------------------------------


def ts_overflow_message(peer: HostilePeer) -> bytes:
    """Finding 1: a correctly signed heartbeat whose envelope ``ts`` is 10**400 (no float holds it)."""
    return peer.signed(Heartbeat(addrs=(peer.addr,), caps=_caps()), ts=TS_OVERFLOW)


async def ts_overflow(peer: HostilePeer) -> dict[str, Any]:
    await peer.publish(MESH_TOPIC, ts_overflow_message(peer))
    return {"messages": 1, "ts": "10**400"}


def empty_dagpb_block() -> tuple[Any, bytes]:
    """Finding 2: the empty dag-pb node (zero bytes; a valid block, not a UnixFS file)."""
    return make_cid(b"", DAG_PB, 0), b""


async def announce_task(peer: HostilePeer, blocks: Sequence[tuple[Any, bytes]], name: str) -> str:
    """Serve ``blocks`` and announce the first one as a task; returns its CID."""
    peer.put_blocks(blocks)
    task_cid = cid_str(blocks[0][0])
    await peer.publish(TASKS_TOPIC, peer.signed(TaskAnnounce(task_cid=task_cid, name=name)))
    return task_cid


async def empty_dagpb_task(peer: HostilePeer) -> dict[str, Any]:
    task_cid = await announce_task(peer, [empty_dagpb_block()], "empty-dag-pb")
    return {"task_cid": task_cid}


def dag_bomb(levels: int = BOMB_LEVELS, fanout: int = BOMB_FANOUT) -> list[tuple[Any, bytes]]:
    """Finding 3: ``levels`` inner nodes, each with ``fanout`` links all to the one node below it,
    over one empty file leaf; root first. A few KB per level, ``fanout**levels`` paths to the leaf."""
    leaf = encode_file_leaf(b"")
    child_cid, child = make_cid(leaf, DAG_PB, 0), leaf
    blocks = [(child_cid, child)]
    for _ in range(levels):
        node = encode_file_node([(bytes(child_cid), len(child))] * fanout, [0] * fanout)
        child_cid, child = make_cid(node, DAG_PB, 0), node
        blocks.append((child_cid, child))
    return blocks[::-1]


async def dag_bomb_task(peer: HostilePeer) -> dict[str, Any]:
    blocks = dag_bomb()
    task_cid = await announce_task(peer, blocks, "dag-bomb")
    return {"task_cid": task_cid, "blocks": len(blocks), "bytes": sum(len(b) for _, b in blocks),
            "leaf_paths": BOMB_FANOUT**BOMB_LEVELS}


def hello_frame(round_id: int) -> bytes:
    """Finding 4: a collective HELLO for a round nobody planned (a 32-byte made-up digest)."""
    return Header(Kind.HELLO, round_id).pack() + os.urandom(32)


async def collective_hellos(
    peer: HostilePeer, targets: Sequence[ID], hold_s: float, channels: int = HELLO_CHANNELS
) -> dict[str, Any]:
    """Open ``channels`` collective channels to each target, send a HELLO for a round nobody
    planned on each, and hold them open: ``hold_s`` in all (a non-member parking rounds in the inbox)."""
    held: list[Any] = []
    refused = 0

    async def park(target: ID, i: int) -> None:
        nonlocal refused
        try:
            channel = await open_channel(peer.host, target, COLLECTIVE_PROTOCOL)
            held.append(channel)
            await channel.send(hello_frame(2**40 + i))
        except Exception:  # the victim refused (BUSY, reset, stream cap): that is a result, counted
            refused += 1

    started = trio.current_time()
    try:
        with trio.move_on_after(hold_s):
            async with trio.open_nursery() as nursery:
                for target in targets:
                    for i in range(channels):
                        nursery.start_soon(park, target, i)
            await trio.sleep_until(started + hold_s)
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(IO_TIMEOUT_S):
            for channel in held:
                try:
                    await channel.aclose()
                except Exception:  # the victim may have reset it first
                    pass
    return {"channels": len(held), "refused": refused, "targets": len(targets),
            "held_s": round(trio.current_time() - started, 2)}


async def bitswap_pinning(
    peer: HostilePeer, target: ID, hold_s: float, streams: int = BITSWAP_STREAMS, part: int = BITSWAP_MESSAGE - 1
) -> dict[str, Any]:
    """Finding 5: ``streams`` Bitswap streams, each announcing a 4 MiB message and sending up to
    ``part`` bytes of it (never the whole message), all held open for ``hold_s`` in total."""
    head = varint(MAX_MESSAGE_SIZE)
    chunk = b"\0" * WRITE_CHUNK
    opened: list[INetStream] = []
    sent = 0
    refused = 0

    async def fill(stream: INetStream) -> None:
        nonlocal sent
        await stream.write(head)
        left = part
        while left:
            piece = chunk[: min(left, WRITE_CHUNK)]
            await stream.write(piece)
            sent += len(piece)
            left -= len(piece)

    async def attack() -> None:
        nonlocal refused
        try:
            stream = await peer.host.new_stream(target, [TProtocol(BITSWAP_PROTOCOLS[0])])
            opened.append(stream)
            await fill(stream)
        except Exception:  # the victim refused (stream cap, byte budget: a reset): a result, counted
            refused += 1

    started = trio.current_time()
    try:
        with trio.move_on_after(hold_s):
            async with trio.open_nursery() as nursery:
                for _ in range(streams):
                    nursery.start_soon(attack)
            await trio.sleep_until(started + hold_s)
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(IO_TIMEOUT_S):
            for stream in opened:
                try:
                    await stream.reset()
                except Exception:  # the victim may have reset it first
                    pass
    return {"streams": len(opened), "refused": refused, "bytes_sent": sent,
            "held_s": round(trio.current_time() - started, 2)}


def control_bomb(home: Path, depth: int = CONTROL_DEPTH) -> dict[str, Any]:
    """Finding 6 (a local attacker): one control-socket request line of ``depth`` '['."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(IO_TIMEOUT_S)
        sock.connect(os.fspath(socket_path(home)))
        sock.sendall(b"[" * depth + b"\n")
        try:
            answer = sock.recv(4096)
        except OSError as exc:
            answer = f"<{type(exc).__name__}>".encode()
    return {"depth": depth, "answer": answer[:200].decode("utf-8", "replace")}


def fresh_heartbeat(key_pair: KeyPair, seq: int, addrs: int = FRESH_ADDRS) -> bytes:
    """Finding 7: a heartbeat signed by a throwaway identity, naming ``addrs`` dialable addresses
    (loopback, a closed port: each dial is refused at once, and nothing outside this machine is named)."""
    me = ID.from_pubkey(key_pair.public_key).to_base58()
    listed = tuple(f"/ip4/127.0.0.1/tcp/{9 + i}/p2p/{me}" for i in range(addrs))
    return encode(Heartbeat(addrs=listed, caps=_caps()), key_pair, seq)


async def fresh_identities(
    peer: HostilePeer, seconds: float, count: int = FRESH_IDENTITIES, rate: float = FLOOD_RATE
) -> dict[str, Any]:
    """Heartbeats from up to ``count`` fresh identities, paced at ``rate`` per second, for at most
    ``seconds`` (making a key and two signatures each, the attacker's own CPU may set the pace)."""
    started = trio.current_time()
    sent = 0
    while sent < count and trio.current_time() - started < seconds:
        batch = []
        for _ in range(min(BATCH, count - sent)):
            key_pair = create_new_key_pair()
            batch.append(gossip_message(key_pair, MESH_TOPIC, fresh_heartbeat(key_pair, 1), peer._next_gossip_seq()))
        await peer.send_batch(batch)
        sent += len(batch)
        await _pace(started, sent, rate)
    elapsed = trio.current_time() - started
    return {"identities": sent, "seconds": round(elapsed, 2), "rate": round(sent / max(elapsed, 1e-9), 1)}


async def flood(peer: HostilePeer, seconds: float, rate: float = FLOOD_RATE) -> dict[str, Any]:
    """Valid, signed heartbeats from this peer at ``rate`` per second for ``seconds`` (each one is
    decoded, verified and applied by every node: the full cost of an accepted message).

    The messages are signed (wire and gossipsub signatures) before the clock starts and sent in
    batches (:meth:`HostilePeer.send_batch`), so the attacker's own CPU does not cap the rate."""
    heartbeat = Heartbeat(addrs=(peer.addr,), caps=_caps())
    ready = [gossip_message(peer.key_pair, MESH_TOPIC, peer.signed(heartbeat), peer._next_gossip_seq())
             for _ in range(int(rate * seconds))]
    return await send_paced(peer, ready, rate)


async def send_paced(peer: HostilePeer, ready: Sequence[rpc_pb2.Message], rate: float,
                     seconds: float | None = None) -> dict[str, Any]:
    """Send gossip messages made beforehand at ``rate`` per second, BATCH to an RPC (fewer where
    BATCH of them would pass pubsub's 1 MiB RPC cap); what was sent.

    With ``seconds``, the flood ends then even if a write is under way: a victim that stops reading
    a flooder holds its writes back for as long as it likes. A write cut short leaves half an RPC
    on the stream, so close this peer after such a flood."""
    batch = max(1, min(BATCH, RPC_BYTES // max(1, max((len(m.data) for m in ready), default=1))))
    started = trio.current_time()
    sent = 0
    with trio.move_on_at(started + seconds if seconds is not None else math.inf) as scope:
        while sent < len(ready):
            await peer.send_batch(ready[sent: sent + batch])
            sent = min(sent + batch, len(ready))
            await _pace(started, sent, rate)
    elapsed = trio.current_time() - started
    return {"messages": sent, "seconds": round(elapsed, 2), "rate": round(sent / max(elapsed, 1e-9), 1),
            "held_back": scope.cancelled_caught and sent < rate * elapsed * 0.9}


async def _pace(started: float, done: int, rate: float) -> None:
    """Sleep until ``done`` items are due at ``rate`` per second (never ahead of the schedule)."""
    await trio.sleep_until(max(trio.current_time(), started + done / rate))
