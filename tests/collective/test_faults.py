"""Dead, stalled and misbehaving peers: the round fails everywhere, naming the peer; nothing is summed."""

from __future__ import annotations

import pytest
import torch
import trio

from p2ptrain.collective import BadPayload, PeerFailed, RoundSpec
from p2ptrain.collective._collective import dense_description, sparse_description
from p2ptrain.collective._ring import chunk_bounds
from p2ptrain.collective._sparse import encode_indices, slice_of, slice_ranges
from p2ptrain.base import short_id
from p2ptrain.wire import DTYPES, Header, Kind, Phase, round_digest


async def test_killed_peer_fails_the_round_on_every_survivor(cluster, gather):
    n, timeout = 8 << 20, 2.0
    async with cluster(4) as peers:
        ring = [p.id for p in peers]
        xs = [torch.full((n,), float(i)) for i in range(4)]
        failed_at = {}
        killed_at = None

        async def member(i):
            try:
                return await peers[i].collective.allreduce(xs[i], ring, 1, RoundSpec(timeout=timeout))
            finally:
                failed_at[i] = trio.current_time()

        async def killer():
            nonlocal killed_at
            await trio.sleep(0.3)
            killed_at = trio.current_time()
            peers[2].kill()

        outs = await gather([lambda i=i: member(i) for i in range(4)] + [killer], deadline=30)
        for i in (0, 1, 3):
            assert isinstance(outs[i], PeerFailed), (i, outs[i])
            assert outs[i].peer_id == peers[2].id, (i, outs[i])
            assert short_id(peers[2].id) in str(outs[i])
            assert failed_at[i] - killed_at < timeout + 3  # the hop deadline plus the abort notice

        # The survivors retry on a new ring with a fresh round id.
        survivors = [0, 1, 3]
        new_ring = [peers[i].id for i in survivors]
        outs = await gather([lambda i=i: peers[i].collective.allreduce(xs[i], new_ring, 2) for i in survivors])
        for out in outs:
            assert out.equal(torch.full((n,), 4.0 / 3))


async def test_peer_that_never_joins_is_named_within_the_start_deadline(cluster, gather):
    async with cluster(3) as peers:
        ring = [p.id for p in peers]
        x = torch.ones(1000)
        outs = await gather(
            [lambda p=p: p.collective.allreduce(x, ring, 5, RoundSpec(timeout=1.5)) for p in peers[:2]], deadline=10
        )
    assert all(isinstance(o, PeerFailed) and o.peer_id == ring[2] for o in outs), outs


def _nan(count):
    return torch.full((count,), float("nan")).view(torch.uint8).numpy().tobytes()


BAD_DENSE = {
    "nan": lambda rid, count: (Header(Kind.DATA, rid, Phase.REDUCE, 0, 0, count, 1), _nan(count)),
    "inf": lambda rid, count: (
        Header(Kind.DATA, rid, Phase.REDUCE, 0, 0, count, 1),
        torch.full((count,), float("inf")).numpy().tobytes(),
    ),
    "short": lambda rid, count: (Header(Kind.DATA, rid, Phase.REDUCE, 0, 0, count, 1), bytes(4 * count - 4)),
    "long": lambda rid, count: (Header(Kind.DATA, rid, Phase.REDUCE, 0, 0, count, 1), bytes(4 * count + 4)),
    "stale round": lambda rid, count: (Header(Kind.DATA, rid - 1, Phase.REDUCE, 0, 0, count, 1), bytes(4 * count)),
    "wrong step": lambda rid, count: (Header(Kind.DATA, rid, Phase.GATHER, 0, 0, count, 1), bytes(4 * count)),
    "wrong dtype": lambda rid, count: (Header(Kind.DATA, rid, Phase.REDUCE, 0, 0, count, 2), bytes(4 * count)),
}


async def _evil_member(peer, ring, rid, description, frames, *, mesh=False, only=None):
    """Join the round properly, then send crafted frames instead of the real ones.

    Ring rounds: to the right neighbour. Mesh rounds (sparse): to every other member, or to the
    members in ``only``.
    """
    digest = round_digest(rid, ring, description)
    with trio.move_on_after(5):
        async with peer.collective.hub.open_round(
            ring, rid, digest, timeout=5, start_timeout=5, mesh=mesh
        ) as links:
            targets = [p for p in ring if p != peer.id] if mesh else [links.right_peer]
            targets = [p for p in targets if only is None or p in only]
            for to in targets:
                for header, payload in frames:
                    await links.send(header, payload, to=to)
            await trio.sleep_forever()


