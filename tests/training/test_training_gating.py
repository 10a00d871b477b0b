"""When a coordinator plans (RoundBook.decide): each gating rule, driven by an injected clock.

Three real elections elect a coordinator over signed votes; its RoundBook then answers what the
node's control loop asks at every tick: a plan to publish, or why not (Hold.WAIT, Hold.BEHIND).
"""

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain.protocol import Chain, Election, ElectionConfig, Hold, Participation, RoundBook, RuleBreak, View, signing
from p2ptrain.protocol._planner import FIRST_ROUND_GRACE_S
from p2ptrain.protocol._quarantine import FAILED_PEER_QUARANTINE_S
from p2ptrain.protocol._round_book import RETRY_BACKOFF_S
from p2ptrain.wire import RoundFailed, RoundPlan

CONFIG = ElectionConfig(heartbeat_s=1.0, timeout_beats=3)
INITIAL = "bafkreigh2akiscaildcqabsyg3dfr6chu3fgpregiymsck7e7aqa4s52zy"


class Run:
    """Three members' elections and books; ``c`` is the coordinator they elected."""

    def __init__(self, task, task_cid):
        keys = [create_new_key_pair() for _ in range(3)]
        self.ids = [signing.peer_str(k) for k in keys]
        self.elections = {p: Election(task_cid, k, CONFIG) for p, k in zip(self.ids, keys)}
        self.books = {p: RoundBook(task, task_cid, Chain(task_cid, INITIAL), 10) for p in self.ids}
        self.task_cid = task_cid
        now = 0.0
        while len({(e.term, e.coordinator) for e in self.elections.values()} - {(0, None)}) != 1 or any(
            e.coordinator is None for e in self.elections.values()
        ):
            now += 0.25
            assert now < 30, "no coordinator"
            queue = []
            for p, e in self.elections.items():
                queue += [(p, m) for m in e.tick(now, View(advertising=frozenset(self.ids) - {p}))]
            while queue:
                src, msg = queue.pop(0)
                for p, e in self.elections.items():
                    if p != src:
                        queue += [(p, m) for m in e.receive(now, src, msg)]
        self.c = next(p for p, e in self.elections.items() if e.is_coordinator)
        self.election = self.elections[self.c]
        self.book = self.books[self.c]
        self.others = [p for p in self.ids if p != self.c]

    def decide(self, now, my_step=0, advertising=None, span_running=False, rounds_running=False, head_version=0):
        return self.book.decide(now, self.election, my_step, set(self.ids) if advertising is None else advertising,
                                can_roll_back=False, span_running=span_running, rounds_running=rounds_running,
                                head_version=head_version)

    def follow(self, plan):
        assert isinstance(plan, RoundPlan), plan
        assert self.book.plan_problem(plan, self.c, self.election) is None
        return plan

    def report(self, plan, step):
        return RoundFailed(task_cid=self.task_cid, term=plan.term, round=plan.round, attempt=plan.attempt,
                           step=step, reason="x")


@pytest.fixture
def run(digits, digits_task):
    _, cid = digits
    return Run(digits_task(cid, steps=10), "QmTask")


def test_only_the_coordinator_plans(run):
    follower = run.others[0]
    assert run.books[follower].decide(100.0, run.elections[follower], 0, set(run.ids), can_roll_back=False,
                                      span_running=False, rounds_running=False, head_version=1) is Hold.WAIT
    # (behind the run too, but only a coordinator resyncs for that: a follower is dropped from plans)
    assert isinstance(run.decide(100.0), RoundPlan)


def test_the_first_plan_waits_for_peers_still_joining(run):
    run.book.note_elected(100.0)
    assert run.decide(100.0 + FIRST_ROUND_GRACE_S - 0.1) is Hold.WAIT
    plan = run.decide(100.0 + FIRST_ROUND_GRACE_S)
    assert isinstance(plan, RoundPlan) and plan.members == tuple(sorted(run.ids))


