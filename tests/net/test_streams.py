"""Channels between real libp2p hosts on 127.0.0.1: framing, limits, closes, interop."""

from __future__ import annotations

import logging
import random
from contextlib import asynccontextmanager

import libp2p
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import PeerInfo
from multiaddr import Multiaddr

from p2ptrain.base import short_id
from p2ptrain.net import Channel, ChannelClosed, MessageTooLarge, noise_only, open_channel, serve_channels
from p2ptrain.net._muxer import FastYamux
from p2ptrain.net._noise import NoiseSession
from p2ptrain.testing import connect, new_host

PROTO = "/p2ptrain/test-channel/1.0.0"
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
DEADLINE = 30


@asynccontextmanager
async def running(host):
    async with host.run(listen_addrs=[Multiaddr(LOOPBACK)]):
        yield host


def stock():
    """An unmodified py-libp2p host (stock yamux and Noise classes), Noise only."""
    kp = create_new_key_pair()
    return libp2p.new_host(key_pair=kp, sec_opt=noise_only(kp), muxer_preference="YAMUX")


def pattern(n: int, seed: int = 0) -> bytes:
    """Deterministic pseudo-random bytes, so a shifted, dropped or repeated frame cannot compare equal."""
    return random.Random(seed).randbytes(n)


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
        async with running(new_host()) as a, running(new_host()) as b:
            await roundtrip_all_sizes(a, b)
            # make_host's connections run our muxer over our Noise session (the fast path).
            conn = a.get_network().get_connection(b.get_id())
            assert isinstance(conn.muxed_conn, FastYamux)
            assert isinstance(conn.muxed_conn.secured_conn, NoiseSession)


async def test_concurrent_channels_in_both_directions_keep_their_bytes():
    """Four channels on one connection, each streaming 12 MiB both ways at once (frames interleave)."""
    size = 12 << 20

    async def sink_and_source(channel: Channel) -> None:
        seed = int.from_bytes(await channel.recv(8), "big")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(channel.send, pattern(size, seed + 100))
            assert await channel.recv(size) == pattern(size, seed)

    async def client(host, peer, seed: int) -> None:
        async with await open_channel(host, peer, PROTO) as channel:
            await channel.send(seed.to_bytes(8, "big"))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(channel.send, pattern(size, seed))
                assert await channel.recv(size) == pattern(size, seed + 100)

    with trio.fail_after(120):
        async with running(new_host()) as a, running(new_host()) as b:
            serve_channels(b, PROTO, sink_and_source)
            await connect(a, b)
            async with trio.open_nursery() as nursery:
                for seed in range(4):
                    nursery.start_soon(client, a, b.get_id(), seed)


async def test_a_reader_that_pauses_longer_than_5_s_does_not_fail_the_writer():
    """py-libp2p's yamux fails a writer after 5 s without window; ours waits for the caller's deadline."""
    size = 48 << 20  # three receive windows: the writer must stall until the reader resumes
    got: list[bytes] = []
    done = trio.Event()

    async def sleepy(channel: Channel) -> None:
        await trio.sleep(6)
        got.append(await channel.recv(size))
        done.set()

    with trio.fail_after(90):
        async with running(new_host()) as a, running(new_host()) as b:
            serve_channels(b, PROTO, sleepy)
            await connect(a, b)
            async with await open_channel(a, b.get_id(), PROTO) as channel:
                started = trio.current_time()
                await channel.send(pattern(size, 7))
                assert trio.current_time() - started > 5  # it really waited for the reader
                await done.wait()
    assert got == [pattern(size, 7)]


async def test_send_accepts_memoryview_and_keeps_message_boundaries():
    received: list[bytes] = []
    done = trio.Event()

    async def collect(channel: Channel) -> None:
        for _ in range(3):
            received.append(await channel.recv(1 << 20))
        done.set()

    with trio.fail_after(DEADLINE):
        async with running(new_host()) as a, running(new_host()) as b:
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
        async with running(new_host()) as a, running(new_host()) as b:
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
        async with running(new_host()) as a, running(new_host()) as b:
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
        async with running(new_host()) as a, running(new_host()) as b:
            serve_channels(b, PROTO, reader)
            await connect(a, b)
            async with await open_channel(a, b.get_id(), PROTO) as channel:
                await channel.send(b"last")
            await done.wait()
    assert outcome["first"] == b"last"
    assert isinstance(outcome["error"], ChannelClosed)


