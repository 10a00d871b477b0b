"""A fresh run's coordinator whose class of arithmetic cannot plan steps down (protocol/_arithmetics.py,
the census): a pure simulation of three members, in one process, wired as run/_leading.py wires
them (Election, Participation, the RoundBook's classes and planner); time is advanced explicitly,
every vote is signed and checked, and the links to one loaded member are slow.

Two members compute with AVX2 kernels, one with the scalar kernels (left out of the run's plans,
as in tests/runtime/test_trailing_member.py, whose suite runs stalled so). The scalar member is
the designated candidate of term 1 and, with nobody's vote heard yet, counts only itself: it
stands. The fast AVX2 member's vote elects it; the loaded one's comes after the election, which
then counted no vote (a late vote counts now: tests/protocol/test_late_votes.py; here the rule
below has made it step down before it comes), so its census is one peer of each class, and the
tie went to the scalar class (its peer ranks lowest). On main it then stayed coordinator and planned nothing, for good: its class
(one live peer) could never make a plan of ``peers.min`` (2), the others followed its heartbeats,
and no term ended (``ClassClaims`` counts only terms whose candidate is of the run's class).
Now a class of the census too small to plan gives way to one that could: it steps down at once
and an AVX2 member is elected and plans.
"""

from __future__ import annotations

from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain.protocol import (
    Chain, Election, ElectionConfig, ElectionMessage, Participation, RoundBook, View, receive_noting, signing,
)
from p2ptrain.protocol._voters import designated, rank
from p2ptrain.task import Task, load_task
from p2ptrain.wire import RoundPlan

from tests.protocol._books import over_links

INITIAL = "bafkreigh2akiscaildcqabsyg3dfr6chu3fgpregiymsck7e7aqa4s52zy"
CONFIG = ElectionConfig(heartbeat_s=1.0, timeout_beats=3)
AVX2 = "torch 2.13.0 on the CPU with AVX2 kernels"
SCALAR = "torch 2.13.0 on the CPU with DEFAULT kernels"
MIN_PEERS = 2
FAST_S, SLOW_S = 0.05, 1.0  # one way, between the two others / to or from the loaded member
KEYS = [create_new_key_pair(bytes([i + 1]) * 32) for i in range(3)]  # fixed: the same ranks every run
FAST, LOADED, ODD = (signing.peer_str(k) for k in KEYS)
ARITHMETIC = {FAST: AVX2, LOADED: AVX2, ODD: SCALAR}


def _task() -> Task:
    return load_task(
        'name = "d"\nseed = 3\n[training]\nbatch_size = 32\ntotal_steps = 10\ncheckpoint_interval = 5\n'
        '[optimizer]\nname = "sgd"\nlr = 0.1\n[model]\nname = "mlp"\n'
        f'[dataset]\nmanifest = "{INITIAL}"\n[peers]\nmin = {MIN_PEERS}\nmax = 8\n'
    )


def _task_cid() -> str:
    """A task CID under which the scalar member is term 1's candidate and wins a tie with the fast
    member (the first of the kind, so the same every run)."""
    for i in range(1000):
        cid = f"QmTaskCensus{i}"
        if designated(cid, 1, ARITHMETIC) == ODD and rank(cid, 0, ODD) < rank(cid, 0, FAST):
            return cid
    raise AssertionError("no such task CID")


class Member:
    """One member's election, participation ledger and round book, wired as run/_leading.py does."""

    def __init__(self, task_cid: str, key: object) -> None:
        self.election = Election(task_cid, key, CONFIG)  # type: ignore[arg-type]
        self.me = self.election.me
        self.participation = Participation()
        self.book = RoundBook(_task(), task_cid, Chain(task_cid, INITIAL), 10)
        self.led: list[int] = []  # the terms this member was coordinator in
        self.plan: RoundPlan | None = None

    def live(self, now: float) -> set[str]:
        """RunState.advertising: every other member advertises the task; those that count, and me."""
        others = set(ARITHMETIC) - {self.me}
        return set(self.participation.counted(now, others, needed=MIN_PEERS - 1)) | {self.me}

    def tick(self, now: float) -> list[ElectionMessage]:
        live = self.live(now)
        took_part = self.participation.took_part(now)
        classes = self.book.classes(self.me, {p: ARITHMETIC[p] for p in live}, live, took_part)
        before = self.election.coordinator
        outs = self.election.tick(now, View(advertising=frozenset(live)), (), may_lead=classes.may_lead)
        self._noted(now, before, outs)
        if self.election.is_coordinator and self.plan is None:
            decision = self.book.decide(now, self.election, 0, live, can_roll_back=False, span_running=False,
                                        rounds_running=False, head_version=0,
                                        arithmetics={p: ARITHMETIC[p] for p in live}, took_part=took_part)
            self.plan = decision if isinstance(decision, RoundPlan) else None
        return outs

    def receive(self, now: float, sender: str, msg: ElectionMessage) -> list[ElectionMessage]:
        before = self.election.coordinator
        outs = receive_noting(self.election, self.participation, now, sender, msg)
        self._noted(now, before, outs)
        return outs

    def _noted(self, now: float, before: str | None, outs: list[ElectionMessage]) -> None:
        self.participation.note_sent(now, self.me, outs)
        if self.election.is_coordinator and before != self.me:
            self.book.note_elected(now)
            self.led.append(self.election.term)


def _simulate(seconds: float) -> tuple[dict[str, Member], float | None]:
    """Run the three members for ``seconds``; the members and when a plan was first made (None: never)."""
    task_cid = _task_cid()
    members = {m.me: m for m in (Member(task_cid, k) for k in KEYS)}
    planned_at = over_links(members, seconds, lambda src, dst: SLOW_S if LOADED in (src, dst) else FAST_S,
                            lambda dst, now, src, msg: members[dst].receive(now, src, msg),
                            lambda: any(m.plan is not None for m in members.values()))
    return members, planned_at


def test_a_coordinator_whose_class_cannot_plan_steps_down_and_one_that_can_plans() -> None:
    """Fails on main: the scalar member leads term 1 for good and no plan is ever made."""
    members, planned_at = _simulate(120.0)
    odd = members[ODD]
    assert odd.led[:1] == [1], odd.led  # the setting above: it stood in term 1 and won it
    assert planned_at is not None, [(m.election.term, m.election.coordinator == m.me) for m in members.values()]
    planner = next(m for m in members.values() if m.plan is not None)
    assert planner.me in (FAST, LOADED) and odd.me not in planner.plan.members, planner.plan  # type: ignore[union-attr]
    assert not odd.election.is_coordinator and planned_at < 30.0, planned_at


def test_the_census_gives_a_fresh_run_to_the_class_that_could_plan() -> None:
    """The rule alone, as the scalar coordinator saw it: one peer of each class in its census (itself
    and its voter), the tie its class's, but two live AVX2 peers against its one."""
    book = RoundBook(_task(), _task_cid(), Chain(_task_cid(), INITIAL), 10)
    tie = book.classes(ODD, ARITHMETIC, set(ARITHMETIC), took_part={FAST})
    assert tie.run == AVX2 and not tie.may_lead and tie.planned == {FAST, LOADED}
    # Where no class of the census could plan, the census decides as before (the run waits).
    two = {FAST: AVX2, ODD: SCALAR}
    assert book.classes(ODD, two, set(two), took_part={FAST}).run == SCALAR
    # A class that nobody of took part in the run gets it never, however many advertise it.
    assert book.classes(ODD, ARITHMETIC, set(ARITHMETIC), took_part=()).run == SCALAR