@pytest.mark.parametrize("case", sorted(BAD_DENSE))
async def test_bad_dense_payload_is_rejected_naming_the_sender(cluster, gather, case):
    n, evil = 1000, 1
    async with cluster(3) as peers:
        ring = [p.id for p in peers]
        rid = 10
        count = chunk_bounds(n, 3)[evil + 1] - chunk_bounds(n, 3)[evil]
        frames = [BAD_DENSE[case](rid, count)]
        outs = await gather(
            [
                lambda: peers[0].collective.allreduce(torch.ones(n), ring, rid, RoundSpec(timeout=3)),
                lambda: _evil_member(peers[1], ring, rid, dense_description(n, torch.float32, "mean"), frames),
                lambda: peers[2].collective.allreduce(torch.ones(n), ring, rid, RoundSpec(timeout=3)),
            ],
            deadline=20,
        )
    right = outs[2]  # the evil peer's right neighbour saw the frame itself
    assert isinstance(right, BadPayload) and right.peer_id == ring[evil], right
    assert isinstance(outs[0], PeerFailed) and outs[0].peer_id == ring[evil], outs[0]
    assert outs[0].reported_by == ring[2]


@pytest.mark.parametrize("case", ["outside its slice", "out of range", "wrong count", "odd length", "announces too much"])
async def test_bad_index_set_from_a_member_is_rejected(cluster, gather, case):
    n, k, evil, rid = 1000, 10, 1, 16
    ranges = slice_ranges([n], [k], 3)[slice_of(evil, rid, 3)]
    (start, end, count), = ranges
    indices = start + torch.arange(count) * 10
    if case == "outside its slice":
        indices[-1] = end + 1 if end < n - 1 else start - 1
        indices = indices.sort().values
    elif case == "out of range":
        indices[-1] = n + 3
    elif case == "wrong count":
        indices = indices[:-1]
    payload = encode_indices(indices) + (b"\0" if case == "odd length" else b"")
    u8 = DTYPES[torch.uint8]
    announced = 10**6 if case == "announces too much" else len(payload)
    frames = [(Header(Kind.DATA, rid, Phase.BROADCAST, 0, 0, announced, u8), payload)]
    description = sparse_description([n], [k], torch.float32, torch.float32, "mean")

    def honest(i):
        x = torch.randn(n)
        return lambda: peers[i].collective.allreduce(x, ring, rid, RoundSpec(density=k / n, timeout=3))

    async with cluster(3) as peers:
        ring = [p.id for p in peers]
        outs = await gather(
            [honest(0), lambda: _evil_member(peers[1], ring, rid, description, frames, mesh=True), honest(2)],
            deadline=20,
        )
    # Every member sends its slice's set to each other directly, so each honest member can refuse it
    # itself; but the first to refuse it aborts the round at once, and under load its notice can
    # reach the other one before the evil member's frame does (it flaked so): that one then names
    # the evil member on the first one's report (the next test makes that happen every time).
    assert any(isinstance(out, BadPayload) for out in (outs[0], outs[2])), outs
    for me, other in ((0, 2), (2, 0)):
        out = outs[me]
        assert isinstance(out, PeerFailed) and out.peer_id == ring[evil], out
        assert isinstance(out, BadPayload) or (out.reported_by == ring[other] and isinstance(outs[other], BadPayload)), out


async def test_a_bad_index_set_sent_to_one_member_is_named_everywhere_on_its_report(cluster, gather):
    """The evil member sends its bad set to member 0 only: member 2 hears of it from member 0's
    abort notice (before its own hop deadline on the evil member) and names the evil member,
    reported by 0."""
    n, k, evil, rid = 1000, 10, 1, 16
    (start, _end, count), = slice_ranges([n], [k], 3)[slice_of(evil, rid, 3)]
    indices = start + torch.arange(count) * 10
    indices[-1] = n + 3  # out of range
    payload = encode_indices(indices)
    frames = [(Header(Kind.DATA, rid, Phase.BROADCAST, 0, 0, len(payload), DTYPES[torch.uint8]), payload)]
    description = sparse_description([n], [k], torch.float32, torch.float32, "mean")

    def honest(i):
        x = torch.randn(n)
        return lambda: peers[i].collective.allreduce(x, ring, rid, RoundSpec(density=k / n, timeout=3))

    async with cluster(3) as peers:
        ring = [p.id for p in peers]
        outs = await gather(
            [honest(0), lambda: _evil_member(peers[1], ring, rid, description, frames, mesh=True, only={ring[0]}),
             honest(2)],
            deadline=20,
        )
    assert isinstance(outs[0], BadPayload) and outs[0].peer_id == ring[evil], outs[0]
    assert isinstance(outs[2], PeerFailed) and not isinstance(outs[2], BadPayload), outs[2]
    assert outs[2].peer_id == ring[evil] and outs[2].reported_by == ring[0], outs[2]


async def test_local_nan_is_refused_and_the_others_hear_at_once(cluster, gather):
    async with cluster(3) as peers:
        ring = [p.id for p in peers]
        xs = [torch.ones(100), torch.ones(100), torch.ones(100)]
        xs[0][5] = float("nan")
        outs = await gather([lambda p=p, x=x: p.collective.allreduce(x, ring, 4, RoundSpec(timeout=3))
                             for p, x in zip(peers, xs)])
    assert isinstance(outs[0], ValueError), outs[0]
    for out in outs[1:]:
        assert isinstance(out, PeerFailed) and out.peer_id == ring[0], out