async def test_send_after_close_raises():
    with trio.fail_after(DEADLINE):
        async with running(new_host()) as a, running(new_host()) as b:
            serve_channels(b, PROTO, echo)
            await connect(a, b)
            channel = await open_channel(a, b.get_id(), PROTO)
            await channel.aclose()
            with pytest.raises(ChannelClosed):
                await channel.send(b"late")


async def test_reset_ends_the_channel_on_both_ends_and_keeps_the_connection():
    """``reset`` (what the collective uses on a channel that may hold part of a message): the peer's
    next receive fails, our next send fails, and a new channel on the same connection works."""
    firsts: list[bytes] = []
    errors: list[BaseException] = []
    ended = trio.Semaphore(0)

    async def reader(channel: Channel) -> None:
        try:
            firsts.append(await channel.recv(100))
            await channel.recv(100)
        except ChannelClosed as error:
            errors.append(error)
        finally:
            ended.release()

    with trio.fail_after(DEADLINE):
        async with running(new_host()) as a, running(new_host()) as b:
            serve_channels(b, PROTO, reader)
            await connect(a, b)
            channel = await open_channel(a, b.get_id(), PROTO)
            await channel.send(b"first")
            await channel.reset()
            await ended.acquire()
            with pytest.raises(ChannelClosed):
                await channel.send(b"late")
            async with await open_channel(a, b.get_id(), PROTO) as again:
                await again.send(b"again")
            await ended.acquire()
    assert firsts == [b"first", b"again"]
    assert len(errors) == 2 and all(isinstance(e, ChannelClosed) for e in errors)


@pytest.mark.parametrize("direction", ["ours_dials_stock", "stock_dials_ours"])
async def test_interop_with_stock_py_libp2p_host(direction, caplog):
    """Our frames (up to 1 MiB, within the window) and window grants are plain yamux to a stock host."""
    caplog.set_level(logging.WARNING)
    with trio.fail_after(DEADLINE):
        async with running(new_host()) as mine, running(stock()) as theirs:
            if direction == "ours_dials_stock":
                await roundtrip_all_sizes(mine, theirs)
            else:
                await roundtrip_all_sizes(theirs, mine)
    # Neither muxer saw a window violation or protocol error.
    complaints = [r.getMessage() for r in caplog.records if r.name.startswith(("libp2p", "p2ptrain"))]
    assert not complaints


async def test_cancelled_recv_resumes_the_same_message():
    """A deadline that fires mid-message loses nothing: the next recv returns the whole message."""
    body = pattern(300_000, 3)
    results: dict[str, object] = {}
    first_half_in = trio.Event()
    done = trio.Event()

    async def patient(channel: Channel) -> None:
        with trio.move_on_after(0.5) as idle:
            await channel.recv(1 << 20)  # nothing sent yet: an idle poll times out
        results["idle_timed_out"] = idle.cancelled_caught
        first_half_in.set()
        with trio.move_on_after(1) as partial:
            await channel.recv(1 << 20)  # only the header and half the body arrive
        results["partial_timed_out"] = partial.cancelled_caught
        results["message"] = await channel.recv(1 << 20)
        done.set()

    with trio.fail_after(DEADLINE):
        async with running(new_host()) as a, running(new_host()) as b:
            serve_channels(b, PROTO, patient)
            await connect(a, b)
            stream = await a.new_stream(b.get_id(), [PROTO])
            await first_half_in.wait()
            await stream.write(len(body).to_bytes(8, "big") + body[:150_000])
            await trio.sleep(1.5)
            await stream.write(body[150_000:])
            await done.wait()
    assert results == {"idle_timed_out": True, "partial_timed_out": True, "message": body}


async def test_cancelled_send_closes_the_channel_on_both_ends():
    outcome: dict[str, BaseException] = {}
    done = trio.Event()

    async def never_reads_then_reads(channel: Channel) -> None:
        await trio.sleep(2)
        try:
            while True:
                await channel.recv(64 << 20)
        except ChannelClosed as error:
            outcome["reader"] = error
        done.set()

    with trio.fail_after(DEADLINE):
        async with running(new_host()) as a, running(new_host()) as b:
            serve_channels(b, PROTO, never_reads_then_reads)
            await connect(a, b)
            channel = await open_channel(a, b.get_id(), PROTO)
            with trio.move_on_after(0.5) as scope:
                await channel.send(pattern(32 << 20))  # more than the window: blocks, then cancelled
            assert scope.cancelled_caught
            with pytest.raises(ChannelClosed):
                await channel.send(b"after")
            await done.wait()
    assert isinstance(outcome["reader"], ChannelClosed)


