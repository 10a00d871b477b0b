"""The step summary of a pipelined step on real libp2p hosts (127.0.0.1): each driver's entry is its
own, and a member that forges one, sends a malformed one or tells members different things is named.

It was an exact sum over the plan's members (h-redteam's F13): a replica that added (0, 1) failed
every step, unnamed, and one that added (0, -1) to a failed driver's (0, 1) had its partial gradient
applied. Now every member's entry is its own, signed, and compared (run/_step_summary.py).
"""

from __future__ import annotations

import math

import torch
import trio

from p2ptrain.collective import BadPayload, Collective, Misbehaved
from p2ptrain.collective._direct import witnessed_broadcast
from p2ptrain.collective._gather import gather_description
from p2ptrain.collective._witness import digest_of, Witness
from p2ptrain.protocol import round_id
from p2ptrain.run._step_summary import gather_summary, StepSummary
from p2ptrain.testing import connected_hosts
from p2ptrain.wire import DTYPES, Header, Kind, MAX_SUMMARY_ENTRY_BYTES, Phase, RoundPlan, round_digest, Said, summary_entry_bytes

CID = "bafkreigh2akiscaildcqabsyg3dfr6chu3fgpregiymsck7e7aqa4s52zy"
DEADLINE_S = 60
STAGES = (0, 1, 0, 1)  # members 0 and 2 drive, 1 and 3 serve stage 1


def plan_of(hosts) -> RoundPlan:
    return RoundPlan(task_cid=CID, term=1, round=3, attempt=0, step=3, rounds=1, base_cid=CID, version=1,
                     members=tuple(str(h.id) for h in hosts), stages=STAGES)


async def everyone(calls) -> list:
    """Each member's result or exception, in order."""
    results: list = [None] * len(calls)

    async def one(i, call):
        try:
            results[i] = await call()
        except Exception as error:  # each test asserts on what every member saw
            results[i] = error

    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            for i, call in enumerate(calls):
                nursery.start_soon(one, i, call)
    return results


def honest(collective, plan, index, loss=0.0, failed=False):
    me = str(collective.peer_id)
    return lambda: gather_summary(collective, plan, index, me, loss, failed, timeout=10, start_timeout=20)


async def test_every_member_learns_each_drivers_own_loss_and_failure():
    async with connected_hosts(4) as hosts:
        cs = [Collective(h.host) for h in hosts]
        plan = plan_of(hosts)
        got = await everyone([honest(cs[0], plan, 0, 0.25), honest(cs[1], plan, 0), honest(cs[2], plan, 0, 0.5),
                              honest(cs[3], plan, 0)])
        assert got == [StepSummary(0.75, ())] * 4
        got = await everyone([honest(cs[0], plan, 1, 0.25), honest(cs[1], plan, 1), honest(cs[2], plan, 1, 0.0, True),
                              honest(cs[3], plan, 1)])
        assert got == [StepSummary(0.25, (plan.members[2],))] * 4


async def test_a_replica_that_speaks_for_a_driver_is_named():
    """A replica's entry is empty: one that says 'failed' (or anything) is refused, and named by
    every honest member (on main its (0, 1) in the sum failed the step with nobody named)."""
    async with connected_hosts(4) as hosts:
        cs = [Collective(h.host) for h in hosts]
        plan = plan_of(hosts)
        ring = [h.id for h in hosts]

        async def forging():
            return await cs[1].gather(summary_entry_bytes(0.0, True), ring, round_id(plan, 0), max_bytes=MAX_SUMMARY_ENTRY_BYTES,
                                      check=lambda member, raw: None, timeout=10, start_timeout=20)

        got = await everyone([honest(cs[0], plan, 0, 0.25), forging, honest(cs[2], plan, 0, 0.5), honest(cs[3], plan, 0)])
        for i in (0, 2, 3):
            assert isinstance(got[i], BadPayload) and got[i].peer_id == hosts[1].id, got[i]


async def test_a_driver_whose_entry_is_no_summary_is_named():
    async with connected_hosts(4) as hosts:
        cs = [Collective(h.host) for h in hosts]
        plan = plan_of(hosts)
        got = await everyone([honest(cs[0], plan, 0, 0.25), honest(cs[1], plan, 0), honest(cs[2], plan, 0, math.nan),
                              honest(cs[3], plan, 0)])
        for i in (0, 1, 3):
            assert isinstance(got[i], BadPayload) and got[i].peer_id == hosts[2].id, got[i]


async def test_a_driver_that_tells_members_different_summaries_is_named():
    """Driver 2 says 'done' to driver 0 and 'failed' to the replicas, each signed: were it believed,
    the replicas would drop the step and driver 0 apply it. The CONFIRM exchange names it."""
    async with connected_hosts(4) as hosts:
        cs = [Collective(h.host) for h in hosts]
        plan = plan_of(hosts)
        ring = [h.id for h in hosts]
        said = {hosts[0].id: summary_entry_bytes(0.5, False), hosts[1].id: summary_entry_bytes(0.0, True),
                hosts[3].id: summary_entry_bytes(0.0, True)}

        async def equivocating():
            rid = round_id(plan, 0)
            digest = round_digest(rid, ring, gather_description(MAX_SUMMARY_ENTRY_BYTES))
            async with cs[2].hub.open_round(ring, rid, digest, timeout=10, start_timeout=20, mesh=True) as links:
                witness = Witness(links, digest, hosts[2].host.get_private_key())

                async def tell(peer, payload):
                    body = payload + witness.sign(Said.VALUES, links.me, digest_of([payload]))
                    header = Header(Kind.DATA, rid, Phase.BROADCAST, 0, 0, len(body), DTYPES[torch.uint8])
                    await links.send(header, body, to=peer)

                async def hear(member):
                    await witnessed_broadcast(links, member, None, witness=witness, said=Said.VALUES,
                                              max_bytes=MAX_SUMMARY_ENTRY_BYTES, check=lambda raw: None)

                async with trio.open_nursery() as nursery:
                    for peer, payload in said.items():
                        nursery.start_soon(tell, peer, payload)
                    for member in (0, 1, 3):
                        nursery.start_soon(hear, member)
                await witness.confirm()

        got = await everyone([honest(cs[0], plan, 0, 0.25), honest(cs[1], plan, 0), equivocating, honest(cs[3], plan, 0)])
        for i in (0, 1, 3):
            assert isinstance(got[i], Misbehaved) and got[i].peer_id == hosts[2].id, got[i]
