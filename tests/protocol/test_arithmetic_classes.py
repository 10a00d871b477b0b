"""The planner keeps a run to members that compute the same bits (protocol/_arithmetics.py): pure,
driven by a RoundBook and the arithmetics the live peers advertise, no network and no clock.

On main the planner planned every advertising peer: three vectorized members and a scalar one made
a plan of four (the scalar member loaded the confirmed state at every checkpoint), and two of each
a plan of four in which neither pair is a quorum, so no checkpoint was ever confirmed.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain.protocol import Chain, Hold, RoundBook, bits_class, signing
from p2ptrain.protocol._arithmetics import sort_classes
from p2ptrain.protocol._planner import ARITHMETIC_WAIT_S, FIRST_ROUND_GRACE_S
from p2ptrain.protocol._voters import rank
from p2ptrain.task import Task, load_task
from p2ptrain.wire import RoundPlan

TASK_CID = "QmTaskArithmetic"
INITIAL = "bafkreigh2akiscaildcqabsyg3dfr6chu3fgpregiymsck7e7aqa4s52zy"
AVX2 = "torch 2.13.0 on the CPU with AVX2 kernels"
AVX512 = "torch 2.13.0 on the CPU with AVX512 kernels"
SCALAR = "torch 2.13.0 on the CPU with DEFAULT kernels"
OTHER_RELEASE = "torch 2.11.0 on the CPU with AVX2 kernels"


def _task(peers_min: int = 2, peers_max: int = 8) -> Task:
    return load_task(
        'name = "d"\nseed = 3\n[training]\nbatch_size = 32\ntotal_steps = 10\ncheckpoint_interval = 5\n'
        '[optimizer]\nname = "sgd"\nlr = 0.1\n[model]\nname = "mlp"\n'
        f'[dataset]\nmanifest = "{INITIAL}"\n[peers]\nmin = {peers_min}\nmax = {peers_max}\n'
    )


@dataclass
class Elected:
    """What the planner reads of an election that made ``me`` coordinator of ``term``."""

    me: str
    term: int = 1
    is_coordinator: bool = True

    @property
    def coordinator(self) -> str:
        return self.me


def _peers(n: int) -> list[str]:
    return [signing.peer_str(create_new_key_pair()) for _ in range(n)]


def _decide(arithmetics: dict[str, str | None], me: str, task: Task | None = None,
            book: RoundBook | None = None, took_part: set[str] | tuple[str, ...] | None = None) -> RoundPlan | Hold:
    book = book or RoundBook(task or _task(), TASK_CID, Chain(TASK_CID, INITIAL), 10)
    return book.decide(0.0, Elected(me), 0, set(arithmetics), can_roll_back=False,  # type: ignore[arg-type]
                       span_running=False, rounds_running=False, head_version=0, arithmetics=arithmetics,
                       took_part=took_part)


def test_the_kernel_sets_measured_to_agree_are_one_class_and_releases_stay_apart() -> None:
    assert bits_class(AVX512) == bits_class(AVX2) == AVX2
    assert bits_class(SCALAR) == SCALAR != bits_class(AVX2)
    assert bits_class(OTHER_RELEASE) != bits_class(AVX2)
    assert bits_class("torch 2.13.0 on NVIDIA H100 80GB HBM3") == "torch 2.13.0 on NVIDIA H100 80GB HBM3"
    assert bits_class(None) is None


def test_three_vectorized_and_one_scalar_plan_the_three() -> None:
    a, b, c, odd = _peers(4)
    arithmetics = {a: AVX2, b: AVX512, c: AVX2, odd: SCALAR}  # AVX-512 computes AVX2's bits
    plan = _decide(arithmetics, a)
    assert isinstance(plan, RoundPlan) and set(plan.members) == {a, b, c}
    classes = sort_classes(TASK_CID, odd, arithmetics)
    assert classes.left_out == {odd: SCALAR} and not classes.may_lead
    # Elected all the same (its view lagged), the scalar member neither plans nor holds the run.
    assert _decide(arithmetics, odd) is Hold.WAIT


def test_two_against_two_goes_to_the_class_of_the_lowest_ranked_peer_in_every_view() -> None:
    peers = _peers(4)
    vector, scalar = peers[:2], peers[2:]
    arithmetics = {**{p: AVX2 for p in vector}, **{p: SCALAR for p in scalar}}
    lowest = min(peers, key=lambda p: rank(TASK_CID, 0, p))
    winners, losers = (vector, scalar) if lowest in vector else (scalar, vector)
    views = {p: sort_classes(TASK_CID, p, arithmetics) for p in peers}
    assert {v.run for v in views.values()} == {arithmetics[lowest]}
    assert all(views[p].may_lead for p in winners) and not any(views[p].may_lead for p in losers)
    plan = _decide(arithmetics, winners[0])
    assert isinstance(plan, RoundPlan) and set(plan.members) == set(winners)
    assert _decide(arithmetics, losers[0]) is Hold.WAIT


def test_of_three_classes_the_largest_leads() -> None:
    one, other, *pair = _peers(4)
    arithmetics = {one: AVX2, other: OTHER_RELEASE, pair[0]: SCALAR, pair[1]: SCALAR}
    plan = _decide(arithmetics, pair[0])
    assert isinstance(plan, RoundPlan) and set(plan.members) == set(pair)
    assert _decide(arithmetics, one) is Hold.WAIT and _decide(arithmetics, other) is Hold.WAIT
    assert sort_classes(TASK_CID, pair[1], arithmetics).left_out == {one: AVX2, other: OTHER_RELEASE}


def test_a_peer_without_an_advertised_arithmetic_joins_no_fresh_run_of_known_ones() -> None:
    a, b, unknown = _peers(3)
    plan = _decide({a: AVX2, b: AVX2, unknown: None}, a)
    assert isinstance(plan, RoundPlan) and set(plan.members) == {a, b}
    assert sort_classes(TASK_CID, a, {a: AVX2, b: AVX2, unknown: None}).left_out == {unknown: None}


def test_a_fresh_run_s_first_plan_waits_a_while_for_arithmetics_not_known_yet() -> None:
    # A node advertises its arithmetic once its torch probe ran (~2 s after its start): a first plan
    # made before that left out peers that would have been members a second later.
    a, b, unknown = _peers(3)
    book = RoundBook(_task(), TASK_CID, Chain(TASK_CID, INITIAL), 10)
    book.note_elected(100.0)

    def decide(now: float, arithmetics: dict[str, str | None]) -> RoundPlan | Hold:
        return book.decide(now, Elected(a), 0, set(arithmetics), can_roll_back=False,  # type: ignore[arg-type]
                           span_running=False, rounds_running=False, head_version=0, arithmetics=arithmetics)

    assert decide(100.0 + FIRST_ROUND_GRACE_S + 1, {a: AVX2, b: AVX2, unknown: None}) is Hold.WAIT
    plan = decide(101.0 + FIRST_ROUND_GRACE_S, {a: AVX2, b: AVX2, unknown: AVX512})  # its probe ran
    assert isinstance(plan, RoundPlan) and set(plan.members) == {a, b, unknown}
    # An older node never says: it holds a fresh run up to ARITHMETIC_WAIT_S, once.
    book = RoundBook(_task(), TASK_CID, Chain(TASK_CID, INITIAL), 10)
    book.note_elected(100.0)
    assert decide(100.0 + ARITHMETIC_WAIT_S - 0.1, {a: AVX2, b: AVX2, unknown: None}) is Hold.WAIT
    plan = decide(100.0 + ARITHMETIC_WAIT_S, {a: AVX2, b: AVX2, unknown: None})
    assert isinstance(plan, RoundPlan) and set(plan.members) == {a, b}


def test_a_member_of_the_run_without_an_advertised_arithmetic_stays_planned() -> None:
    # Leaving it out of the next plan could cost the plan its quorum of the last plan's members;
    # if it computes other bits, its own check finds it (run/_attesting.py).
    a, b, unknown = _peers(3)
    classes = sort_classes(TASK_CID, a, {a: AVX2, b: AVX2, unknown: None}, history=(a, b, unknown))
    assert classes.planned == {a, b, unknown} and not classes.left_out


def test_nobody_advertising_an_arithmetic_plans_as_before() -> None:
    peers = _peers(3)
    arithmetics: dict[str, str | None] = dict.fromkeys(peers)
    plan = _decide(arithmetics, peers[0])
    assert isinstance(plan, RoundPlan) and set(plan.members) == set(peers)
    assert sort_classes(TASK_CID, peers[0], arithmetics).may_lead
    # ... and so does a node given no arithmetics at all (an older caller).
    book = RoundBook(_task(), TASK_CID, Chain(TASK_CID, INITIAL), 10)
    plan = book.decide(0.0, Elected(peers[0]), 0, set(peers), can_roll_back=False,  # type: ignore[arg-type]
                       span_running=False, rounds_running=False, head_version=0)
    assert isinstance(plan, RoundPlan) and set(plan.members) == set(peers)


def test_when_the_largest_class_is_short_of_peers_min_nobody_plans() -> None:
    a, b, odd = _peers(3)
    arithmetics = {a: AVX2, b: AVX2, odd: SCALAR}  # three members would reach peers.min, two do not
    task = _task(peers_min=3)
    assert _decide(arithmetics, a, task) is Hold.WAIT
    assert _decide(arithmetics, odd, task) is Hold.WAIT
    assert not sort_classes(TASK_CID, odd, arithmetics).may_lead


def test_the_run_s_history_keeps_its_class_against_a_larger_one() -> None:
    # A plan of two vectorized members was taken: three scalar peers arriving later cannot take the
    # run over (any plan of theirs would keep none of the last plan's members: a broken rule).
    x1, x2, *ys = _peers(5)
    arithmetics = {x1: AVX2, x2: AVX2, **{y: SCALAR for y in ys}}
    book = RoundBook(_task(), TASK_CID, Chain(TASK_CID, INITIAL), 10)
    first = _decide({x1: AVX2, x2: AVX2}, x1, book=book)
    assert isinstance(first, RoundPlan)
    assert book.plan_problem(first, x1, Elected(x1)) is None  # type: ignore[arg-type]
    classes = book.classes(x1, arithmetics)
    assert classes.run == AVX2 and classes.may_lead and set(classes.left_out) == set(ys)
    assert not book.classes(ys[0], arithmetics).may_lead


@pytest.mark.parametrize("lying", [AVX2, None])
def test_a_scalar_peer_advertising_a_vectorized_arithmetic_or_none_is_not_told_apart(lying: str | None) -> None:
    # Its own check at each confirmed checkpoint stays the defence (tests/runtime/test_mixed_arithmetic.py).
    a, b, liar = _peers(3)
    classes = sort_classes(TASK_CID, a, {a: AVX2, b: AVX2, liar: lying}, history=(a, b, liar))
    assert liar in classes.planned


def test_members_of_the_history_that_stop_advertising_still_decide_the_run_s_class() -> None:
    # The run's members finished (or load a checkpoint) and no longer advertise the task, but are
    # heard: a left-out scalar peer must not see the run turn scalar and itself planned or leading.
    x1, x2, y = _peers(3)
    classes = sort_classes(TASK_CID, y, {x1: AVX2, x2: AVX2, y: SCALAR}, history=(x1, x2), live={y})
    assert classes.run == AVX2 and not classes.may_lead and classes.left_out == {y: SCALAR}
    assert classes.planned == frozenset()


def test_a_fresh_run_counts_only_the_peers_that_took_part_and_itself() -> None:
    """Advertising costs nothing: three identities naming another arithmetic outnumbered two members
    and took a fresh run's class (neither member might then stand, so no vote was asked that would
    strike them). The census counts the live peers that took part, and the member itself."""
    a, b, *sybils = _peers(5)
    arithmetics = {a: AVX2, b: AVX512, **{s: OTHER_RELEASE for s in sybils}}
    assert sort_classes(TASK_CID, a, arithmetics).run == OTHER_RELEASE  # every advertiser counted
    alone = sort_classes(TASK_CID, a, arithmetics, took_part=())
    assert alone.run == AVX2 and alone.may_lead and set(alone.left_out) == set(sybils)
    voted = sort_classes(TASK_CID, b, arithmetics, took_part={a})
    assert voted.run == AVX2 and voted.may_lead and voted.planned == {a, b}
    # Peers that took part do count: two of another class that voted outnumber this member.
    assert not sort_classes(TASK_CID, a, arithmetics, took_part=sybils[:2]).may_lead
    # With a history, the history decides, whoever took part.
    assert sort_classes(TASK_CID, a, arithmetics, history=sybils, took_part={b}).run == OTHER_RELEASE
    plan = _decide(arithmetics, a, took_part=())
    assert isinstance(plan, RoundPlan) and set(plan.members) == {a, b}