def test_the_first_plan_does_not_wait_when_the_task_is_full(digits, digits_task):
    # peers.max members already advertise the task: nobody else could join the first plan.
    full = Run(digits_task(digits[1], steps=10, **{"peers.max": "3"}), "QmTask")
    full.book.note_elected(100.0)
    assert full.decide(100.0, advertising={full.c, full.others[0]}) is Hold.WAIT
    plan = full.decide(100.0)
    assert isinstance(plan, RoundPlan) and plan.members == tuple(sorted(full.ids))


def test_no_plan_while_the_own_span_runs_unless_a_culprit_holds_it(run):
    plan = run.follow(run.decide(10.0))
    assert run.decide(11.0, span_running=True, rounds_running=True) is Hold.WAIT
    # A member reports that it cannot take part (its step is not the plan's): the coordinator's
    # own round would wait for it until the start timeout. Plan the retry without it at once.
    culprit = run.others[0]
    assert run.book.note_failure_report(11.0, run.report(plan, 7), culprit, run.c, coordinator=True)
    assert run.book.culprit_reported and culprit in run.book.quarantined(11.0)
    retry = run.follow(run.decide(11.0, span_running=True, rounds_running=True))
    assert (retry.round, retry.attempt) == (plan.round, plan.attempt + 1) and culprit not in retry.members
    # Following the retry clears the culprit: the span runs again, nothing to plan.
    assert not run.book.culprit_reported
    assert run.decide(11.5, span_running=True, rounds_running=True) is Hold.WAIT


def test_a_report_from_a_member_that_took_part_names_no_culprit(run):
    plan = run.follow(run.decide(10.0))
    assert run.book.note_failure_report(11.0, run.report(plan, plan.step), run.others[0], run.c, coordinator=True)
    assert not run.book.culprit_reported and run.book.quarantined(11.0) == frozenset()
    assert run.decide(11.0, span_running=True, rounds_running=True) is Hold.WAIT


def test_a_span_of_the_old_term_does_not_hold_a_new_coordinator(run):
    plan = run.decide(10.0)
    old = RoundPlan(**{**plan.__dict__, "term": run.election.term - 1})
    run.book.last_plan = old  # followed under the previous coordinator, its round still waiting
    assert run.decide(11.0, span_running=True, rounds_running=False) is Hold.WAIT  # checkpointing
    takeover = run.decide(11.0, span_running=True, rounds_running=True)
    assert isinstance(takeover, RoundPlan) and takeover.term == run.election.term
    assert takeover.attempt == old.attempt + 1


def test_a_retry_backs_off_unless_everyone_reported(run):
    plan = run.follow(run.decide(10.0))
    dead, alive = run.others
    run.book.note_round_failed(20.0, culprit=dead, gone=True)
    run.book.note_failure_report(20.0, run.report(plan, plan.step), run.c, run.c, coordinator=True)
    assert run.book.gone(20.0) == {dead}
    assert run.decide(20.0 + RETRY_BACKOFF_S - 0.1) is Hold.WAIT
    retry = run.decide(20.0 + RETRY_BACKOFF_S)
    assert isinstance(retry, RoundPlan) and dead not in retry.members
    # Every member but the culprit said it left the round: no need to wait.
    run.book.note_failure_report(20.1, run.report(plan, plan.step), alive, run.c, coordinator=True)
    assert isinstance(run.decide(20.1), RoundPlan)


def test_a_quarantine_ends(run):
    run.follow(run.decide(10.0))
    dead = run.others[0]
    run.book.note_round_failed(20.0, culprit=dead, gone=True)
    until = 20.0 + FAILED_PEER_QUARANTINE_S
    assert run.book.quarantined(until - 0.1) == run.book.gone(until - 0.1) == {dead}
    assert run.book.quarantined(until) == run.book.gone(until) == frozenset()
    run.book.note_silent_coordinator(until + 1, run.others[1])
    assert run.book.failed_peers.keys() == {run.others[1]}  # the one that ran out is forgotten


def test_a_coordinator_given_up_is_left_out(run):
    silent = run.others[0]
    run.book.note_silent_coordinator(10.0, silent)
    plan = run.decide(10.0)
    assert isinstance(plan, RoundPlan) and silent not in plan.members


