"""A pipelined task's plans assign each member a stage: the coordinator computes it with ``assign``
from the plan before, every member that took that plan computes the same and refuses any other as a
rule break; the plans of every other task keep their wire bytes (no ``stages`` field at all)."""

from __future__ import annotations

import hashlib

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain.protocol import (
    Chain, Election, ElectionConfig, RoundBook, RuleBreak, View, assign, inner_round_id, round_id, shard_of, signing,
    stage_rings, stage_round_id,
)
from p2ptrain.protocol._plans import plan_stages, rule_problem
from p2ptrain.task import load_task, stage_parameters
from p2ptrain.wire import RoundPlan, decode, encode
from p2ptrain.wire._schema import SchemaError, from_plain, to_plain

from .conftest import CID, LM_TASK

KEY = create_new_key_pair(b"\x03" * 32)
PIPELINED = LM_TASK + "[pipeline]\nstages = 2\n"
PEERS = [signing.peer_str(create_new_key_pair(bytes([i]) * 32)) for i in range(10, 16)]


def test_a_plan_without_stages_keeps_its_wire_bytes():
    plan = RoundPlan(task_cid=CID, term=2, round=10, attempt=1, step=10, rounds=5, members=("a", "b"),
                     base_cid=CID, version=2)
    assert set(to_plain(plan)) == {"task_cid", "term", "round", "attempt", "step", "rounds", "members",
                                   "base_cid", "version"}
    # The digest of this signed plan as main encoded it before plans could carry stages.
    data = encode(plan, KEY, seq=7, ts=1700000000.5)
    assert hashlib.sha256(data).hexdigest() == "04fc988e71e288eeffc05b333c7496342e2b61a1c9860d5c9322720dfc7483e2"
    staged = RoundPlan(**{**plan.__dict__, "stages": (1, 0)})
    got = decode(encode(staged, KEY, seq=8, ts=1700000000.5), now=1700000000.5).msg
    assert got == staged and got.stages == (1, 0)
    # One encoding of each plan: an explicit null is refused, not read as "no stages".
    with pytest.raises(SchemaError, match="stages: null"):
        from_plain(RoundPlan, {**to_plain(plan), "stages": None})


def _coordinator(task) -> tuple[Election, RoundBook]:
    """A lone peer elected coordinator of ``task`` (the other members are only names in its plans)."""
    election = Election("QmTask", KEY, ElectionConfig(heartbeat_s=1.0, timeout_beats=3))
    now = 0.0
    while not election.is_coordinator:
        now += 0.25
        assert now < 30, "no coordinator"
        election.tick(now, View(advertising=frozenset()))
    return election, RoundBook(task, "QmTask", Chain("QmTask", CID), 100)


def test_the_coordinator_assigns_stages_and_members_hold_it_to_assign():
    task = load_task(PIPELINED)
    costs = stage_parameters(task)
    assert len(costs) == 2 and sum(costs) > 0
    election, book = _coordinator(task)
    live = {election.me, *PEERS[:3]}
    first = book.next_plan(election, 0, live)
    assert first is not None and first.stages is not None
    expected = assign(first.members, costs)
    assert first.stages == tuple(expected[m] for m in first.members) and set(first.stages) == {0, 1}
    assert book.plan_problem(first, election.me, election) is None  # the coordinator follows it too
    # A joiner that took no plan before checks the shape only.
    assert rule_problem(task, 100, first, None) is None

    # The next span admits two more (six members): the members keep their stages, the newcomers go where it is slowest.
    members = tuple(sorted(live | set(PEERS[3:5])))
    nxt = dict(task_cid="QmTask", term=first.term, round=first.round + first.rounds, attempt=0,
               step=first.step + first.rounds, rounds=first.rounds, members=members, base_cid=CID, version=1)
    stages = plan_stages(task, members, first)
    assert stages is not None
    kept = dict(zip(first.members, first.stages, strict=True))
    assert all(stages[members.index(m)] == s for m, s in kept.items())
    assert rule_problem(task, 100, RoundPlan(**nxt, stages=stages), first) is None

    # Two members of different stages swapped: what assign gives is the rule, so it is a rule break.
    i, j = stages.index(0), stages.index(1)
    swapped = list(stages)
    swapped[i], swapped[j] = 1, 0
    problem = rule_problem(task, 100, RoundPlan(**nxt, stages=tuple(swapped)), first)
    assert problem is not None and "the assignment from plan" in problem
    assert "stage 1 without a member" in rule_problem(task, 100, RoundPlan(**nxt, stages=(0,) * len(members)), first)
    assert "assigns 0 stages to 6 members" in rule_problem(task, 100, RoundPlan(**nxt), first)
    assert "out of 0..1" in rule_problem(task, 100, RoundPlan(**nxt, stages=(0, 1, 2, 0, 1, 0)), first)
    # Through the member's book it is a RuleBreak: evidence against the coordinator.
    refused = book.plan_problem(RoundPlan(**{**nxt, "term": election.term}, stages=tuple(swapped)), election.me, election)
    assert isinstance(refused, RuleBreak) and "the assignment from plan" in refused


def test_a_task_without_pipeline_has_plans_without_stages():
    task = load_task(LM_TASK)
    election, book = _coordinator(task)
    plan = book.next_plan(election, 0, {election.me, *PEERS[:3]})
    assert plan is not None and plan.stages is None and plan_stages(task, plan.members, None) is None
    staged = RoundPlan(**{**plan.__dict__, "stages": (0, 1, 0, 1)})
    assert rule_problem(task, 100, staged, None) == "it assigns stages, the task has no [pipeline]"


def test_a_pipelined_plan_has_a_ring_and_a_round_per_stage_and_stage_0_reads_the_data():
    plan = RoundPlan(task_cid=CID, term=2, round=10, attempt=1, step=10, rounds=5, members=tuple(PEERS[:5]),
                     base_cid=CID, version=2, stages=(1, 0, 1, 0, 0))
    assert stage_rings(plan) == [(PEERS[1], PEERS[3], PEERS[4]), (PEERS[0], PEERS[2])]
    # Only stage 0 reads data: its members' shards are 0..2 of 3; the plan without stages shards all five.
    assert [shard_of(plan, p) for p in (PEERS[1], PEERS[3], PEERS[4])] == [(0, 3), (1, 3), (2, 3)]
    flat = RoundPlan(**{**plan.__dict__, "stages": None})
    assert shard_of(flat, PEERS[4]) == (4, 5)
    ids = {stage_round_id(plan, i, s) for i in range(plan.rounds) for s in range(2)} | {round_id(plan, 0)}
    # In local-SGD mode each inner step of a round has its own summary: apart from the rest too.
    ids |= {inner_round_id(plan, i, inner) for i in range(plan.rounds) for inner in range(3)}
    assert len(ids) == 2 * plan.rounds + 1 + 3 * plan.rounds
    assert stage_round_id(plan, 0, 1) == stage_round_id(RoundPlan(**plan.__dict__), 0, 1)  # from the plan alone