async def _tampering_proxy(target_port: int, tamper: trio.Event, task_status=trio.TASK_STATUS_IGNORED):
    """Forward one TCP connection to ``target_port``; once ``tamper`` is set, flip one bit in the
    middle of the next large client-to-server read (inside a Noise ciphertext)."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    client = await listeners[0].accept()
    server = await trio.open_tcp_stream("127.0.0.1", target_port)

    async def pump(src, dst, may_tamper: bool) -> None:
        flipped = False
        try:
            while data := await src.receive_some(65536):
                if may_tamper and tamper.is_set() and not flipped and len(data) > 4096:
                    altered = bytearray(data)
                    altered[len(altered) // 2] ^= 0x01
                    data, flipped = bytes(altered), True
                await dst.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await dst.aclose()

    async with client, server, listeners[0]:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump, client, server, True)
            nursery.start_soon(pump, server, client, False)


async def test_tampered_ciphertext_ends_the_connection_with_channel_closed(caplog):
    caplog.set_level(logging.DEBUG, logger="p2ptrain.net._muxer")
    tamper = trio.Event()
    outcome: dict[str, object] = {}
    done = trio.Event()

    async def receiver(channel: Channel) -> None:
        try:
            outcome["first"] = await channel.recv(1 << 20)
            await channel.send(b"ok")
            outcome["second"] = await channel.recv(4 << 20)
        except ChannelClosed as error:
            outcome["error"] = error
        finally:
            done.set()

    with trio.fail_after(DEADLINE):
        async with running(new_host()) as a, running(new_host()) as b, trio.open_nursery() as nursery:
            serve_channels(b, PROTO, receiver)
            b_port = int(str(b.get_addrs()[0]).split("/tcp/")[1].split("/")[0])
            proxy_port = await nursery.start(_tampering_proxy, b_port, tamper)
            await a.connect(PeerInfo(b.get_id(), [Multiaddr(f"/ip4/127.0.0.1/tcp/{proxy_port}")]))
            channel = await open_channel(a, b.get_id(), PROTO)
            await channel.send(b"hello")
            assert await channel.recv(10) == b"ok"
            tamper.set()
            with pytest.raises(ChannelClosed):
                # The receiver drops the connection: our send or the reply fails, whichever is first.
                await channel.send(pattern(2 << 20))
                await channel.recv(10)
            await done.wait()
    assert outcome["first"] == b"hello"
    assert "second" not in outcome  # the altered message was never delivered
    assert isinstance(outcome["error"], ChannelClosed)
    assert any("failed authentication" in r.getMessage() for r in caplog.records)


async def test_a_stream_nobody_reads_buffers_only_the_initial_256_KiB_window():
    """The receive window grows only as the reader drains it, so unread streams cost 256 KiB each."""
    parked: list[Channel] = []
    release = trio.Event()

    async def never_reads(channel: Channel) -> None:
        parked.append(channel)
        await release.wait()

    with trio.fail_after(DEADLINE):
        async with running(new_host()) as a, running(new_host()) as b:
            serve_channels(b, PROTO, never_reads)
            await connect(a, b)
            channel = await open_channel(a, b.get_id(), PROTO)
            with trio.move_on_after(2) as blocked:
                await channel.send(pattern(4 << 20))
            assert blocked.cancelled_caught  # the writer ran out of window
            stream = parked[0]._fast
            # Bytes the peer may have sent: held unread, plus read (protocol negotiation) but not
            # yet credited back.
            in_window = len(stream.pieces) + stream._unacked
            release.set()
    assert in_window == 256 * 1024


class _Gate:
    """Lets a proxy pump stop and resume forwarding."""

    def __init__(self) -> None:
        self.open = True
        self.changed = trio.Event()

    def set(self, open_: bool) -> None:
        self.open = open_
        self.changed.set()
        self.changed = trio.Event()

    async def wait_open(self) -> None:
        while not self.open:
            await self.changed.wait()


async def _gated_proxy(target_port: int, gate: _Gate, task_status=trio.TASK_STATUS_IGNORED):
    """Forward one TCP connection; client-to-server bytes flow only while ``gate`` is open."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    client = await listeners[0].accept()
    server = await trio.open_tcp_stream("127.0.0.1", target_port)

    async def pump(src, dst, gated: bool) -> None:
        try:
            while True:
                if gated:
                    await gate.wait_open()
                data = await src.receive_some(65536)
                if not data:
                    break
                await dst.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await dst.aclose()

    async with client, server, listeners[0]:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump, client, server, True)
            nursery.start_soon(pump, server, client, False)