def test_a_coordinator_behind_the_run_resyncs_instead_of_planning(run):
    assert run.decide(10.0, head_version=1) is Hold.BEHIND  # a later confirmed model
    ahead = RoundPlan(task_cid=run.task_cid, term=run.election.term + 5, round=4, attempt=0, step=4, rounds=1,
                      members=tuple(sorted(run.ids)), base_cid=INITIAL, version=0)
    assert run.book.plan_problem(ahead, run.others[0], run.election) is not None  # seen, not followed
    assert run.decide(10.0, my_step=0) is Hold.BEHIND  # a plan seen past our step
    assert run.decide(10.0, my_step=4) is not Hold.BEHIND


def test_the_roster_before_any_plan_is_the_heads_members(run):
    book, me = run.books[run.others[0]], run.others[0]
    assert book.roster(me) == ()
    assert book.roster(me, ("x", "y")) == ("x", "y")
    plan = run.decide(10.0)
    book.plan_problem(plan, run.c, run.elections[me])
    assert book.roster(me, ("x", "y")) == plan.members


def test_a_resynced_book_keeps_the_roster_and_the_timers(run):
    plan = run.follow(run.decide(10.0))
    run.book.note_elected(9.0)
    run.book.note_round_failed(20.0, culprit=run.others[0], gone=True)
    fresh = run.book.resynced(Chain(run.task_cid, INITIAL))
    assert fresh.last_plan is None and fresh.failed_round is None and fresh.observed is plan
    assert fresh.quarantined(20.0) == fresh.gone(20.0) == {run.others[0]}
    assert (fresh.retry_after, fresh.elected_at) == (20.0 + RETRY_BACKOFF_S, 9.0)


# -- the rules a member holds the coordinator's plans to (issue 27) ------------------------------------


def test_a_plan_that_breaks_the_tasks_rules_is_evidence_against_its_coordinator(run):
    """A member refuses, as a RuleBreak (it then stops following the coordinator), a plan from the
    elected coordinator whose members are too few for the task, not distinct, or that drops more
    than a minority of the plan before it; and refuses the records of that span later."""
    member = run.others[0]
    book, election = run.books[member], run.elections[member]
    first = run.decide(FIRST_ROUND_GRACE_S + 1)
    assert isinstance(first, RoundPlan) and book.plan_problem(first, run.c, election) is None
    assert book.span_plans[first.step + first.rounds] == first
    nxt = dict(task_cid=first.task_cid, term=first.term, round=first.round + first.rounds, attempt=0,
               step=first.step + first.rounds, rounds=first.rounds, base_cid=first.base_cid, version=1)
    # The coordinator alone: it drops 2 of the 3 members of the plan before.
    alone = RoundPlan(members=(run.c,), **nxt)
    problem = book.plan_problem(alone, run.c, election)
    assert isinstance(problem, RuleBreak) and "keeps 1 of the 3 members" in problem
    assert (nxt["step"] + first.rounds, first.term, 0) in book.refused_spans
    # Two members, one of them a newcomer in place of a member: still 1 of 3 kept.
    swapped = RoundPlan(members=(run.c, "12D3KooWnewcomerNotInThePlanBefore000000000000000"), **nxt)
    assert isinstance(book.plan_problem(swapped, run.c, election), RuleBreak)
    twice = RoundPlan(members=(run.c, member, member), **nxt)
    assert book.plan_problem(twice, run.c, election) == "members are not distinct"
    # Dropping one of three is allowed (a member died), and followed.
    fine = RoundPlan(members=(run.c, member), **nxt)
    assert book.plan_problem(fine, run.c, election) is None
    # The same plans from a peer that is not the coordinator are no evidence of anything.
    assert not isinstance(book.plan_problem(alone, member, election), RuleBreak)


