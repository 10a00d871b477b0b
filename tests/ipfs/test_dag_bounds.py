"""Hostile DAGs, built with the real encoders: the 174-links-to-one-child bomb, a 1,100-block chain,
and the legal file of repeated chunks that must still read right (issue 13, found #3)."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from multiaddr import Multiaddr

from p2ptrain.ipfs import (
    BlockExchange,
    BlockStore,
    CHUNK_SIZE,
    CID,
    DAG_PB,
    DagError,
    EmbeddedStore,
    FetchError,
    FileTooLarge,
    cid_from_digest,
    encode_file_leaf,
    encode_file_node,
    import_stream,
    parse_cid,
    read_file,
    walk_dag,
)
from p2ptrain.ipfs._unixfs import MAX_DEPTH
from p2ptrain.net import make_host

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
# Far more than any DAG here has distinct blocks, far less than the bombs' 174**levels visits: a
# reader or walk that goes past it is walking the bomb.
VISIT_BUDGET = 2_000


def put(store: BlockStore, block: bytes) -> CID:
    cid = cid_from_digest(hashlib.sha256(block).digest(), DAG_PB, 0)
    store.put(cid, block)
    return cid


def bomb(store: BlockStore, levels: int, leaf: bytes = b"") -> tuple[CID, int]:
    """``levels`` inner nodes above one leaf, each with 174 links to the node below; returns (root,
    declared file size). With an empty leaf every size is 0 and consistent, so only the walk's
    shape can tell it from a file."""
    child = put(store, encode_file_leaf(leaf))
    size = len(leaf)
    for _ in range(levels):
        block = encode_file_node([(bytes(child), 100)] * 174, [size] * 174)
        child, size = put(store, block), size * 174
    return child, size


def chain(store: BlockStore, depth: int) -> CID:
    """A 1-byte file hidden under ``depth`` nodes of one link each (sizes all consistent)."""
    cid = put(store, encode_file_leaf(b"x"))
    for _ in range(depth):
        cid = put(store, encode_file_node([(bytes(cid), 10)], [1]))
    return cid


def counting(get: Callable[[CID], bytes]) -> tuple[Callable[[CID], bytes], list[int]]:
    calls = [0]

    def getter(cid: CID) -> bytes:
        calls[0] += 1
        assert calls[0] <= VISIT_BUDGET, "the reader is walking the bomb link by link"
        return get(cid)

    return getter, calls


def test_empty_child_bomb_is_refused_before_it_is_walked(tmp_path):
    store = BlockStore(tmp_path / "blocks")
    root, size = bomb(store, levels=3)
    assert size == 0
    getter, calls = counting(store.get)
    with pytest.raises(DagError, match="empty subtree"):
        b"".join(read_file(root, getter))
    assert calls[0] == 1


def test_embedded_cat_of_the_bomb_fails_with_the_declared_error(tmp_path):
    """Before the fix: 0 bytes and no error (after 174**2 block reads here; 174**3 took 173 s)."""
    es = EmbeddedStore(tmp_path)
    root, _ = bomb(es.blocks, levels=2)
    with pytest.raises(DagError):
        es.cat(root)


def test_a_big_declared_bomb_fails_fast_under_the_callers_byte_limit(tmp_path):
    store = BlockStore(tmp_path / "blocks")
    root, size = bomb(store, levels=3, leaf=b"x")
    assert size == 174**3
    getter, calls = counting(store.get)
    with pytest.raises(FileTooLarge):
        b"".join(read_file(root, getter, max_bytes=64 * 1024))
    assert calls[0] == 1
    es = EmbeddedStore(tmp_path)
    with pytest.raises(FileTooLarge):
        es.cat(root, max_bytes=64 * 1024)


def test_repeated_chunks_are_legal_and_read_right(tmp_path):
    """Kubo names a file of zeros with one leaf linked at every position; that must still work."""
    data = bytes(3 * CHUNK_SIZE + 5)
    es = EmbeddedStore(tmp_path)
    root = es.add_bytes(data)
    assert es.cat(root) == data
    assert es.has(root)
    distinct = list(walk_dag(parse_cid(root), es.blocks.get))
    # root, the full zero chunk (linked 3 times), the 5-byte tail: each visited once
    assert len(distinct) == 3


def test_walks_on_a_1100_deep_chain_reject_cleanly(tmp_path):
    """Before the fix: RecursionError from has() and pin add."""
    es = EmbeddedStore(tmp_path)
    root = chain(es.blocks, 1100)
    assert es.has(root) is False  # not a DAG this store can use: a fetch would say why
    with pytest.raises(DagError, match="deeper than"):
        es.pin_add(root)
    with pytest.raises(DagError, match="deeper than"):
        es.cat(root)
    assert es.pin_ls() == {}


def test_a_chain_within_the_depth_bound_works(tmp_path):
    es = EmbeddedStore(tmp_path)
    root = chain(es.blocks, MAX_DEPTH - 1)
    assert es.has(root)
    es.pin_add(root)
    assert es.cat(root) == b"x"


def test_walk_visits_each_block_of_the_bomb_once(tmp_path):
    store = BlockStore(tmp_path / "blocks")
    root, _ = bomb(store, levels=3)
    getter, calls = counting(store.get)
    assert len(list(walk_dag(root, getter))) == 4
    assert calls[0] == 4


async def test_fetch_session_looks_at_each_block_once(tmp_path):
    """Before the fix the session resolved the held child once per link to it: 1 + 174 + 174**2
    local blocks for a two-level bomb (and 174**3 more at three levels)."""
    store = BlockStore(tmp_path / "blocks")
    root, _ = bomb(store, levels=2)
    host = make_host(create_new_key_pair(), [LOOPBACK])
    exchange = BlockExchange(host, store)
    async with host.run(listen_addrs=[Multiaddr(LOOPBACK)]), trio.open_nursery() as nursery:
        await nursery.start(exchange.run)
        with trio.fail_after(60):
            stats = await exchange.fetch_dag(root, [])
        nursery.cancel_scope.cancel()
    assert stats.local_blocks == 3
    assert stats.blocks == 0


async def test_fetch_session_refuses_a_chain_deeper_than_the_bound(tmp_path):
    store = BlockStore(tmp_path / "blocks")
    root = chain(store, MAX_DEPTH + 5)
    host = make_host(create_new_key_pair(), [LOOPBACK])
    exchange = BlockExchange(host, store)
    async with host.run(listen_addrs=[Multiaddr(LOOPBACK)]), trio.open_nursery() as nursery:
        await nursery.start(exchange.run)
        with trio.fail_after(60), pytest.raises(FetchError, match="deeper than"):
            await exchange.fetch_dag(root, [])
        nursery.cancel_scope.cancel()


def test_importer_output_never_has_empty_children():
    """The empty-subtree rule cannot refuse real files: the importer only makes non-empty children."""
    for size in (0, 1, CHUNK_SIZE, CHUNK_SIZE + 1):
        blocks = list(import_stream(io.BytesIO(bytes(size))))
        store: dict[bytes, bytes] = {cid.digest: block for cid, block in blocks}
        root = blocks[-1][0]
        assert b"".join(read_file(root, lambda c: store[c.digest])) == bytes(size)


def test_a_bomb_of_one_byte_leaves_reads_right_with_each_block_read_once_or_so(tmp_path):
    """Legal (every size adds up) but 174**3 visits of a 1-byte leaf without the subtree cache."""
    store = BlockStore(tmp_path / "blocks")
    root, size = bomb(store, levels=3, leaf=b"x")
    getter, calls = counting(store.get)
    assert b"".join(read_file(root, getter)) == b"x" * size
    assert calls[0] == 3 + 174  # three nodes once each, the leaf under the first subtree's 174 links
