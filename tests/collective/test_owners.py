"""No trusted owner in a robust round (issue 27): owners drawn from a seed nobody chose, each chunk
recomputed by a verifier, every item sent signed and compared at CONFIRM; over real hosts.

The hostile member runs the real code (tests/collective/hostile.py, :class:`Owner`): it writes its
own values into the chunk it reduces, or sends one member other (signed) bytes for it. Without the
checks both attacks go through: every member accepts the poisoned chunk, or members end the round
holding different bits with nobody named.
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import pytest
import torch
import trio

from p2ptrain.collective import BadPayload, Misbehaved, PeerFailed, RoundSpec
from p2ptrain.collective._direct import INLINE_BYTES
from p2ptrain.collective._owners import drawn, ring_owners
from p2ptrain.protocol import owner_seed
from p2ptrain.wire import RoundPlan

_spec = importlib.util.spec_from_file_location("p2ptrain_test_hostile_owners", Path(__file__).with_name("hostile.py"))
hostile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hostile)

WORLD, BAD = 4, 3
SEED = 20271  # the owner seed of the rounds below (the runtime's: a hash of the base model and round)


def test_drawn_owners_are_a_permutation_and_nobody_checks_its_own_chunk():
    for size in (2, 3, 4, 7, 16):
        for seed in range(50):
            owners = drawn(size, seed)
            assert sorted(owners.owner) == list(range(size))
            assert sorted(owners.verifier) == list(range(size))
            assert all(owners.owner[c] != owners.verifier[c] for c in range(size))
            assert owners == drawn(size, seed)  # the same on every machine
    assert drawn(1, 5).verifier is None


def test_no_key_owns_a_chosen_chunk_every_round():
    """The ring's owner of the last chunk (the output layer's slice) is fixed by sorted peer IDs;
    drawn owners give each ring position that chunk in about 1/P of the rounds."""
    assert {ring_owners(WORLD).owner[WORLD - 1] for _ in range(10)} == {WORLD - 2}
    rounds = 4000
    owned = Counter(drawn(WORLD, seed).owner[WORLD - 1] for seed in range(rounds))
    assert set(owned) == set(range(WORLD))
    assert all(abs(n / rounds - 1 / WORLD) < 0.03 for n in owned.values())


def test_the_runtime_seed_is_the_base_model_and_the_round():
    """What members draw owners from: the plan's base (the last confirmed model, checked against the
    chain) and the round's number; a retry (attempt) or a new term (a resumed run) draws the same."""
    cid = "bafkreigh2akiscaildcqabsyg3dfr6chu3fgpregiymsck7e7aqa4s52zy"
    plan = RoundPlan(task_cid=cid, term=1, round=10, attempt=0, step=10, rounds=5, members=("a", "b"), base_cid=cid,
                     version=2)
    retry = RoundPlan(task_cid=cid, term=3, round=10, attempt=2, step=10, rounds=5, members=("a", "b"), base_cid=cid,
                      version=2)
    other_base = RoundPlan(task_cid=cid, term=1, round=10, attempt=0, step=10, rounds=5, members=("a", "b"),
                           base_cid="bafkreidivzimqfqtoqxkrpge6bjyhlvxqs3rhe73owtmdulaxr5do5in7u", version=2)
    assert owner_seed(plan, 11) == owner_seed(retry, 11)
    assert len({owner_seed(plan, 11), owner_seed(plan, 12), owner_seed(other_base, 11)}) == 3


def inputs(n: int) -> list[torch.Tensor]:
    return [torch.randn(n, generator=torch.Generator().manual_seed(i)) for i in range(WORLD)]


