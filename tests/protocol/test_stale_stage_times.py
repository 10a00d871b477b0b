"""Stage times of a dropped attempt, kept by a member that never took the retry's plan, weigh no plan.

Under ``[pipeline] balance = "measured"`` a plan from step ``t`` is made and checked with the stage
times of the summary of the step that ended at ``t`` (protocol/_stage_costs.py). A member that
applied that step alone (its stage's sum completed, another's did not) kept that attempt's times.
Accepting the retry's plan drops them (``StageTimes.forget_after``); a member that never took it (it
did not know that term's coordinator yet, so the plan was not its coordinator's) kept them. The
retry then went through without it, its checkpoint was confirmed, and the next span admitted it
back from there (a joiner at the head). It held that honest plan to the dropped attempt's times and
refused it as a rule break (it then stops following the coordinator for good); elected itself, it
planned with them, costs no member holding the confirmed attempt's times computes.

Now each step's times are kept with the (term, attempt) of the plan the member applied it under, and
a plan from a confirmed checkpoint is weighed only by times of the attempt its record names
(``StageTimes.for_plan``): this member has none there, so it checks the shape only, as a member that
resynced does, and plans by parameters. Fails on main (a ``RuleBreak``)."""

from __future__ import annotations

from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain.protocol import Chain, Election, ElectionConfig, RoundBook, RuleBreak, sign_record, signing
from p2ptrain.protocol._plans import plan_stages, rule_problem
from p2ptrain.task import load_task, stage_parameters
from p2ptrain.wire import ModelRecord, RoundPlan
from tests.protocol._books import CID, elected, lm, task_text

MODEL = "QmQQFmbEzeKEYVMidxPKhdPYbB5DR8mFW8YG5KaEvoSi1o"
TASK = task_text(lm(2), checkpoint_interval=5, min_peers=3, pipeline='stages = 3\nbalance = "measured"\n')


def test_a_member_that_never_took_the_retry_does_not_weigh_plans_by_the_dropped_attempts_times():
    task = load_task(TASK)
    parameters = stage_parameters(task)
    key = create_new_key_pair(b"\x05" * 32)
    election = Election("QmTask", key, ElectionConfig(heartbeat_s=1.0, timeout_beats=3))
    now = elected(election, 0.0)
    me = election.me  # the member whose times are stale (and, below, a coordinator elected with them)
    members = tuple(sorted([me, *(signing.peer_str(create_new_key_pair(bytes([i]) * 32)) for i in range(10, 15))]))
    others = tuple(m for m in members if m != me)

    def plan(term: int, first_round: int, names: tuple[str, ...], stages: tuple[int, ...] | None,
             version: int = 0, base: str = CID) -> RoundPlan:
        return RoundPlan(task_cid="QmTask", term=term, round=first_round, attempt=0, step=first_round, rounds=5,
                         members=names, base_cid=base, version=version, stages=stages)

    stale = RoundBook(task, "QmTask", Chain("QmTask", CID), 100)  # the member that never took the retry
    honest = RoundBook(task, "QmTask", Chain("QmTask", CID), 100)  # a member that took it
    first = plan(election.term, 0, members, plan_stages(task, members, None))
    assert first.stages is not None
    for book in (stale, honest):
        assert book.plan_problem(first, me, election) is None
    even = tuple(2 * p for p in parameters)
    dropped = (even[0], parameters[1], 40 * parameters[2])  # round 4 as applied here alone: stage 2 slow
    through = (even[0], 40 * parameters[1], parameters[2])  # round 4 as it went through: stage 1 slow
    for book in (stale, honest):
        book.stage_times.note(4, even, (first.term, first.attempt))
    stale.stage_times.note(5, dropped, (first.term, first.attempt))

    # Round 4 failed elsewhere; the next term's coordinator goes back to the head (step 0) without
    # this member. Not knowing that coordinator yet, it does not take the plan (another's, to it).
    now = elected(election, now)
    retry = plan(election.term, 0, others, plan_stages(task, others, first))
    assert stale.plan_problem(retry, others[0], election) is not None and stale.accepted == first
    assert honest.plan_problem(retry, me, election) == "not a member of this span"
    honest.stage_times.note(5, through, (retry.term, retry.attempt))
    # The retry's span is confirmed at step 5, v1. This member does not take that record up (its
    # span's plan is not one it took: RoundBook.span_members), so the next span's plan, from v1,
    # reaches it first: it holds that plan to no times (a base it has not confirmed), and resyncs to
    # v1 to follow it, where on main the dropped attempt's times refused it as a rule break.
    nxt = plan(retry.term, 5, members, plan_stages(task, members, retry, through), version=1, base=MODEL)
    assert nxt.stages not in (plan_stages(task, members, first, dropped), plan_stages(task, members, first))
    assert rule_problem(task, 100, nxt, first, dropped) is not None  # what main checked it with
    assert stale.rule_problem(nxt) is None
    # Or it holds the record (a head's chain brought it) and the times it kept name another attempt.
    record = ModelRecord(task_cid="QmTask", version=1, parent=CID, round=4, step=5, members=others, metrics={},
                         model_cid=MODEL, optimizer_cid=MODEL, term=retry.term, coordinator="", attempt=retry.attempt)
    for book in (stale, honest):
        book.chain.append(sign_record(record, key))
    # Elected now, with the dropped attempt's times, it planned the next span by them: costs that no
    # member holding the confirmed attempt's times computes. Now it plans by parameters (whether the
    # others accept that still depends on the plan each took last: docs/pipeline.md, "In the plans").
    assert stale.stage_times.at(5) == dropped  # kept (task status shows what it measured), not weighed
    assert stale.stage_times.for_plan(stale.chain, 5, 1) is None
    assert honest.stage_times.for_plan(honest.chain, 5, 1) == through
    own = stale.next_plan(election, 5, set(members))
    assert own is not None and (own.step, own.version) == (5, 1) and set(own.members) == set(members)
    # (on main: the placement by the dropped attempt's times)
    assert own.stages == plan_stages(task, own.members, first) != plan_stages(task, own.members, first, dropped)
    # A plan from a checkpoint this member has not confirmed yet: no times can be its attempt's.
    assert honest.stage_times.for_plan(honest.chain, 5, 2) is None

    # The next span admits this member back at the head; the coordinator weighed it by the times of
    # the attempt that went through.
    assert honest.plan_problem(nxt, me, election) is None
    problem = stale.plan_problem(nxt, me, election)
    assert not isinstance(problem, RuleBreak), problem  # on main: a RuleBreak against an honest coordinator
    assert problem is None and stale.accepted == nxt