async def test_a_send_cancelled_mid_frame_resets_its_channel_and_keeps_the_connection():
    """The sender's deadline fires while a frame is half on the wire (the path is stalled): that
    channel is reset, the frame is completed by the connection's writer, other channels go on."""
    outcome: dict[str, BaseException] = {}
    first_done = trio.Event()

    async def echo_first(channel: Channel) -> None:
        if "first" in outcome:
            await echo(channel)
            return
        outcome["first"] = None  # type: ignore[assignment]
        try:
            while True:
                await channel.send(await channel.recv(64 << 20))
        except ChannelClosed as error:
            outcome["first"] = error
        finally:
            first_done.set()

    gate = _Gate()
    with trio.fail_after(60):
        async with running(new_host()) as a, running(new_host()) as b, trio.open_nursery() as nursery:
            serve_channels(b, PROTO, echo_first)
            b_port = int(str(b.get_addrs()[0]).split("/tcp/")[1].split("/")[0])
            proxy_port = await nursery.start(_gated_proxy, b_port, gate)
            await a.connect(PeerInfo(b.get_id(), [Multiaddr(f"/ip4/127.0.0.1/tcp/{proxy_port}")]))
            first = await open_channel(a, b.get_id(), PROTO)
            second = await open_channel(a, b.get_id(), PROTO)
            warm = pattern(12 << 20, 1)
            await first.send(warm)  # grows the first stream's window to 16 MiB
            assert await first.recv(64 << 20) == warm

            gate.set(False)
            with trio.move_on_after(2) as stalled:
                await first.send(pattern(16 << 20, 2))  # fills the socket, blocks mid-frame
            assert stalled.cancelled_caught
            assert first._fast.send_window > 0  # it was the socket, not the window, that blocked
            gate.set(True)

            await first_done.wait()
            await second.send(b"still here")
            assert await second.recv(100) == b"still here"
            with pytest.raises(ChannelClosed):
                await first.send(b"x")
            nursery.cancel_scope.cancel()
    assert isinstance(outcome["first"], ChannelClosed)


async def test_inbound_streams_over_the_muxer_cap_are_refused_counted_and_logged_at_powers_of_two(caplog):
    """Streams beyond MAX_INBOUND_STREAMS on one connection are reset at SYN; the count is readable
    (FastYamux.refused) and the log gets the 1st, 2nd, 4th, ... refusal only (logs.count_rejection)."""
    from p2ptrain.net._muxer import MAX_INBOUND_STREAMS

    hold = trio.Event()

    async def holder(stream) -> None:
        await hold.wait()

    extra = 12
    caplog.set_level(logging.INFO, logger="p2ptrain.net._muxer")
    with trio.fail_after(60):
        async with running(new_host()) as a, running(new_host()) as b:
            b.set_stream_handler(PROTO, holder)
            await connect(a, b)
            opened, refused = [], 0

            async def one() -> None:
                nonlocal refused
                try:
                    opened.append(await a.new_stream(b.get_id(), [PROTO]))
                except Exception:  # reset at SYN: libp2p's error for a refused stream
                    refused += 1

            async with trio.open_nursery() as nursery:
                for _ in range(MAX_INBOUND_STREAMS + extra):
                    nursery.start_soon(one)
            counted = b.get_network().get_connection(a.get_id()).muxed_conn.refused["over_inbound_streams"]
            hold.set()
    assert counted >= extra and refused >= extra
    logged = [r for r in caplog.records if "inbound streams open; refused stream" in r.getMessage()]
    assert len(logged) == counted.bit_length()  # 1, 2, 4, 8, ...: one line per power of two
