"""Channels between real libp2p hosts on 127.0.0.1: framing, limits, closes, interop."""

from __future__ import annotations

import hashlib
from contextlib import asynccontextmanager

import libp2p
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr
from multiaddr import Multiaddr

from p2ptrain.net.host import make_host, noise_only
from p2ptrain.net.streams import (
    Channel,
    ChannelClosed,
    MessageTooLarge,
    open_channel,
    serve_channels,
    short_id,
)

PROTO = "/p2ptrain/test-channel/1.0.0"
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
DEADLINE = 30


@asynccontextmanager
async def running(host):
    async with host.run(listen_addrs=[Multiaddr(LOOPBACK)]):
        yield host


async def connect(a, b) -> None:
    addr = b.get_addrs()[0]
    if "/p2p/" not in str(addr):
        addr = Multiaddr(f"{addr}/p2p/{b.get_id().to_base58()}")
    await a.connect(info_from_p2p_addr(addr))


def ours():
    return make_host(create_new_key_pair(), [LOOPBACK])


def stock():
    """An unmodified py-libp2p host (stock yamux and Noise classes), Noise only."""
    kp = create_new_key_pair()
    return libp2p.new_host(key_pair=kp, sec_opt=noise_only(kp), muxer_preference="YAMUX")


def pattern(n: int, seed: int = 0) -> bytes:
    """Deterministic bytes that differ at every offset of a frame, so misalignment shows."""
    out = bytearray()
    counter = 0
    while len(out) < n:
        out += hashlib.sha256(f"{seed}:{counter}".encode()).digest()
        counter += 1
    return bytes(out[:n])


SIZES = [0, 1, 65_523, 65_524, 65_525, 1 << 20, 16 << 20]


async def echo(channel: Channel) -> None:
    """Echo every message until the peer closes."""
    while True:
        try:
            message = await channel.recv(64 << 20)
        except ChannelClosed:
            return
        await channel.send(message)


async def roundtrip_all_sizes(client_host, server_host) -> None:
    serve_channels(server_host, PROTO, echo)
    await connect(client_host, server_host)
    async with await open_channel(client_host, server_host.get_id(), PROTO) as channel:
        assert channel.remote_peer == server_host.get_id()
        for i, size in enumerate(SIZES):
            payload = pattern(size, seed=i)
            await channel.send(payload)
            back = await channel.recv(64 << 20)
            assert len(back) == size
            assert back == payload


async def test_roundtrip_many_sizes():
    with trio.fail_after(DEADLINE):
        async with running(ours()) as a, running(ours()) as b:
            await roundtrip_all_sizes(a, b)


async def test_send_accepts_memoryview_and_keeps_message_boundaries():
    received: list[bytes] = []
    done = trio.Event()

    async def collect(channel: Channel) -> None:
        for _ in range(3):
            received.append(await channel.recv(1 << 20))
        done.set()

    with trio.fail_after(DEADLINE):
        async with running(ours()) as a, running(ours()) as b:
            serve_channels(b, PROTO, collect)
            await connect(a, b)
            async with await open_channel(a, b.get_id(), PROTO) as channel:
                big = bytearray(pattern(200_000))
                await channel.send(memoryview(big)[1000:101_000])
                await channel.send(b"")
                await channel.send(b"x")
                await done.wait()
    assert received == [bytes(big[1000:101_000]), b"", b"x"]


async def test_oversize_message_is_refused_and_closes_the_channel():
    outcome: dict[str, BaseException] = {}
    done = trio.Event()

    async def strict(channel: Channel) -> None:
        try:
            await channel.recv(1000)
        except MessageTooLarge as error:
            outcome["error"] = error
            with pytest.raises(ChannelClosed):
                await channel.recv(1000)
        finally:
            done.set()

    with trio.fail_after(DEADLINE):
        async with running(ours()) as a, running(ours()) as b:
            serve_channels(b, PROTO, strict)
            await connect(a, b)
            channel = await open_channel(a, b.get_id(), PROTO)
            await channel.send(b"y" * 1001)
            await done.wait()
            # The receiver reset the stream: our next receive fails instead of hanging.
            with pytest.raises(ChannelClosed):
                await channel.recv(10)
    error = outcome["error"]
    assert "1001" in str(error) and "1000" in str(error)
    assert short_id(a.get_id()) in str(error)


async def test_peer_closing_mid_message_raises_channel_closed_naming_the_peer():
    """The peer announces 1 MiB, sends half, and closes: the reader must not return half a message."""
    outcome: dict[str, BaseException] = {}
    done = trio.Event()

    async def reader(channel: Channel) -> None:
        try:
            await channel.recv(2 << 20)
        except ChannelClosed as error:
            outcome["error"] = error
        finally:
            done.set()

    with trio.fail_after(DEADLINE):
        async with running(ours()) as a, running(ours()) as b:
            serve_channels(b, PROTO, reader)
            await connect(a, b)
            stream = await a.new_stream(b.get_id(), [PROTO])
            await stream.write((1 << 20).to_bytes(8, "big") + b"z" * (1 << 19))
            await stream.close()
            await done.wait()
    error = outcome["error"]
    assert isinstance(error, ChannelClosed)
    assert short_id(a.get_id()) in str(error)
    assert "524288 of 1048576" in str(error)


async def test_clean_close_between_messages_raises_channel_closed():
    outcome: dict[str, object] = {}
    done = trio.Event()

    async def reader(channel: Channel) -> None:
        try:
            outcome["first"] = await channel.recv(100)
            await channel.recv(100)
        except ChannelClosed as error:
            outcome["error"] = error
        finally:
            done.set()

    with trio.fail_after(DEADLINE):
        async with running(ours()) as a, running(ours()) as b:
            serve_channels(b, PROTO, reader)
            await connect(a, b)
            async with await open_channel(a, b.get_id(), PROTO) as channel:
                await channel.send(b"last")
            await done.wait()
    assert outcome["first"] == b"last"
    assert isinstance(outcome["error"], ChannelClosed)


async def test_send_after_close_raises():
    with trio.fail_after(DEADLINE):
        async with running(ours()) as a, running(ours()) as b:
            serve_channels(b, PROTO, echo)
            await connect(a, b)
            channel = await open_channel(a, b.get_id(), PROTO)
            await channel.aclose()
            with pytest.raises(ChannelClosed):
                await channel.send(b"late")


@pytest.mark.parametrize("direction", ["ours_dials_stock", "stock_dials_ours"])
async def test_interop_with_stock_py_libp2p_host(direction):
    with trio.fail_after(DEADLINE):
        async with running(ours()) as mine, running(stock()) as theirs:
            if direction == "ours_dials_stock":
                await roundtrip_all_sizes(mine, theirs)
            else:
                await roundtrip_all_sizes(theirs, mine)
