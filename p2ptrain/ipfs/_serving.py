"""The serving side of Bitswap: what each peer asked of us, and the messages that answer it.

Every peer we talk to has one :class:`Outbox`: our own wants and cancels for it (from fetches) and
what it asked of us (blocks, haves, DontHaves). :func:`queue_wants` takes a peer's want-list
(bounded by :data:`MAX_PEER_WANTS`); :func:`next_messages` reads up to :data:`_SERVE_BATCH` blocks
from the store in a worker thread and packs them with our wants into messages of ~2 MiB, each
within the wire's limits. The exchange (``exchange.py``) owns the streams these messages go on.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID

from p2ptrain.ipfs._bitswap_wire import (
    MAX_ENTRIES,
    MAX_MESSAGE_SIZE,
    PROTOCOLS,
    TARGET_MESSAGE_SIZE,
    Received,
    WantEntry,
    encode_message,
)
from p2ptrain.ipfs._cid import CID, cid_str
from p2ptrain.ipfs._store import BlockSource
from p2ptrain.base import short_id

__all__ = ["MAX_PEER_WANTS", "Outbox", "Packed", "next_messages", "queue_wants"]

logger = logging.getLogger(__name__)

MAX_PEER_WANTS = 8192  # requests one peer may have queued with our server (Kubo's own cap is similar)
_SERVE_BATCH = 8  # blocks loaded from disk per thread hop


class Packed(NamedTuple):
    """One encoded message, and the blocks it serves (counted as served once it is written)."""

    message: bytes
    blocks: int
    block_bytes: int


class Outbox:
    """Our side of one peer: the stream we opened to it, and what waits to be sent on it."""

    def __init__(self, peer_id: ID) -> None:
        self.id = peer_id
        self.wants: dict[bytes, WantEntry] = {}  # our wants/cancels, by CID bytes (last one wins)
        self.serve: dict[bytes, tuple[CID, str]] = {}  # what they asked of us: "block"|"have"|"dont"
        self.wake = trio.Event()
        self.stream: INetStream | None = None
        self.protocol: str = PROTOCOLS[0]
        self.done = False

    def poke(self) -> None:
        self.wake.set()


def queue_wants(peer: Outbox, msg: Received, store: BlockSource) -> None:
    """Queue what ``msg`` asks of us (or cancels) in ``peer``'s outbox, and wake its sender."""
    if msg.full_wantlist:
        peer.serve.clear()
    for want in msg.wants:
        key = bytes(want.cid)
        if want.cancel:
            peer.serve.pop(key, None)
        elif len(peer.serve) >= MAX_PEER_WANTS:
            # What a peer may queue with us is bounded; the rest it can ask again (Kubo re-sends).
            logger.info("bitswap: peer %s wants more than %d blocks; ignoring the rest",
                        short_id(peer.id), MAX_PEER_WANTS)
            break
        elif store.has(want.cid):
            peer.serve[key] = (want.cid, "have" if want.want_have else "block")
        elif want.send_dont_have:
            peer.serve[key] = (want.cid, "dont")
        # else: Kubo would remember the want until it gets the block; we do not fetch for others.
    if peer.serve:
        peer.poke()


def _load(store: BlockSource, items: list[tuple[CID, str]]) -> list[tuple[CID, str, bytes | None]]:
    """Read the blocks to send (in a worker thread); a block gone or corrupt becomes a DontHave."""
    out = []
    for cid, kind in items:
        data = None
        if kind == "block":
            try:
                data = store.get(cid)
            except Exception as exc:
                logger.warning("bitswap: cannot serve %s: %s", cid_str(cid), exc)
                kind = "dont"
        out.append((cid, kind, data))
    return out


async def next_messages(peer: Outbox, store: BlockSource) -> list[Packed]:
    """Take queued wants and up to one batch of served blocks; pack them into messages."""
    # At most MAX_ENTRIES wants a message: a receiver refuses more (ours does, bitswap_wire);
    # the rest go in the next message.
    wants: list[WantEntry] = []
    while peer.wants and len(wants) < MAX_ENTRIES:
        wants.append(peer.wants.pop(next(iter(peer.wants))))
    items: list[tuple[CID, str]] = []
    while peer.serve and len(items) < _SERVE_BATCH:
        key = next(iter(peer.serve))
        items.append(peer.serve.pop(key))
    loaded = await trio.to_thread.run_sync(_load, store, items) if items else []
    messages: list[Packed] = []
    blocks: list[tuple[CID, bytes]] = []
    haves: list[CID] = []
    donts: list[CID] = []
    size = 0
    for cid, kind, data in loaded:
        if data is not None and blocks and size + len(data) > TARGET_MESSAGE_SIZE:
            message = encode_message(wants=wants, blocks=blocks, protocol=peer.protocol)
            messages.append(Packed(message, len(blocks), size))
            wants, blocks, size = [], [], 0
        if data is not None:
            blocks.append((cid, data))
            size += len(data)
        elif kind == "have":
            haves.append(cid)
        else:
            donts.append(cid)
    if wants or blocks or haves or donts:
        message = encode_message(
            wants=wants, blocks=blocks, haves=haves, dont_haves=donts, protocol=peer.protocol
        )
        messages.append(Packed(message, len(blocks), size))
    assert all(len(m.message) <= MAX_MESSAGE_SIZE + 8 for m in messages)
    return messages
