"""Hostile HELLOs (issue 13, found #4): a peer outside every plan must not fill a member's pending
inbox and make real rounds fail, with honest members blaming each other."""

from __future__ import annotations

import os

import torch
import trio

from p2ptrain.collective import CollectiveError, RoundSpec, _inbox as inbox, _round_hub as rounds
from p2ptrain.net import ChannelError, open_channel
from p2ptrain.wire import PROTOCOL, Header, Kind

# More than the whole pending inbox (64) per member.
FLOOD = 70
# How long the attacker waits for an answer to each HELLO: on loopback a refusal takes
# milliseconds, so a channel still unanswered after this was parked by the member.
ANSWER_WAIT_S = 1.0


async def _park_hellos(attacker_host, target, count: int, first_round: int, held: list) -> int:
    """Open ``count`` collective channels to ``target``, say HELLO on each and keep them open;
    returns how many got no answer (parked by the target)."""
    parked = 0

    async def one(i: int) -> None:
        nonlocal parked
        try:
            channel = await open_channel(attacker_host, target, PROTOCOL)
            held.append(channel)
            await channel.send(Header(Kind.HELLO, first_round + i).pack() + os.urandom(32))
            with trio.move_on_after(ANSWER_WAIT_S):
                await channel.recv(1024)
                return
            parked += 1
        except ChannelError:
            pass  # refused with a reset

    async with trio.open_nursery() as nursery:
        for i in range(count):
            nursery.start_soon(one, i)
    return parked


async def test_outsider_hellos_do_not_block_a_real_round(cluster, gather):
    async with cluster(4) as peers:
        members, outsider = peers[:3], peers[3]
        ring = [p.id for p in members]
        held: list = []
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for member in members:
                    nursery.start_soon(_park_hellos, outsider.host, member.id, FLOOD, 1000, held)
        data = [torch.full((4096,), float(i + 1)) for i in range(3)]
        results = await gather([
            (lambda p=p, d=d: p.collective.allreduce(d, ring, 7, RoundSpec(timeout=5.0, start_timeout=10.0)))
            for p, d in zip(members, data)
        ])
        for result in results:
            assert isinstance(result, torch.Tensor), f"round failed: {result!r}"  # nobody blamed
            assert torch.equal(result, torch.full((4096,), 2.0))
        for member in members:
            stats = member.collective.hub.stats()
            assert stats["parked"] == 0
            # Every flooding stream was refused at once: by the per-peer stream cap or as a stranger.
            assert stats.get("refused_hello_not_member", 0) + stats.get("over_stream_cap", 0) == FLOOD
        for channel in held:
            await channel.aclose()


async def test_a_member_parks_at_most_its_share(cluster, gather):
    async with cluster(2) as peers:
        a, b = peers
        b.collective.hub.expect([a.id, b.id])  # a is in the plan b follows
        held: list = []
        with trio.fail_after(30):
            parked = await _park_hellos(a.host, b.id, 10, 5000, held)
        assert parked == inbox._PENDING_PER_PEER
        stats = b.collective.hub.stats()
        assert stats["parked"] == inbox._PENDING_PER_PEER
        assert stats["refused_hello_over_peer_cap"] == 10 - inbox._PENDING_PER_PEER
        # A real round between them still runs (its HELLO is retried once a slot frees or the
        # round opens here, which admits its members).
        results = await gather([
            (lambda p=p: p.collective.allreduce(torch.ones(64), [a.id, b.id], 9, RoundSpec(timeout=5.0)))
            for p in peers
        ])
        assert all(isinstance(r, torch.Tensor) for r in results), results
        for channel in held:
            await channel.aclose()


async def test_a_handler_exception_is_a_counted_reset_and_the_host_keeps_serving(cluster, gather, monkeypatch):
    """The collective handler's boundary: an unexpected error while serving one channel resets
    that channel, is counted, and the next round on the same host runs."""
    real_parse = rounds.parse_header
    calls = {"n": 0}

    def parse_once_broken(frame):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected")
        return real_parse(frame)

    async with cluster(2) as peers:
        a, b = peers
        monkeypatch.setattr(rounds, "parse_header", parse_once_broken)
        with trio.fail_after(10):
            channel = await open_channel(a.host, b.id, PROTOCOL)
            await channel.send(Header(Kind.HELLO, 1).pack() + bytes(32))
            try:
                await channel.recv(1024)
            except ChannelError:
                pass  # reset by b's boundary
        assert b.collective.hub.stats()["handler_error"] == 1
        results = await gather([
            (lambda p=p: p.collective.allreduce(torch.ones(64), [a.id, b.id], 2, RoundSpec(timeout=5.0))) for p in peers
        ])
        assert all(isinstance(r, torch.Tensor) for r in results), results


async def test_an_announced_round_keeps_its_early_channels_past_the_parking_window(cluster, gather, monkeypatch):
    """A pipelined step's summary: a replica joins the gather as the step starts, a driver once its
    whole step is done, which (a slow first step) may be later than the parking window. Its channel
    from the replica was dropped unclaimed, and the round lost; now the driver announces the round
    as its step starts, and the channel waits for it. (The window is shortened, the step is a sleep.)"""
    monkeypatch.setattr(inbox, "_PARK_S", 0.5)
    step_s = 2.0  # the driver's step: four windows

    async with cluster(2) as peers:
        replica, driver = peers
        ring = [replica.id, driver.id]
        driver.collective.hub.expect(ring)

        def join(p, round_id: int, announce: bool):
            async def run():
                if p is driver:
                    if announce:
                        driver.collective.announce(round_id, 30.0)
                    await trio.sleep(step_s)
                return await p.collective.gather(b"x", ring, round_id, max_bytes=8, check=lambda i, raw: None,
                                                 timeout=5.0, start_timeout=10.0)
            return run

        before = await gather([join(p, 41, announce=False) for p in peers])
        assert not any(isinstance(r, list) for r in before), before  # the window alone loses the round
        assert driver.collective.hub.stats()["refused_park_expired"] >= 1
        after = await gather([join(p, 42, announce=True) for p in peers])
        assert after == [[b"x", b"x"], [b"x", b"x"]], after


async def test_a_member_that_leaves_a_gather_as_every_member_joined_lets_no_member_complete_it(cluster, gather):
    """The pipelined step's abort (run/_step_window.py) rests on this: ``joined`` is called once every
    member has joined, before the member sends anything, and a member cancelled by then (the report
    came as its round opened) sends no CONFIRM, so no member returns the gather: all drop the step."""
    async with cluster(3) as peers:
        ring = [p.id for p in peers]
        calls: list[str] = []

        def join(p, leaves: bool):
            async def run():
                with trio.CancelScope() as scope:
                    def joined():
                        calls.append(str(p.id))
                        if leaves:
                            scope.cancel()
                    return await p.collective.gather(str(p.id).encode()[:8], ring, 43, max_bytes=8,
                                                     check=lambda i, raw: None, timeout=5.0, start_timeout=10.0,
                                                     joined=joined)
                return "left"
            return run

        got = await gather([join(p, leaves=p is peers[2]) for p in peers])
        assert sorted(calls) == sorted(str(p.id) for p in peers)  # once each, the round open everywhere
        assert got[2] == "left"
        assert all(isinstance(r, CollectiveError) for r in got[:2]), got  # nobody completed it
