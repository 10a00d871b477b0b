"""Which classes of arithmetic lost their claim to a fresh run: pure, driven by terms and an injected clock.

A fresh run (no plan taken, no confirmed record) takes the class of most peers that took part in it
(:func:`~p2ptrain.protocol._arithmetics.sort_classes`), and a vote counts as taking part. A vote is
a signed message, as cheap as a heartbeat: in an open task three identities that advertised another
arithmetic and voted in every term took a new run's class from its two members (red team's H2).
Then neither member might stand, and no step was made for as long as they kept voting. Any census of
identities before a first plan loses to more identities; what a class cannot fake without training
is *planning*: only a coordinator of the run's class plans, and a plan is what ends the census (from
the first plan on, the plan's members decide the class). So a class keeps its claim only while its
peers lead:

- A term *fails its claim* when this member leaves it (moves to another term) while the run is still
  fresh, after it stayed in it at least ``min_term_s`` (half an election timeout), and the term's
  candidate (its accepted coordinator, else the designated candidate, :func:`term_candidate`) was of
  the class that held the claim. A term whose candidate was of another class does not count: that
  candidate does not stand (``Classes.may_lead``), and its silence says nothing of the class that
  holds the claim. So an honest pool of two classes, whose smaller class is designated in some
  terms, marks its larger class only for terms in which one of its own members was designated and
  yet no coordinator of it planned. A term left sooner does not count either: any peer can move the
  members to a later term by asking for votes in it, and a class must not lose its claim to terms
  it was not given the time to win. The time, not how the term ended, is what counts: the first
  member whose term runs out moves the others on with its request, and every member must count
  that term alike.
- Every :data:`LAPSE_TERMS` such terms are a *lapse* of the class. The claim goes, among the
  classes of the live peers that could plan (at least ``peers.min`` of them live), to those with
  the fewest lapses; the peers of a class with more lapses than that are *barred* (:meth:`barred`).
  So a class that failed its terms yields to the next class of the census, and gets the claim back
  only once that one has lapsed as often: a rotation, never a lock-out. A class alone never yields
  (there is nothing to fall back on: the run waits, as before), nor to a class too small to plan
  (that would stop the run: its coordinator would wait for ``peers.min`` for good, and no term
  would fail again to hand the claim back).
- While the run is fresh, barred peers count for nothing: not in the census, not as live peers, so
  neither as voters nor as candidates (RunState.advertising). Counting their votes would leave them
  a majority of the election's voters (three of five: no member of the run's class could win a
  term). Once a plan is taken bars no longer apply: the plan's members decide the class, and the
  roster is theirs.

Every member computes this from what all of them see: the terms (a term a member misses it does not
mark; members that hear each other move through the same terms, at about the same times), the
designated candidate (a hash of the task, the term and the live roster members, the same at members
with the same view), and the advertised arithmetics. None of it comes from the class being judged,
except by its not planning. Where two members' counts differ by a term (their views of the live
roster differed, so did their designated candidates), their rosters differ for that term by the
barred class's peers: more than the one member the election's safety argument covers
(docs/training.md, "Election"), as before any first plan whenever members see different live peers.
A member that has barred a class votes for none of its peers, so a second coordinator in that term
needs a majority of the larger roster among the members that have not barred it (and Sybils).

Trade-offs. A class of honest members whose designated candidates fail LAPSE_TERMS times before the
first plan (machines too loaded to win an election) yields the run to the next class that could
plan: the run trains with fewer members rather than not at all, and the left-out members wait as
those of any other class do. A party that can mint both identities and arithmetic strings (both
free) costs a fresh run LAPSE_TERMS failed terms per class it makes the largest, and each such class
needs more voting identities than the members' class has members. Identities of the run's own
arithmetic, or enough to elect a coordinator of their own that never plans (a majority of the
voters), or that take the members' votes of each term by asking first, are the open-task gap that
only an allowlist closes (docs/security.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from p2ptrain.protocol._election import Election
from p2ptrain.protocol._voters import designated

# Failed terms (see the module docstring) that make a lapse: two terms whose candidate was of the
# class that held the claim, and in which none of its peers planned. Only its own candidates' terms
# count, so against three Sybils beside two members ~4 terms pass (x2, x4, x8 longer from the third
# that fails): a fresh run's election simulated 200 times (tests/training/test_class_claims_election.py's
# pool, heartbeat 1 s) elected a member after 18 s (median), 54 s (p90), 150 s at most; with three,
# 30 s, 102 s, and 2 of 200 had none in 180 s. An honest class that is designated twice before the
# first plan and wins neither term (a machine too loaded) yields to the next class: not a stall.
LAPSE_TERMS = 2
# Classes remembered (their failed terms): an arithmetic is a free string, so an attacker could make
# a new one for each term. The oldest is forgotten; one that comes back starts afresh.
MAX_CLASSES = 64


def term_candidate(election: Election) -> str | None:
    """The peer that should lead ``election``'s current term: its accepted coordinator, else the
    designated candidate among the live roster members (None for term 0, in which nobody stands)."""
    if election.coordinator is not None:
        return election.coordinator
    return designated(election.task_cid, election.term, election.eligible()) if election.term > 0 else None


@dataclass
class ClassClaims:
    """One member's record of the terms each class failed to lead a fresh run in (see the module
    docstring): :meth:`tick` at every tick of the election, :meth:`barred` where the run counts peers."""

    # The least time in a term for it to count (half the default election timeout, 3 s).
    min_term_s: float = 1.5
    lapse_terms: int = LAPSE_TERMS
    _failed: dict[str, int] = field(default_factory=dict)  # failed terms per class (oldest first)
    _term: int = -1  # the term the last tick was in
    _since: float = 0.0  # when this member was first seen in it
    _blamed: str | None = None  # the claim's class if that term's candidate was of it

    def tick(self, now: float, term: int, candidate_class: str | None, claim: str | None, fresh: bool) -> str | None:
        """At ``now`` this member is in ``term``, whose candidate (:func:`term_candidate`) computes
        with ``candidate_class`` (:func:`~p2ptrain.protocol._arithmetics.bits_class`; None: unknown),
        while ``claim`` is the run's class as it sees it now (``Classes.run``, the bars applied);
        ``fresh``: the run has no history (no plan taken, no confirmed record). Returns the class
        whose lapses grew at this tick (to log), else None."""
        if term == self._term:
            self._blamed = claim if fresh and claim is not None and candidate_class == claim else None
            return None
        lapsed = None
        if fresh and self._blamed is not None and now - self._since >= self.min_term_s:
            blamed = self._blamed
            self._failed[blamed] = self._failed.pop(blamed, 0) + 1
            if self._failed[blamed] % self.lapse_terms == 0:
                lapsed = blamed
            while len(self._failed) > MAX_CLASSES:
                del self._failed[next(iter(self._failed))]
        self._term, self._since = term, now
        self._blamed = claim if fresh and claim is not None and candidate_class == claim else None
        return lapsed

    def lapses(self, cls: str) -> int:
        """How many times ``cls`` failed LAPSE_TERMS terms while it held the claim."""
        return self._failed.get(cls, 0) // self.lapse_terms

    @property
    def has_lapses(self) -> bool:
        """Whether any class lapsed yet: before, nothing is barred (and the run need not count classes)."""
        return any(n >= self.lapse_terms for n in self._failed.values())

    def barred(self, present: Mapping[str, int], min_peers: int) -> frozenset[str]:
        """Of the classes ``present`` (each with its number of live peers, this member counted),
        those whose peers count for nothing in a fresh run now: more lapses than the least of the
        classes that could plan (``min_peers`` live peers or more). None while no class could."""
        able = [self.lapses(c) for c, n in present.items() if n >= min_peers]
        if not able:
            return frozenset()
        least = min(able)
        return frozenset(c for c in present if self.lapses(c) > least)