@pytest.mark.parametrize("density", [1.0, 0.01])
async def test_peer_that_stalls_mid_round_is_named_by_everyone(cluster, gather, density):
    """Peer 2 joins the round (HELLO/READY), then goes silent: alive, connected, sending nothing."""
    n, timeout = 10_000, 1.5
    rid = 21  # for the sparse round: leader 21 % 4 = 1, an honest peer
    if density < 1:
        description, mesh = sparse_description([n], [100], torch.float32, torch.float32, "mean"), True
    else:
        description, mesh = dense_description(n, torch.float32, "mean"), False
    async with cluster(4) as peers:
        ring = [p.id for p in peers]
        def stalled():
            return _evil_member(peers[2], ring, rid, description, [], mesh=mesh)

        started = trio.current_time()
        ended = {}

        async def honest(i):
            try:
                x = torch.randn(n)
                return await peers[i].collective.allreduce(x, ring, rid, RoundSpec(density=density, timeout=timeout))
            finally:
                ended[i] = trio.current_time()

        outs = await gather([lambda: honest(0), lambda: honest(1), stalled, lambda: honest(3)], deadline=20)
    for i in (0, 1, 3):
        assert isinstance(outs[i], PeerFailed) and outs[i].peer_id == ring[2], (i, outs[i])
        assert ended[i] - started < timeout + 3
    if density == 1.0:
        assert outs[3].reported_by is None  # its right neighbour saw the silence itself ...
        assert outs[0].reported_by == ring[3]  # ... and told the others


@pytest.mark.parametrize("density", [1.0, 0.01])
@pytest.mark.parametrize("notice", ["heard", "lost"])
async def test_a_member_that_joins_after_the_others_gave_up_learns_it_was_named(cluster, gather, density, notice):
    """Peer 2 gets the round only after its neighbours timed out on it. It must not blame them.

    Before, it found their channels gone (a dial refused, a parked HELLO since reset) and blamed a
    healthy neighbour, which it would then leave out of the rings it plans. Now the others' abort
    notice reaches it too, and if that notice is lost, a neighbour asked to join the failed round
    answers with the same notice.
    """
    n, start, rid = 1000, 1.0, 31
    async with cluster(3) as peers:
        ring = [p.id for p in peers]
        for p in peers:  # every member has the plan (as the runtime tells the hub), peer 2 too
            p.collective.hub.expect(ring)
        outs = await gather(
            [lambda p=p: p.collective.allreduce(torch.ones(n), ring, rid, RoundSpec(density=density, timeout=start))
             for p in peers[:2]],
            deadline=10,
        )
        assert all(isinstance(o, PeerFailed) and o.peer_id == ring[2] for o in outs), outs
        hub = peers[2].collective.hub
        if notice == "heard":
            with trio.fail_after(5):
                while rid not in hub._early_aborts:
                    await trio.sleep(0.05)
        else:
            await trio.sleep(0.5)
            hub._early_aborts.clear()  # as if the notice never arrived
        began = trio.current_time()
        late, = await gather(
            [lambda: peers[2].collective.allreduce(torch.ones(n), ring, rid, RoundSpec(density=density, timeout=5.0))],
            deadline=10,
        )
        assert isinstance(late, PeerFailed) and late.peer_id == ring[2], late
        assert late.reported_by in ring[:2]
        assert trio.current_time() - began < 5.0  # told at once, not left to time out on its own


async def test_a_member_whose_join_is_dropped_waits_for_the_notice_that_explains_it(cluster, gather):
    """Peer 2 takes peer 1's HELLO, then its round fails on dead peer 3: it resets the channel and
    its abort notice, which needs a stream of its own, arrives after the reset. Peer 1 must name
    peer 3, not peer 2 (a fault-test log showed a healthy joiner blamed this way)."""
    rid = 41
    async with cluster(4) as peers:
        ring = [p.id for p in peers]
        peers[3].kill()
        hub = peers[2].collective.hub
        hub.expect(ring)  # peer 2 has the plan (as the runtime tells the hub), not yet the round

        async def member_2_fails_on_peer_3():
            arrival = await hub._inbox.claim(rid, ring[1], 5)  # peer 1's parked HELLO, taken as a round would
            assert arrival is not None
            arrival.released.set()  # not reusable: the parked channel is reset
            await trio.sleep(0.1)
            await hub.broadcast_abort(ring, rid, ring[3], "cannot reach it")

        outs = await gather(
            [lambda p=p: p.collective.allreduce(torch.ones(1000), ring, rid, RoundSpec(timeout=3)) for p in peers[:2]]
            + [member_2_fails_on_peer_3],
            deadline=10,
        )
    for out in outs[:2]:
        assert isinstance(out, PeerFailed) and out.peer_id == ring[3] and out.reported_by == ring[2], out