def past_inline(density: float) -> int:
    """A tensor size whose chunks of values hold more than INLINE_BYTES: their hashes, signatures
    and checks (and the owner's reduction) run in worker threads, where a small chunk's run inline."""
    return int(WORLD * (INLINE_BYTES // 4 + 1024) / density)


# Small chunks (every check inline) and big ones (checks in worker threads): both paths must name.
SIZES = {"inline": lambda density: 4096, "threads": past_inline}


@pytest.mark.parametrize("density", [1.0, 0.05])
async def test_who_owns_a_chunk_does_not_change_its_bits(cluster, gather, density):
    async with cluster(WORLD) as peers:
        ring = [p.id for p in peers]
        xs = inputs(4096)
        results = []
        for round_id, seed in ((1, 1), (2, 2), (3, 99)):
            spec = RoundSpec(density=density, robust="clip", timeout=20)
            results.append(await gather([
                lambda p=p, x=x: p.collective.allreduce(x, ring, round_id, spec, seed=7, owner_seed=seed)
                for p, x in zip(peers, xs)
            ]))
    assert len({drawn(WORLD, s).owner for s in (1, 2, 99)}) == 3
    for result in results:
        for r in result:
            assert isinstance(r, torch.Tensor) and r.equal(results[0][0])


@pytest.mark.parametrize("size", SIZES)
async def test_only_big_chunks_are_hashed_and_reduced_in_worker_threads(cluster, gather, monkeypatch, size):
    """A sparse robust round's chunks are ~40 KB: their hashes, signatures, checks and reduction
    cost less than a hand-off to a worker thread and back, three of which sat on the round's critical
    path (docs/benchmarks.md, "The checks of a robust round"); a big chunk's still go to threads."""
    handed: list[str] = []
    to_thread = trio.to_thread.run_sync

    async def counted(fn, *args, **kwargs):
        handed.append(getattr(fn, "__name__", "?"))
        return await to_thread(fn, *args, **kwargs)

    monkeypatch.setattr(trio.to_thread, "run_sync", counted)
    async with cluster(WORLD) as peers:
        ring = [p.id for p in peers]
        spec = RoundSpec(density=0.05, robust="clip", timeout=20)
        xs = inputs(SIZES[size](0.05))
        results = await gather([lambda p=p, x=x: p.collective.allreduce(x, ring, 9, spec, owner_seed=SEED)
                                for p, x in zip(peers, xs)])
    assert all(isinstance(r, torch.Tensor) and r.equal(results[0]) for r in results)
    checks = Counter(name for name in handed if name != "work")  # "work": each member's top-k selection
    if size == "inline":
        assert checks == Counter()
    else:  # per member: P - 1 contributions signed and checked, P - 1 results heard, one reduction
        assert checks == Counter(_signed=3 * WORLD, _checked=3 * WORLD, heard_result=3 * WORLD, _reduced_and_signed=WORLD)


def chunk_verifier(seed: int) -> tuple[int, int]:
    owners = drawn(WORLD, seed)
    chunk = owners.owned_by(BAD)
    return chunk, owners.verifier[chunk]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("density", [1.0, 0.05])
async def test_an_owner_that_writes_its_own_values_is_caught_and_named(cluster, gather, monkeypatch, density, size):
    hostile.install(monkeypatch)
    chunk, verifier = chunk_verifier(SEED)
    async with cluster(WORLD) as peers:
        ring = [p.id for p in peers]
        attacker = hostile.Owner(peers[BAD].collective, poison=1000.0)
        spec = RoundSpec(density=density, robust="clip", timeout=20)
        xs = inputs(SIZES[size](density))

        member = hostile.acting_at(
            attacker, BAD, lambda i: peers[i].collective.allreduce(xs[i], ring, 5, spec, owner_seed=SEED))
        results = await gather([lambda i=i: member(i) for i in range(WORLD)])
        refused = peers[verifier].collective.hub.refused["misbehaved"]
    for i in range(WORLD):
        if i == BAD:
            continue
        failure = results[i]
        assert isinstance(failure, PeerFailed), f"member {i} accepted the round: {failure!r}"
        assert failure.peer_id == ring[BAD]
        assert f"its chunk {chunk} is not the reduction" in failure.reason
    assert isinstance(results[verifier], Misbehaved)  # its own finding; the others heard its notice
    assert refused == 1


@pytest.mark.parametrize("size", SIZES)
async def test_an_equivocating_owner_is_named_by_every_honest_member(cluster, gather, monkeypatch, size):
    hostile.install(monkeypatch)
    chunk, verifier = chunk_verifier(SEED)
    target = next(i for i in range(WORLD) if i not in (BAD, verifier))  # its verifier gets the honest bytes
    async with cluster(WORLD) as peers:
        ring = [p.id for p in peers]
        attacker = hostile.Owner(peers[BAD].collective, equivocate_to=ring[target])
        spec = RoundSpec(density=1.0, robust="clip", timeout=20)
        xs = inputs(SIZES[size](1.0))

        member = hostile.acting_at(
            attacker, BAD, lambda i: peers[i].collective.dense_round(xs[i], ring, 6, spec, owner_seed=SEED))
        results = await gather([lambda i=i: member(i) for i in range(WORLD)])
    reasons = set()
    for i in range(WORLD):
        if i == BAD:
            continue
        failure = results[i]
        assert isinstance(failure, PeerFailed), f"member {i} accepted the round: {failure!r}"
        assert failure.peer_id == ring[BAD]
        reasons.add(failure.reason)
    assert reasons == {f"equivocated: signed two different result {chunk} in round 6"}


@pytest.mark.parametrize("size", SIZES)
async def test_a_contributor_that_sends_owner_and_verifier_different_values_is_named(cluster, gather, monkeypatch,
                                                                                     size):
    """The verifier's recomputation differs from the owner's chunk; the owner forwarded the signed
    digest of what it got, which the contributor signed: the contributor is named, not the owner."""
    hostile.install(monkeypatch)
    async with cluster(WORLD) as peers:
        ring = [p.id for p in peers]
        attacker = hostile.Owner(peers[BAD].collective, split=True)
        spec = RoundSpec(density=1.0, robust="clip", timeout=20)
        xs = inputs(SIZES[size](1.0))

        member = hostile.acting_at(
            attacker, BAD, lambda i: peers[i].collective.dense_round(xs[i], ring, 7, spec, owner_seed=SEED))
        results = await gather([lambda i=i: member(i) for i in range(WORLD)])
    for i in range(WORLD):
        if i != BAD:
            failure = results[i]
            assert isinstance(failure, PeerFailed), f"member {i} accepted the round: {failure!r}"
            assert failure.peer_id == ring[BAD]
    assert any("its verifier different values" in results[i].reason for i in range(WORLD) if i != BAD)


@pytest.mark.parametrize("size", SIZES)
async def test_bytes_under_a_wrong_signature_are_refused_on_arrival_so_their_receiver_is_not_blamed(
    cluster, gather, monkeypatch, size
):
    """An owner sends one member other bytes under the signature of the real ones. Were they kept,
    that member's CONFIRM would report a digest its sender never signed and the others would name
    it; its receiver refuses them at once instead (BadPayload naming the owner)."""
    hostile.install(monkeypatch)
    _, verifier = chunk_verifier(SEED)
    target = next(i for i in range(WORLD) if i not in (BAD, verifier))
    async with cluster(WORLD) as peers:
        ring = [p.id for p in peers]
        attacker = hostile.Owner(peers[BAD].collective, equivocate_to=ring[target], resign=False)
        spec = RoundSpec(density=1.0, robust="clip", timeout=20)
        xs = inputs(SIZES[size](1.0))

        member = hostile.acting_at(
            attacker, BAD, lambda i: peers[i].collective.dense_round(xs[i], ring, 8, spec, owner_seed=SEED))
        results = await gather([lambda i=i: member(i) for i in range(WORLD)])
    assert isinstance(results[target], BadPayload) and results[target].peer_id == ring[BAD]
    for i in range(WORLD):
        if i != BAD:
            assert isinstance(results[i], PeerFailed) and results[i].peer_id == ring[BAD], results[i]
