"""A fetch bounded in bytes refuses what is over the bound as it arrives, and keeps none of it
(issue 27, "--accept-tasks memory bomb"): two real hosts on loopback, the provider serving
content built with the real encoders."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import pytest
import trio

from p2ptrain.ipfs import (
    BlockExchange,
    BlockStore,
    CHUNK_SIZE,
    CID,
    DAG_PB,
    EmbeddedStore,
    FetchError,
    cid_from_digest,
    dag_bytes_limit,
    encode_file_leaf,
    encode_file_node,
)
from p2ptrain.testing import connected_hosts

GIB = 1 << 30


def _put(store: BlockStore, block: bytes) -> CID:
    cid = cid_from_digest(hashlib.sha256(block).digest(), DAG_PB, 0)
    store.put(cid, block)
    return cid


def repeated_leaf_file(store: BlockStore, declared: int) -> CID:
    """A well-formed UnixFS file of about ``declared`` bytes (a whole number of 174-leaf subtrees)
    that is one 256 KiB leaf linked at every position (sizes all consistent): a few blocks to
    fetch, ``declared`` bytes to read."""
    leaf = _put(store, encode_file_leaf(os.urandom(CHUNK_SIZE)))
    child, size, tsize = leaf, CHUNK_SIZE, CHUNK_SIZE + 14
    while size * 174 <= declared:
        block = encode_file_node([(bytes(child), tsize)] * 174, [size] * 174)
        child, size, tsize = _put(store, block), size * 174, tsize * 174 + len(block)
    count = declared // size
    return _put(store, encode_file_node([(bytes(child), tsize)] * count, [size] * count))


def held(store: BlockStore) -> int:
    return sum(1 for _ in store.iter_cids())


async def _fetch(tmp_path: Path, build, max_bytes: int) -> tuple[BlockStore, FetchError, int]:
    """The provider holds what ``build(store)`` makes; the fetcher fetches it under ``max_bytes``."""
    theirs, ours = BlockStore(tmp_path / "provider"), BlockStore(tmp_path / "fetcher")
    root = build(theirs)
    async with connected_hosts(2) as (provider, fetcher):
        await provider.start(BlockExchange(provider.host, theirs).run)
        exchange = BlockExchange(fetcher.host, ours)
        await fetcher.start(exchange.run)
        with trio.fail_after(60), pytest.raises(FetchError) as refused:
            await exchange.fetch_dag(root, [provider.id], max_bytes=max_bytes)
        provider.kill()
    return ours, refused.value, held(theirs)


async def test_a_file_declaring_more_than_the_bound_is_refused_at_its_root(tmp_path: Path) -> None:
    """Before: the fetch took the DAG's few distinct blocks (1.3 MB for a declared GiB) and
    reading it then cost the declared gigabyte."""
    ours, refused, _ = await _fetch(tmp_path, lambda s: repeated_leaf_file(s, GIB), max_bytes=1 << 20)
    assert refused.refused
    declared = int(re.search(r"declares (\d+) bytes, over the 1048576 byte limit", str(refused))[1])
    assert declared > 0.9 * GIB
    assert held(ours) == 0  # the root it had stored is removed with the refusal


def lying_root_over_distinct_data(store: BlockStore, chunks: int) -> CID:
    """A root that declares 1,000 bytes above a subtree of ``chunks`` distinct 256 KiB leaves:
    its declared size passes any bound, so only counting the blocks as they arrive stops it."""
    leaves = [_put(store, encode_file_leaf(os.urandom(CHUNK_SIZE))) for _ in range(chunks)]
    subtree = _put(store, encode_file_node([(bytes(c), CHUNK_SIZE + 14) for c in leaves], [CHUNK_SIZE] * chunks))
    return _put(store, encode_file_node([(bytes(subtree), 1000)], [1000]))


async def test_distinct_data_over_the_bound_is_refused_as_it_arrives_and_removed(tmp_path: Path) -> None:
    """Before: refused too, but every block that had arrived stayed on the disk (2 GiB after a
    refused task, issue 27)."""
    ours, refused, _ = await _fetch(tmp_path, lambda s: lying_root_over_distinct_data(s, 64), max_bytes=1 << 20)
    assert refused.refused
    assert f"larger than the {1 << 20} byte limit" in str(refused)
    assert held(ours) == 0


async def test_an_honest_file_fetches_under_the_bound_its_size_gives(tmp_path: Path) -> None:
    """dag_bytes_limit(size) is what a fetch of a file of that size is given: it must never refuse
    one, CIDv0 or CIDv1, a chunk or many."""
    for i, (size, version) in enumerate([(0, 0), (1000, 0), (CHUNK_SIZE, 0), (CHUNK_SIZE + 1, 0),
                                         (40 * CHUNK_SIZE + 3, 0), (40 * CHUNK_SIZE + 3, 1)]):
        theirs, ours = EmbeddedStore(tmp_path / f"p{i}"), BlockStore(tmp_path / f"f{i}")
        root = theirs.add_bytes(os.urandom(size), cid_version=version)
        async with connected_hosts(2) as (provider, fetcher):
            await provider.start(BlockExchange(provider.host, theirs.blocks).run)
            exchange = BlockExchange(fetcher.host, ours)
            await fetcher.start(exchange.run)
            with trio.fail_after(60):
                stats = await exchange.fetch_dag(root, [provider.id], max_bytes=dag_bytes_limit(size))
            provider.kill()
        assert size <= stats.bytes <= dag_bytes_limit(size)
