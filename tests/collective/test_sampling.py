"""Sampled verification of a robust round (issue 27's cost): a chunk is recomputed by its verifier
only when the verifier's draw, its signature over the owner's signed result digest, says so; every
member checks every chunk's norm bound. Over real hosts, with fixed keys where the outcome must be
known (the draws depend on the peer IDs through the round digest)."""

from __future__ import annotations

import importlib.util
import itertools
import math
from collections import Counter
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from p2ptrain.collective import Collective, CollectiveError, Misbehaved, PeerFailed, RoundSpec, _direct as direct
from p2ptrain.collective._direct import reduce_chunk
from p2ptrain.collective._links import RoundLinks
from p2ptrain.collective._owners import drawn
from p2ptrain.collective._robust import contribution_norm
from p2ptrain.collective._sampling import bound_problem, own_norm_problem, sampled
from p2ptrain.collective._witness import Witness, signed_by
from p2ptrain.net import make_host
from p2ptrain.testing import LOOPBACK, connected_hosts
from p2ptrain.wire import FrameError, Phase, Said, norms_bytes, parse_draw, parse_norms, statement

_spec = importlib.util.spec_from_file_location("p2ptrain_test_hostile_sampling", Path(__file__).with_name("hostile.py"))
hostile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hostile)

WORLD, BAD = 4, 3
SEED = 20271


@asynccontextmanager
async def fixed_cluster(n: int):
    """``n`` hosts whose keys come from fixed seeds: the same peer IDs, round digests and draws in
    every run (a random key would make a sampled round's outcome a coin toss of the test)."""
    keys = iter(create_new_key_pair(bytes([i + 1]) * 32) for i in itertools.count())
    async with connected_hosts(n, make=lambda: make_host(next(keys), [LOOPBACK])) as hosts:
        yield [SimpleNamespace(id=local.id, collective=Collective(local.host), kill=local.kill) for local in hosts]


def inputs(n: int) -> list[torch.Tensor]:
    return [torch.randn(n, generator=torch.Generator().manual_seed(i)) for i in range(WORLD)]


# ---- the draw ---------------------------------------------------------------------------------------


def test_the_draw_is_the_verifiers_and_the_owner_cannot_compute_it():
    """What decides a check is the verifier's signature of the owner's committed digest: the same
    bits for the same statement (an honest verifier cannot re-roll it either), a different coin for
    every digest the owner might commit to, and a key the owner holds (its own) predicts it no
    better than chance."""
    verifier, owner = create_new_key_pair(b"\x07" * 32), create_new_key_pair(b"\x08" * 32)
    round_digest, q, trials = bytes(range(32)), 0.25, 4000
    decisions, guesses = [], []
    for i in range(trials):
        result = i.to_bytes(32, "big")  # the digests an owner grinding its result could commit to
        said = statement(round_digest, Said.SAMPLE, 2, result)
        draw = verifier.private_key.sign(said)
        assert draw == verifier.private_key.sign(said)  # deterministic: one statement, one draw
        assert signed_by(ID.from_pubkey(verifier.public_key), said, draw)
        decisions.append(sampled(draw, q))
        guesses.append(sampled(owner.private_key.sign(said), q))
    assert abs(sum(decisions) / trials - q) < 0.025  # each committed result is checked with probability q
    agree = sum(d == g for d, g in zip(decisions, guesses)) / trials
    assert abs(agree - (q * q + (1 - q) * (1 - q))) < 0.03  # independent of the owner's own computation
    assert all(sampled(bytes(64), 1.0) for _ in range(3)) and not sampled(b"\xff" * 64, 1e-12)


def test_the_bound_never_names_an_honest_owner():
    """Honest reductions, with and without clipping, of contributions of every scale, in float32 and
    float16, are within the bound every member checks, and their reported norms are the members' own."""
    gen = torch.Generator().manual_seed(3)
    for case in range(300):
        size = 2 + case % 6
        dtype = (torch.float32, torch.float16)[case % 2]
        top = 6 if dtype == torch.float32 else 3  # float16 holds up to 65504
        scales = [10.0 ** float(torch.randint(-6, top, (1,), generator=gen)) for _ in range(size)]
        parts = [[(torch.randn(1 + case % 50, generator=gen) * s).to(dtype)] for s in scales]
        norms = [contribution_norm(p) for p in parts]
        for op in ("mean", "sum"):
            result = reduce_chunk(parts, case % size, RoundSpec(robust="clip", op=op), norms)
            assert bound_problem(norms, contribution_norm(result), average=op == "mean") is None, case
        assert own_norm_problem(norms[0], contribution_norm(parts[0])) is None
    assert bound_problem([1.0, 1.0, 5.0], 1.01, average=True) is not None
    assert own_norm_problem(2.0, 1.0) is not None


