"""Identities that vote at a run's start, before any coordinator is known (red team's H2), on real
peers: what they obtain.

A member notes a vote as taking part (protocol/_participation.py) only while it has no coordinator,
and a fresh run's class (the arithmetic its plans keep to, protocol/_arithmetics.py) is that of most
of the peers that took part. So early Sybil votes take a new task's class, leave the honest members
out for their arithmetic (neither may then stand) and stop the run: with open admission they did
(three Sybils beside two members: no step in 90 s). Off an allowlist they obtain nothing; in an open
task their class loses its claim after a few terms in which none of them planned
(protocol/_class_claims.py), and the members' run goes on. Both are pinned here.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import trio

from p2ptrain.cli.task import render_status
from p2ptrain.control import TaskStatus
from p2ptrain.protocol import bits_class
from p2ptrain.protocol.signing import sign
from p2ptrain.testing import LocalPeers, local_peers, publish_digits_task
from p2ptrain.wire import SignedVote, task_topic, Vote, VoteRequest

pytestmark = pytest.mark.usefixtures("quick_timers")  # tests/conftest.py: the protocol's idle waits shortened

SETUP_S = 110.0  # beside the wait for the checkpoint: the peers, the task, the Sybils, and their teardown
FOREIGN = "torch 9.9.9 on the CPU with scalar kernels"  # an arithmetic no member computes with


def _version(peers: LocalPeers, task_cid: str, honest: range) -> int:
    return min(peers.status(i, task_cid).get("version", 0) for i in honest)


def _term(peers: LocalPeers, task_cid: str, honest: range) -> int:
    runs = [peers[i].tasks.runs.get(task_cid) for i in honest]
    return max((r.shared.election.term for r in runs if r is not None), default=0)


async def _voting_sybils(peers: LocalPeers, task_cid: str, k: int, honest: range, arithmetic: str,
                         nursery: trio.Nursery) -> list[str]:
    """``k`` peers advertising ``task_cid`` with ``arithmetic`` that, every 0.2 s, sign a vote in the
    members' current term (for the first Sybil, which also asks for votes), as a party that reads
    the task's topic would: each voter's vote is its own, signed by its own key."""
    sybils = []
    for _ in range(k):
        sybil = await peers.add_peer()
        membership = sybil.node.membership
        caps = await membership.caps_known()
        membership.caps = replace(caps, arithmetic=arithmetic)
        membership.tasks = (task_cid,)
        sybils.append(sybil)
    ids = [s.node.peer_id.to_base58() for s in sybils]

    async def vote() -> None:
        while True:
            term = max(1, _term(peers, task_cid, honest))
            await sybils[0].node.publish(task_topic(task_cid), VoteRequest(task_cid=task_cid, term=term, candidate=ids[0]))
            for sybil, me in zip(sybils, ids, strict=True):
                body = Vote(task_cid=task_cid, term=term, candidate=ids[0], voter=me)
                await sybil.node.publish(task_topic(task_cid), SignedVote(vote=body, signature=sign(body, sybil.node.key_pair)))
            await trio.sleep(0.2)

    nursery.start_soon(vote)
    return ids


async def _sybils_take_nothing(tmp_path: Path, allowlist: bool, wait_s: float, what: str) -> None:
    """Two members join a new task beside three Sybils of another arithmetic voting from its start:
    within ``wait_s`` the first checkpoint comes, the run's class is the members', and no Sybil is in
    a record. ``allowlist``: the task admits only the two members."""
    honest = range(2)
    with trio.fail_after(wait_s + SETUP_S):
        async with local_peers(2, tmp_path, heartbeat_interval=0.5) as peers, trio.open_nursery() as nursery:
            allowed = [peers[i].node.peer_id.to_base58() for i in honest]
            extra = f'admission = "allowlist"\nallow = {allowed!r}\n'.replace("'", '"') if allowlist else ""
            task_cid = await publish_digits_task(peers[0], total_steps=400, checkpoint_interval=4, min_peers=2,
                                                 extra=extra)
            sybils = await _voting_sybils(peers, task_cid, 3, honest, FOREIGN, nursery)
            for i in honest:
                await peers[i].tasks.join(task_cid)
            barred: set[str] = set()  # the classes any member's `task status` named barred on the way
            shown: list[str] = []  # `task status`'s lines for them

            def checkpoint() -> bool:
                for i in honest:
                    status = peers.status(i, task_cid)
                    if status["arithmetic_barred"]:
                        barred.update(e["class"] for e in status["arithmetic_barred"])
                        shown.extend(line for line in render_status(TaskStatus.from_json(status)).splitlines()
                                     if line.startswith("barred "))
                return _version(peers, task_cid, honest) >= 1

            await peers.wait_until(checkpoint, wait_s, what=what)
            # Off the allowlist the Sybils are never live, so nothing is barred; in an open task their
            # class is barred (and shown so) until the members' first plan ends the census.
            assert (bits_class(FOREIGN) in barred) if not allowlist else not barred, barred
            assert any(bits_class(FOREIGN) in line for line in shown) or allowlist, shown
            for i in honest:
                status = peers.status(i, task_cid)
                assert status["arithmetic_run"] != FOREIGN and status["arithmetic_barred"] == [], status
                record = peers[i].tasks.runs[task_cid].shared.book.chain.records[-1].record
                assert not set(record.members) & set(sybils)
            nursery.cancel_scope.cancel()


async def test_early_voting_sybils_off_the_allowlist_take_nothing(tmp_path: Path) -> None:
    """Three identities off the task's allowlist, advertising another arithmetic, voting from the
    run's start in every term: the run's class stays its members', the first checkpoint comes, and
    no Sybil is in a record. What holds it is the allowlist in ``RunState.advertising`` (only allowed
    peers count as live, so none of their votes reach the class's census). Without that rule they
    took the class, both members were left out for their arithmetic, no coordinator was elected and
    no step was made in 90 s: what they did to a task with open admission before its class's claim
    could lapse (the next test; docs/security.md, "Early voting Sybils")."""
    await _sybils_take_nothing(tmp_path, True, 90, "a new task's first checkpoint beside three Sybils voting from its start")


async def test_early_voting_sybils_of_another_arithmetic_lose_an_open_run(tmp_path: Path) -> None:
    """The same three identities against a task with open admission (no allowlist): their votes do
    reach the census, so their class holds the fresh run's claim at first; none of them plans, and
    after a few terms whose candidate was theirs without a plan, the class loses its claim
    (protocol/_class_claims.py). Its peers then count neither in the census nor as voters, the
    members' class is the run's, one of them is elected and the first checkpoint comes. On main
    they held the run: no coordinator and no step in 90 s. The wait is longer than the allowlist's
    (150 s): only terms whose designated candidate is a Sybil count (3 of 5), and terms grow to 12 s
    here; fewer than 2 such terms among the first 12 (~110 s) is under 1 in 1,000 runs."""
    await _sybils_take_nothing(tmp_path, False, 150,
                               "an open task's first checkpoint beside three Sybils voting from its start")
