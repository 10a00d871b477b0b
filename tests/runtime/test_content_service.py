"""The content service between real peers in this process (``p2ptrain.testing.local_peers``).

What a run relies on when it fetches a task, a shard or a model by CID: content added on one peer
is fetched by another, block by block and verified, both through ``ContentService.fetch`` and through
the ``ipfs.fetch`` control op the CLI uses; content nobody has fails with the one declared error
(``ContentUnavailable``, or one clear line over the control socket) within the fetch's timeout.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from p2ptrain.ipfs import ContentUnavailable, PROTOCOLS
from p2ptrain.control import ControlClient, ControlError
from p2ptrain.testing import local_peers

DEADLINE_S = 60.0  # each test: two peers start and exchange at most a few MiB on loopback
MISSING_TIMEOUT_S = 2.0  # the fetch timeout given for content nobody holds
# A fetch refused by every provider returns within its timeout plus this (scheduling on a loaded box).
LATE_S = 4.0
# Over one 256 KiB chunk, so the fetch walks a DAG (a root and several leaves), not a single block.
FILE_BYTES = 1024 * 1024 + 123
# A CID of bytes that no peer holds (never added anywhere; only hashed).
ABSENT = b"p2ptrain: nobody holds these bytes"


async def test_content_added_on_one_peer_is_fetched_by_cid_on_another(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with local_peers(2, tmp_path) as (holder, fetcher):
            data = os.urandom(FILE_BYTES)
            cid = holder.content.store.add_bytes(data)
            assert not fetcher.content.store.has(cid)
            await fetcher.content.fetch(cid, timeout=DEADLINE_S / 2)
            assert fetcher.content.store.cat(cid) == data
            # The control op the CLI uses (`p2ptrain ipfs fetch`, `model pull`): a small payload
            # added through the holder's own control op.
            holder_client, fetcher_client = ControlClient(holder.node.home), ControlClient(fetcher.node.home)
            added = await trio.to_thread.run_sync(lambda: holder_client.call("ipfs.add", text="hello, mesh"))
            reply = await trio.to_thread.run_sync(lambda: fetcher_client.call("ipfs.fetch", cid=added["cid"], timeout=20.0))
            assert reply == {"cid": added["cid"]}
            assert fetcher.content.store.cat(added["cid"]) == b"hello, mesh"


async def test_a_cid_that_nobody_holds_is_content_unavailable_within_the_timeout(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with local_peers(2, tmp_path) as (holder, fetcher):
            cid = holder.content.store.add_bytes(ABSENT, only_hash=True)
            started = trio.current_time()
            with pytest.raises(ContentUnavailable) as caught:
                await fetcher.content.fetch(cid, timeout=MISSING_TIMEOUT_S)
            # Bounded by the timeout it was given (plus scheduling), not by any longer default.
            assert trio.current_time() - started < MISSING_TIMEOUT_S + LATE_S
            assert caught.value.cid == cid
            assert not fetcher.content.store.has(cid)
            client = ControlClient(fetcher.node.home)
            with pytest.raises(ControlError, match=f"cannot fetch {cid}"):
                await trio.to_thread.run_sync(lambda: client.call("ipfs.fetch", cid=cid, timeout=MISSING_TIMEOUT_S))


async def test_a_fetch_from_a_peer_that_never_answers_ends_at_its_timeout(tmp_path: Path) -> None:
    """A connected peer that takes Bitswap streams and never answers (not even DontHave): only the
    caller's timeout ends the fetch, and it says so."""

    async def silent(stream: object) -> None:
        while await stream.read(65536):  # type: ignore[attr-defined]
            pass

    with trio.fail_after(DEADLINE_S):
        async with local_peers(2, tmp_path) as (mute, fetcher):
            assert mute.node.host is not None
            for protocol in PROTOCOLS:
                mute.node.host.set_stream_handler(protocol, silent)
            cid = mute.content.store.add_bytes(os.urandom(FILE_BYTES))
            # The reason names the caller's timeout: not the exchange's stall timeout, nor another.
            with pytest.raises(ContentUnavailable, match=f"did not finish in {MISSING_TIMEOUT_S:.0f} s"):
                await fetcher.content.fetch(cid, timeout=MISSING_TIMEOUT_S)


async def test_a_fetch_over_its_byte_limit_fails_as_content_unavailable(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with local_peers(2, tmp_path) as (holder, fetcher):
            cid = holder.content.store.add_bytes(os.urandom(FILE_BYTES))
            # (Blocks already in flight may still land: the limit bounds a fetch to max_bytes plus
            # one window of blocks; what is declared is the error.)
            with pytest.raises(ContentUnavailable):
                await fetcher.content.fetch(cid, timeout=DEADLINE_S / 2, max_bytes=FILE_BYTES // 2)


async def test_a_lone_peer_says_no_peer_is_connected(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with local_peers(1, tmp_path) as (alone,):
            cid = alone.content.store.add_bytes(ABSENT, only_hash=True)
            with pytest.raises(ContentUnavailable, match="no peer is connected"):
                await alone.content.fetch(cid, timeout=MISSING_TIMEOUT_S)