def test_norms_and_draws_are_parsed_within_bounds():
    assert parse_norms(norms_bytes([0.0, 1.5, 3e300]), 3) == [0.0, 1.5, 3e300]
    for bad in (norms_bytes([1.0]), norms_bytes([1.0, -1.0]), norms_bytes([1.0, math.nan]), norms_bytes([math.inf, 1])):
        with pytest.raises(FrameError):
            parse_norms(bad, 2)
    assert parse_draw(bytes(32) + b"\x01" * 64) == (bytes(32), b"\x01" * 64)
    with pytest.raises(FrameError):
        parse_draw(bytes(95))


def test_check_fraction_is_for_robust_rounds_with_owners():
    assert RoundSpec(robust="clip", check_fraction=0.25).check_fraction == 0.25
    for options in ({"check_fraction": 0.5}, {"robust": "clip", "check_fraction": 0.0},
                    {"robust": "clip", "check_fraction": 1.5},
                    {"robust": "clip", "density": 0.1, "quantize": "int8", "check_fraction": 0.5}):
        with pytest.raises(CollectiveError):
            RoundSpec(**options)


# ---- over real hosts ----------------------------------------------------------------------------------


@pytest.mark.parametrize("density", [1.0, 0.05])
@pytest.mark.parametrize("n", [4096, int(WORLD * (64 * 1024 // 4 + 1024) / 0.05)])
async def test_honest_rounds_give_the_same_bits_with_and_without_sampling(cluster, gather, density, n):
    if density == 1.0 and n > 4096:
        n = WORLD * (64 * 1024 // 4 + 1024)  # dense chunks past INLINE_BYTES: checks in worker threads
    async with cluster(WORLD) as peers:
        ring = [p.id for p in peers]
        xs = inputs(n)
        results = []
        for round_id, fraction in ((1, 1.0), (2, 0.5), (3, 0.01)):
            spec = RoundSpec(density=density, robust="clip", check_fraction=fraction, timeout=20)
            results.append(await gather([
                lambda p=p, x=x: p.collective.allreduce(x, ring, round_id, spec, seed=7, owner_seed=SEED)
                for p, x in zip(peers, xs)
            ]))
    for result in results:
        for r in result:
            assert isinstance(r, torch.Tensor) and r.equal(results[0][0]), r


def recording_draws(monkeypatch) -> list[set[int]]:
    """Every member's set of drawn chunks, as each computes it after CONFIRM, in order."""
    seen: list[set[int]] = []
    drawn_of = direct.drawn_chunks

    def recorded(*args, **kwargs):
        seen.append(drawn_of(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(direct, "drawn_chunks", recorded)
    return seen


async def test_verify_copies_go_only_for_drawn_chunks_and_only_after_the_owner_signed(gather, monkeypatch):
    """Each member's draw is made after it heard its chunk's signed result, over that result's digest;
    VERIFY frames travel for exactly the chunks whose draw says so, from every other member, and
    every member's verdict on the draws is the same."""
    events: list[tuple[int, str, int, int, bytes]] = []  # (member, what, said, chunk, digest)
    sign, heard, send = Witness.sign, Witness.heard, RoundLinks.send
    verify_frames: Counter = Counter()
    draws = recording_draws(monkeypatch)

    def signing(self, said, key, digest):
        events.append((self.links.me, "sign", said, key, digest))
        return sign(self, said, key, digest)

    def hearing(self, said, key, signer, digest, signature):
        heard(self, said, key, signer, digest, signature)
        events.append((self.links.me, "heard", said, key, digest))

    async def counting(self, header, payload=b"", *, to=None):
        if header.phase == Phase.VERIFY:
            verify_frames[header.step] += 1
        await send(self, header, payload, to=to)

    monkeypatch.setattr(Witness, "sign", signing)
    monkeypatch.setattr(Witness, "heard", hearing)
    monkeypatch.setattr(RoundLinks, "send", counting)
    fraction = 0.5
    drawn_chunks = set()
    async with fixed_cluster(WORLD) as peers:
        ring = [p.id for p in peers]
        xs = inputs(4096)  # one segment a chunk: a drawn chunk is P - 1 VERIFY frames
        for round_id in range(1, 5):
            draws.clear(), events.clear(), verify_frames.clear()
            spec = RoundSpec(robust="clip", check_fraction=fraction, timeout=20)
            results = await gather([lambda p=p, x=x: p.collective.dense_round(x.clone(), ring, round_id, spec,
                                                                             owner_seed=SEED + round_id)
                                    for p, x in zip(peers, xs)])
            assert results == [None] * WORLD
            owners = drawn(WORLD, SEED + round_id)
            assert len(draws) == WORLD and all(d == draws[0] for d in draws)
            chosen = draws[0]
            assert verify_frames == Counter({c: WORLD - 1 for c in chosen})
            drawn_chunks |= {(round_id, c) for c in chosen}
            for member in range(WORLD):
                chunk = owners.checked_by(member)
                mine = [(what, said, key, digest) for m, what, said, key, digest in events if m == member]
                result = mine.index(next(e for e in mine if e[:3] == ("heard", Said.RESULT, chunk)))
                draw = mine.index(next(e for e in mine if e[:3] == ("sign", Said.SAMPLE, chunk)))
                assert result < draw and mine[result][3] == mine[draw][3]
    assert 0 < len(drawn_chunks) < 4 * WORLD  # these keys draw some chunks and not others


async def test_an_owner_inside_the_bound_is_caught_when_drawn_and_only_then(gather, monkeypatch):
    """The owner negates its chunk every round (the same norm: the bound passes it). At q = 0.5 a
    round that does not draw its chunk accepts it (the price of sampling, which docs/collective.md
    bounds); the first round that draws it names the owner, with the verifier's evidence, on every
    honest member. Fixed keys: the same rounds are drawn in every run."""
    hostile.install(monkeypatch)
    draws = recording_draws(monkeypatch)
    fraction, outcomes = 0.5, []
    async with fixed_cluster(WORLD) as peers:
        ring = [p.id for p in peers]
        attacker = hostile.Owner(peers[BAD].collective, flip=True)
        xs = inputs(4096)
        for round_id in range(2, 18):
            seed = SEED + round_id
            spec = RoundSpec(robust="clip", check_fraction=fraction, timeout=20)
            honest = await gather([lambda p=p, x=x: p.collective.allreduce(x, ring, 1000 + round_id,
                                                                          RoundSpec(robust="clip", timeout=20),
                                                                          owner_seed=seed)
                                   for p, x in zip(peers, xs)])

            member = hostile.acting_at(
                attacker, BAD, lambda i: peers[i].collective.allreduce(xs[i], ring, round_id, spec, owner_seed=seed))
            draws.clear()
            results = await gather([lambda i=i: member(i) for i in range(WORLD)])
            owners = drawn(WORLD, seed)
            chunk = owners.owned_by(BAD)
            assert len(draws) == WORLD and all(d == draws[0] for d in draws)  # every member, the attacker too
            if chunk not in draws[0]:
                outcomes.append("accepted")
                a, b = chunk * 4096 // WORLD, (chunk + 1) * 4096 // WORLD
                for i in range(WORLD):
                    if i != BAD:
                        assert isinstance(results[i], torch.Tensor), results[i]
                        assert results[i][a:b].equal(-honest[i][a:b]) and results[i][:a].equal(honest[i][:a])
                continue
            outcomes.append("named")
            for i in range(WORLD):
                if i != BAD:
                    assert isinstance(results[i], PeerFailed) and results[i].peer_id == ring[BAD], results[i]
            assert isinstance(results[owners.verifier[chunk]], Misbehaved)
            assert f"its chunk {chunk} is not the reduction" in results[owners.verifier[chunk]].reason
            break
    assert outcomes[-1] == "named", outcomes
    assert "accepted" in outcomes, outcomes  # with these keys the first draws miss: sampling is a probability


@pytest.mark.parametrize("in_band", [False, True])
async def test_an_owner_whose_chunk_is_drawn_cannot_end_the_round_naming_an_honest_member(gather, monkeypatch,
                                                                                          in_band):
    """The owner negates its chunk (inside the bound) and, in the first round that draws its chunk,
    ends the round with an abort notice naming an honest member (``hostile.Owner(blame=...)``: the
    notice is sent right after it learns the draws at CONFIRM, before the check; ``in_band``: as
    ABORT frames on its round channels instead of its VERIFY copies, but for its verifier's copy,
    so its verifier's check fails while the other members miss their copies). The honest members
    must name the owner (its verifier's evidence, or its withholding), not the member it named:
    they hold its notices until its verifier's verdict on its chunk (collective._notice_hold). Before,
    every honest member believed the notice and named member 0. Fixed keys: the same rounds are drawn
    in every run (the earlier ones accept the negated chunk; the one that draws it draws others too,
    so honest owners' notices are held and released as well)."""
    hostile.install(monkeypatch)
    draws = recording_draws(monkeypatch)
    framed = 0  # the honest member the owner names
    async with fixed_cluster(WORLD) as peers:
        ring = [p.id for p in peers]
        attacker = hostile.Owner(peers[BAD].collective, flip=True, blame=ring[framed], in_band=in_band)
        xs = inputs(4096)
        for round_id in range(2, 18):
            seed = SEED + round_id
            spec = RoundSpec(robust="clip", check_fraction=0.5, timeout=20)
            member = hostile.acting_at(
                attacker, BAD, lambda i: peers[i].collective.allreduce(xs[i], ring, round_id, spec, owner_seed=seed))
            draws.clear()
            results = await gather([lambda i=i: member(i) for i in range(WORLD)])
            chunk = drawn(WORLD, seed).owned_by(BAD)
            if chunk in draws[0]:
                break
            assert all(isinstance(r, torch.Tensor) for r in results), results  # not drawn: accepted
        else:
            pytest.fail("no round drew the owner's chunk")
    assert isinstance(results[BAD], PeerFailed) and results[BAD].peer_id == ring[framed]  # what it claimed
    for i in range(WORLD):
        if i != BAD:
            assert isinstance(results[i], PeerFailed) and results[i].peer_id == ring[BAD], (i, results[i])


async def test_a_member_that_dies_during_the_checks_is_named_by_every_survivor_at_once(gather, monkeypatch):
    """Crash faults while drawn chunks are checked, where owners' notices are held: the first member
    to learn that its own chunk is drawn (two chunks are, with these keys and values) dies right
    then. The checks of the drawn chunks miss its copies; every survivor still names it within the
    hop deadline (held notices of the other drawn chunk's owner, naming it too, are released by its
    verifier's notice, which names it as well), not after waiting for verdicts that never come."""
    round_id, timeout = 4, 5.0
    drawn_of, seen, dead = direct.drawn_chunks, [], []
    async with fixed_cluster(WORLD) as peers:
        ring = [p.id for p in peers]

        def dying(witness, owners, draws, fraction):
            chosen = drawn_of(witness, owners, draws, fraction)
            seen.append(chosen)
            if not dead and owners.owned_by(witness.links.me) in chosen:
                dead.append(witness.links.me)
                peers[dead[0]].kill()  # its host stops: its connections close as if its process died
            return chosen

        monkeypatch.setattr(direct, "drawn_chunks", dying)
        spec = RoundSpec(robust="clip", check_fraction=0.5, timeout=timeout)
        xs = inputs(4096)
        started = trio.current_time()
        results = await gather([lambda i=i: peers[i].collective.allreduce(xs[i], ring, round_id, spec,
                                                                         owner_seed=SEED + round_id)
                                for i in range(WORLD)], deadline=30)
        took = trio.current_time() - started
    assert dead and len(seen[0]) > 1, seen
    for i, result in enumerate(results):
        if i != dead[0]:
            assert isinstance(result, PeerFailed) and result.peer_id == ring[dead[0]], (i, result)
    assert took < timeout, took


@pytest.mark.parametrize("density", [1.0, 0.05])
async def test_an_owner_outside_the_bound_is_named_by_every_member_without_a_draw(cluster, gather, monkeypatch,
                                                                                  density):
    """At a fraction that draws nothing, an owner that writes 1000.0 into its chunk still breaks the
    bound: every honest member names it from the owner's own signed bytes."""
    hostile.install(monkeypatch)
    async with cluster(WORLD) as peers:
        ring = [p.id for p in peers]
        attacker = hostile.Owner(peers[BAD].collective, poison=1000.0)
        spec = RoundSpec(density=density, robust="clip", check_fraction=1e-12, timeout=20)
        xs = inputs(4096)

        member = hostile.acting_at(
            attacker, BAD, lambda i: peers[i].collective.allreduce(xs[i], ring, 5, spec, owner_seed=SEED))
        results = await gather([lambda i=i: member(i) for i in range(WORLD)])
    chunk = drawn(WORLD, SEED).owned_by(BAD)
    for i in range(WORLD):
        if i != BAD:
            assert isinstance(results[i], PeerFailed) and results[i].peer_id == ring[BAD], results[i]
    own = [r for i, r in enumerate(results) if i != BAD and isinstance(r, Misbehaved)]
    assert own and all(f"its chunk {chunk} has norm" in r.reason for r in own)
