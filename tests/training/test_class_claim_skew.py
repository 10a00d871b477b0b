"""The one-term skew of ClassClaims' lapse counts between members before a fresh run's first plan
(protocol/_class_claims.py; docs/security.md, "Early voting Sybils"), played by a Sybil of another
arithmetic, in one process: real ClassClaims and Elections, time advanced explicitly, every vote
signed and checked. Red team h-attack5, item 3: what the skew gives the Sybils, and what it does not.

1. The Sybils can split the counts on purpose. A term counts against the claim's class when a member
   leaves it at least ``min_term_s`` after the tick that first saw it; the members tick on their own
   loops (a quarter heartbeat apart at most), and any peer moves them on by asking for votes in the
   next term. Asking between 5 and 6 ticks after a term of one of their own candidates began makes
   one member count it and another not, by their ticks' phases: two such terms, and one member
   bars the Sybils' class while the other still counts them.
2. With the counts split, one term has two voter sets, and two coordinators: the members that barred
   the Sybils elect one of their own among themselves, the one that did not is elected a Sybil by
   the Sybils' votes and its own (the Sybil asked it first). That member follows a coordinator that
   never plans for as long as the Sybils beat: it never leaves the term, so it never counts another.
3. But that is less than the same Sybils take with no skew: while their class is not barred, the
   Sybil that asks first gets the members' votes, and with them every member (the open-task gap
   docs/security.md names, "that take the members' vote in each term by asking for it first"). The
   skew needs the Sybils not to do that until their class lapsed, and then wins them one member.
"""

from __future__ import annotations

from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain.protocol import ClassClaims, Election, ElectionConfig, View, signing
from p2ptrain.wire import CoordinatorBeat, SignedVote, Vote, VoteRequest

TASK = "QmTaskClassClaimSkew"
CONFIG = ElectionConfig(heartbeat_s=1.0, timeout_beats=3)
MIN_TERM_S = CONFIG.timeout_s / 2  # as RunState wires it
TICK_S = 0.25  # run/_leading.py: a quarter heartbeat
SYBILS = "torch 9.9.9 on the CPU with scalar kernels"  # the Sybils' class, the census's largest


def test_a_sybil_timing_its_requests_splits_two_members_lapse_counts() -> None:
    """Two members tick 0.125 s apart (each every TICK_S, on its own loop). The Sybils ask for votes
    in a new term every 1.4 s: terms 1 and 2 are of their own designated candidate, term 3 is not.
    A term lasts 5 ticks for one member (1.25 s: not counted) and 6 for the other (1.5 s: counted),
    whichever phase comes first after the request; the Sybils need not know the phases, any length
    between 5 and 6 ticks splits some pairs of members."""
    pushes = [0.1, 1.5, 2.9, 10.0]  # when term 1, 2, 3 (and 4) begin: 1.4 s apart

    def term_at(t: float) -> int:
        return sum(1 for p in pushes if p <= t)

    counts = []
    for phase in (0.0, 0.125):
        claims = ClassClaims(min_term_s=MIN_TERM_S)
        t = phase
        while t < pushes[-1] + 1:
            term = term_at(t)
            claims.tick(t, term, SYBILS if term in (1, 2) else None, SYBILS, fresh=True)
            t += TICK_S
        counts.append(claims)
    first, second = counts
    assert first.lapses(SYBILS) == 0 and second.lapses(SYBILS) == 1
    present = {SYBILS: 3, "torch 2.13.0 on the CPU with AVX2 kernels": 2, "torch 2.13.0 on the CPU with VSX kernels": 2}
    assert first.barred(present, 2) == frozenset() and second.barred(present, 2) == {SYBILS}