def test_a_plan_naming_a_peer_off_the_allowlist_breaks_the_rules(digits, digits_task):
    store, manifest = digits
    keys = [create_new_key_pair() for _ in range(3)]
    ids = [signing.peer_str(k) for k in keys]
    allow = "[" + ", ".join(f'"{p}"' for p in ids[:2]) + "]"
    task = digits_task(manifest, **{"peers.min": "1", "peers.admission": '"allowlist"', "peers.allow": allow})
    assert task.peers.admits(ids[0]) and not task.peers.admits(ids[2])
    book = RoundBook(task, "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o", Chain("x", INITIAL), 10)
    plan = RoundPlan(task_cid=book.task_cid, term=1, round=0, attempt=0, step=0, rounds=5, members=tuple(ids),
                     base_cid=INITIAL, version=0)
    assert "allowlist does not admit" in book.rule_problem(plan)
    assert book.rule_problem(RoundPlan(**{**plan.__dict__, "members": tuple(ids[:2])})) is None
    few = digits_task(manifest, **{"peers.min": "3"})
    book = RoundBook(few, book.task_cid, Chain("x", INITIAL), 10)
    assert "2 members, the task allows 3 to 64" in book.rule_problem(RoundPlan(**{**plan.__dict__, "members": tuple(ids[:2])}))


def test_a_report_before_the_coordinators_own_failure_does_not_strike_a_joiner_yet_to_report(run):
    """Issue 28: a member SIGKILLed in a late joiner's first span. Another member's report reached the
    coordinator before its own round failed, while its retry backoff was still an earlier failure's
    (none: 0); its control loop then took every member yet to report for silent and struck the joiner
    (no round or vote of it yet). Without it the retry kept 2 of the 4 members, short of a quorum:
    the run waited 60 s for the strike to end. The retry is now planned at once with the joiner."""
    joiner = signing.peer_str(create_new_key_pair())
    ledger = Participation(grace_s=30.0, answer_s=3.0)
    ledger.note_round(5.0, run.ids)  # the three trained together; the joiner has done nothing yet
    everyone = {*run.ids, joiner}
    plan = run.follow(run.decide(10.0, advertising=everyone))
    assert set(plan.members) == everyone
    dead, alive = run.others

    def tick(now, span_running):
        """What the coordinator's control loop does (run/_leading.py, _maybe_plan), clock injected."""
        for peer in run.book.silent_members(now) - {run.c}:
            ledger.note_missed(now, peer)
        live = ledger.counted(now, everyone - {run.c}, needed=run.book.task.peers.min - 1) | {run.c}
        return run.decide(now, advertising=live, span_running=span_running, rounds_running=span_running)

    run.book.note_failure_report(20.00, run.report(plan, plan.step), alive, run.c, coordinator=True)
    assert tick(20.00, span_running=True) is Hold.WAIT  # our own round has not failed yet
    run.book.note_round_failed(20.01, culprit=dead, gone=True)
    ledger.note_missed(20.01, dead)  # (run/_spans.py, _failed_here: it trained in our last round)
    run.book.note_failure_report(20.01, run.report(plan, plan.step), run.c, run.c, coordinator=True)
    run.book.note_failure_report(20.06, run.report(plan, plan.step), joiner, run.c, coordinator=True)
    retry = tick(20.06, span_running=False)  # every member but the dead one reported
    assert isinstance(retry, RoundPlan) and set(retry.members) == everyone - {dead}
    assert ledger.struck(20.06) == frozenset()
    assert (retry.round, retry.attempt) == (plan.round, plan.attempt + 1)


def test_a_planned_joiner_that_never_reports_a_failure_is_still_struck_after_the_backoff(run):
    """What the ledger guards against stays: a peer planned in a round that failed, which does not
    report it within RETRY_BACKOFF_S of the first report (it only advertised the task), is struck,
    whether or not the coordinator's own round has failed by then."""
    sybil = signing.peer_str(create_new_key_pair())
    ledger = Participation(grace_s=30.0, answer_s=3.0)
    plan = run.follow(run.decide(10.0, advertising={*run.ids, sybil}))
    for reporter in run.others:
        run.book.note_failure_report(20.0, run.report(plan, plan.step), reporter, run.c, coordinator=True)
    assert run.book.silent_members(20.0 + RETRY_BACKOFF_S - 0.01) == frozenset()
    silent = run.book.silent_members(20.0 + RETRY_BACKOFF_S)
    assert silent == {run.c, sybil}  # (the coordinator's own round still waits: it skips itself)
    for peer in silent - {run.c}:
        ledger.note_missed(20.0 + RETRY_BACKOFF_S, peer)
    assert ledger.struck(20.0 + RETRY_BACKOFF_S) == {sybil}
