"""Which classes of arithmetic lose their claim to a fresh run (protocol/_class_claims.py): pure,
driven by terms, the class of each term's candidate and the run's class, no network and no clock.

The runtime attack (three Sybils of another arithmetic voting in every term of an open task took its
class: no step in 90 s on main) is tests/runtime/test_early_votes.py; here, the rule's own edges.
"""

from __future__ import annotations

from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain.protocol import ClassClaims, Election, signing, term_candidate
from p2ptrain.protocol._arithmetics import sort_classes
from p2ptrain.protocol._class_claims import LAPSE_TERMS, MAX_CLASSES
from p2ptrain.protocol._voters import View, designated

TASK_CID = "QmTaskClaims"
HONEST = "torch 2.13.0 on the CPU with AVX2 kernels"
FOREIGN = "torch 9.9.9 on the CPU with scalar kernels"
TERM_S = 3.0  # each term of these tests lasts a full election timeout unless a test says otherwise


def _fail_terms(claims: ClassClaims, n: int, candidate: str | None, claim: str | None, *, first: int = 1,
                fresh: bool = True) -> list[str | None]:
    """Tick through terms ``first`` .. ``first + n``, one election timeout each (each left once):
    what each tick returned."""
    return [claims.tick(term * TERM_S, term, candidate, claim, fresh) for term in range(first, first + n + 1)]


def test_a_class_whose_candidates_lead_nothing_lapses_after_lapse_terms_terms_and_yields():
    claims = ClassClaims()
    _fail_terms(claims, LAPSE_TERMS - 1, FOREIGN, FOREIGN)
    assert not claims.has_lapses
    claims = ClassClaims()
    out = _fail_terms(claims, LAPSE_TERMS, FOREIGN, FOREIGN)
    assert claims.has_lapses
    assert out == [None] * LAPSE_TERMS + [FOREIGN]  # the term left last made the lapse
    assert claims.lapses(FOREIGN) == 1 and claims.lapses(HONEST) == 0
    # The members' class could plan (2 live, peers.min 2): the Sybils' class is barred.
    assert claims.barred({FOREIGN: 3, HONEST: 2}, min_peers=2) == {FOREIGN}
    # ... and the census without its peers gives the run to the members' class.
    arithmetics = {"h1": HONEST, "h2": HONEST, "s1": FOREIGN, "s2": FOREIGN, "s3": FOREIGN}
    assert sort_classes(TASK_CID, "h1", arithmetics).run == FOREIGN  # what the Sybils' votes got them
    kept = {p: a for p, a in arithmetics.items() if a not in claims.barred({FOREIGN: 3, HONEST: 2}, 2)}
    assert sort_classes(TASK_CID, "h1", kept).run == HONEST


def test_terms_whose_candidate_is_of_another_class_or_the_same_term_again_do_not_count():
    """An honest pool of two classes: the smaller class's designated member does not stand (its
    class is not the run's), so its term fails; that says nothing of the larger class."""
    claims = ClassClaims()
    for term in range(1, 20):
        claims.tick(term * TERM_S, term, FOREIGN, HONEST, fresh=True)
    assert claims.lapses(HONEST) == 0 and claims.lapses(FOREIGN) == 0
    # Many ticks in one term are one failed term; a term whose candidate's class is unknown blames nobody.
    for i in range(10):
        claims.tick(30 * TERM_S + i * 0.25, 30, HONEST, HONEST, fresh=True)
    claims.tick(31 * TERM_S, 31, None, HONEST, fresh=True)
    claims.tick(32 * TERM_S, 32, None, HONEST, fresh=True)
    assert claims.lapses(HONEST) == 0
    assert claims.barred({HONEST: 3, FOREIGN: 2}, 2) == frozenset()
    assert _fail_terms(claims, LAPSE_TERMS - 1, HONEST, HONEST, first=40)[-1] == HONEST  # 1 + (LAPSE_TERMS - 1)