class Split:
    """Four members (of two honest classes, two each) and three Sybils of a third, the census's
    largest: three of seven voters, no quorum alone. Members in ``barred`` no longer count the
    Sybils; the others do (their views of the live peers, RunState.advertising)."""

    def __init__(self, barred: set[int], seed: int = 0) -> None:
        keys = [create_new_key_pair(bytes([seed, i]) * 16) for i in range(7)]
        self.keys = dict(zip((signing.peer_str(k) for k in keys), keys))
        ids = list(self.keys)
        self.members, self.sybils = ids[:4], ids[4:]
        self.nodes = {p: Election(TASK, self.keys[p], CONFIG) for p in self.members}
        self.barred = {self.members[i] for i in barred}
        self.now = 0.0
        self.beat: CoordinatorBeat | None = None  # the Sybil coordinator's, once it has one
        self.accepted: dict[int, dict[str, str]] = {}  # term -> member -> the coordinator it accepted in it
        for me in self.members:
            self.tick(me)

    def live(self, me: str) -> frozenset[str]:
        return frozenset((set(self.members) if me in self.barred else set(self.members + self.sybils)) - {me})

    def tick(self, me: str) -> list:
        return self.nodes[me].tick(self.now, View(advertising=self.live(me)), ())

    def deliver(self, sender: str, msgs: list) -> None:
        queue = [(sender, m) for m in msgs]
        while queue:
            src, msg = queue.pop(0)
            for dst in self.members:
                if dst != src:
                    queue += [(dst, m) for m in self.nodes[dst].receive(self.now, src, msg)]

    def vote(self, voter: str, term: int, candidate: str) -> SignedVote:
        body = Vote(task_cid=TASK, term=term, candidate=candidate, voter=voter)
        return SignedVote(vote=body, signature=signing.sign(body, self.keys[voter]))

    def sybils_ask_first(self, term: int) -> None:
        """The first Sybil asks for votes in ``term``, every Sybil votes for it, and it beats with
        every vote it got (those members that counted the Sybils gave it theirs)."""
        s1 = self.sybils[0]
        got = [self.vote(s, term, s1) for s in self.sybils]
        for dst in self.members:
            for out in self.nodes[dst].receive(self.now, s1, VoteRequest(task_cid=TASK, term=term, candidate=s1)):
                if isinstance(out, SignedVote) and out.vote.candidate == s1:
                    got.append(out)
        self.beat = CoordinatorBeat(task_cid=TASK, term=term, coordinator=s1, votes=tuple(got))
        self.deliver(s1, [self.beat])

    def run(self, seconds: float) -> None:
        """The members' elections for ``seconds``, and the Sybils: whenever member 1 has no
        coordinator, they ask for votes in the term after its own before anyone else does (any
        peer's request moves the members on to a later term; only a voter's is answered), and the
        first of them beats every heartbeat as the coordinator of its term (it never plans)."""
        asked: set[int] = set()
        target = self.nodes[self.members[1]]
        end = self.now + seconds
        while self.now < end:
            self.now += TICK_S
            if target.coordinator is None and target.term + 1 not in asked:
                asked.add(target.term + 1)
                self.sybils_ask_first(target.term + 1)
            elif self.beat is not None and self.now % CONFIG.heartbeat_s < TICK_S:
                self.deliver(self.sybils[0], [self.beat])
            for me in self.members:
                self.deliver(me, self.tick(me))
                e = self.nodes[me]
                if e.coordinator is not None:
                    self.accepted.setdefault(e.term, {})[me] = e.coordinator

    def coordinators(self, term: int) -> dict[str, str | None]:
        return {p: (e.coordinator if e.term == term else None) for p, e in self.nodes.items()}


def test_with_the_counts_split_one_term_has_a_sybil_coordinator_at_the_lagging_member() -> None:
    split = Split(barred={0, 2, 3})  # member 1 counted one term fewer: it still counts the Sybils
    lagging, sybil = split.members[1], split.sybils[0]
    split.run(60.0)
    # The lagging member follows the Sybil (3 Sybil votes and its own: 4 of its 7 voters) for good;
    # the others elected one of their own (3 of their 4) in the same term, and follow it.
    final = {p: e.coordinator for p, e in split.nodes.items()}
    assert final[lagging] == sybil, final
    others = {final[p] for p in split.members if p != lagging}
    assert len(others) == 1 and others <= set(split.members), final
    two = {t: set(c.values()) for t, c in split.accepted.items() if len(set(c.values())) > 1}
    assert two and all(c == {sybil} | others for c in two.values()), split.accepted


def test_with_the_same_counts_everywhere_the_sybils_get_no_member_or_every_member() -> None:
    barred = Split(barred={0, 1, 2, 3})
    barred.run(60.0)
    chosen = {e.coordinator for e in barred.nodes.values()}
    assert len(chosen) == 1 and chosen <= set(barred.members), chosen
    assert all(len(set(c.values())) == 1 for c in barred.accepted.values()), barred.accepted
    # Not barred anywhere: the Sybil that asks first takes every member's vote and every member.
    counted = Split(barred=set())
    counted.run(60.0)
    assert {e.coordinator for e in counted.nodes.values()} == {counted.sybils[0]}