def test_terms_left_before_half_a_timeout_do_not_count():
    """Any peer moves the members to a later term by asking for votes in it: terms it pushes them
    through faster than half an election timeout cost the run's class nothing, however many."""
    claims = ClassClaims(min_term_s=TERM_S / 2)
    for term in range(1, 100):
        assert claims.tick(term * 0.5, term, HONEST, HONEST, fresh=True) is None
    assert claims.lapses(HONEST) == 0
    # Pushed on after most of a term (the first member whose term ran out asks in the next one):
    # that term counts at every member alike.
    for term in range(100, 100 + LAPSE_TERMS + 1):
        claims.tick(100 * 0.5 + (term - 100) * TERM_S * 0.6, term, HONEST, HONEST, fresh=True)
    assert claims.lapses(HONEST) == 1


def test_nothing_is_marked_once_the_run_has_a_history():
    claims = ClassClaims()
    assert _fail_terms(claims, 3 * LAPSE_TERMS, FOREIGN, FOREIGN, fresh=False) == [None] * (3 * LAPSE_TERMS + 1)
    assert claims.lapses(FOREIGN) == 0
    # A term left just as the first plan was taken (the run no longer fresh) is no failure either.
    claims.tick(50 * TERM_S, 50, FOREIGN, FOREIGN, fresh=True)
    claims.tick(51 * TERM_S, 51, FOREIGN, FOREIGN, fresh=False)
    assert claims.lapses(FOREIGN) == 0


def test_a_class_alone_or_beside_one_too_small_to_plan_is_never_barred():
    """Barring the only class would leave nobody to lead, and yielding to a class short of
    peers.min would stop the run for good (its coordinator waits for peers; no term fails again)."""
    claims = ClassClaims()
    _fail_terms(claims, 2 * LAPSE_TERMS, HONEST, HONEST)
    assert claims.lapses(HONEST) == 2
    assert claims.barred({HONEST: 3}, min_peers=2) == frozenset()
    assert claims.barred({HONEST: 3, FOREIGN: 1}, min_peers=3) == frozenset()
    assert claims.barred({HONEST: 1, FOREIGN: 1}, min_peers=3) == frozenset()  # none could plan: as before
    assert claims.barred({HONEST: 3, FOREIGN: 3}, min_peers=3) == {HONEST}


def test_the_claim_rotates_and_is_never_a_lock_out():
    """A class that yielded gets the claim back once the class it yielded to failed as often: an
    honest class wrongly barred (too loaded to win its terms) is not out of the run for good."""
    claims = ClassClaims()
    present = {HONEST: 3, FOREIGN: 3}
    _fail_terms(claims, LAPSE_TERMS, HONEST, HONEST, first=1)
    assert claims.barred(present, 2) == {HONEST}
    _fail_terms(claims, LAPSE_TERMS, FOREIGN, FOREIGN, first=10)
    assert claims.barred(present, 2) == frozenset()
    _fail_terms(claims, LAPSE_TERMS, FOREIGN, FOREIGN, first=20)
    assert claims.barred(present, 2) == {FOREIGN}


def test_sybils_minting_arithmetics_cost_lapse_terms_each_and_memory_is_bounded():
    claims = ClassClaims()
    term = 1
    for i in range(MAX_CLASSES + 10):
        fake = f"torch 9.9.{i} on the CPU with scalar kernels"
        lapsed = _fail_terms(claims, LAPSE_TERMS, fake, fake, first=term)
        assert lapsed[-1] == fake and claims.barred({fake: 3, HONEST: 2}, 2) == {fake}
        term += LAPSE_TERMS + 1
    assert claims.lapses("torch 9.9.0 on the CPU with scalar kernels") == 0  # the oldest forgotten


def test_a_terms_candidate_is_its_coordinator_else_the_designated_live_roster_member():
    keys = [create_new_key_pair() for _ in range(3)]
    ids = [signing.peer_str(k) for k in keys]
    election = Election(TASK_CID, keys[0])
    assert term_candidate(election) is None  # term 0: nobody stands
    election.tick(0.0, View(advertising=frozenset(ids)))
    election.resume_after(4)  # term 5, no coordinator
    election.tick(0.1, View(advertising=frozenset(ids)))
    assert election.term == 5 and election.coordinator is None
    assert term_candidate(election) == designated(TASK_CID, 5, ids)
    election.coordinator = ids[2]
    assert term_candidate(election) == ids[2]
