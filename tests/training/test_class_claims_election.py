"""Early voting Sybils against a fresh run's election, in one process: two members' real elections,
their ClassClaims and census of arithmetics (wired as run/_leading.py and RunState.advertising wire
them), and three Sybils of another arithmetic that ask for votes and vote in the members' term,
every step. Time is advanced explicitly; every vote is signed and checked.

Without a class's claim lapsing (lapse_terms out of reach) the Sybils hold the run's class and no
coordinator is ever elected, as on main; with it both members bar the Sybils' class at the same
term and elect one of themselves, and no term has two coordinators.
"""

from __future__ import annotations

from collections import Counter

from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain.protocol import ClassClaims, Election, ElectionConfig, View, signing, term_candidate
from p2ptrain.protocol._arithmetics import sort_classes
from p2ptrain.protocol._class_claims import LAPSE_TERMS
from p2ptrain.wire import SignedVote, Vote, VoteRequest

TASK = "QmTaskEarlyVotes"
CONFIG = ElectionConfig(heartbeat_s=1.0, timeout_beats=3)
HONEST = "torch 2.13.0 on the CPU with AVX2 kernels"
FOREIGN = "torch 9.9.9 on the CPU with scalar kernels"
MIN_PEERS = 2
DT = 0.25


class Pool:
    """Two members and three Sybils; the members hear everyone, the Sybils read the members' term."""

    def __init__(self, lapse_terms: int = LAPSE_TERMS) -> None:
        self.keys = [create_new_key_pair() for _ in range(5)]
        ids = [signing.peer_str(k) for k in self.keys]
        self.honest, self.sybils = ids[:2], ids[2:]
        self.arithmetic = {p: HONEST for p in self.honest} | {p: FOREIGN for p in self.sybils}
        self.nodes = {p: Election(TASK, k, CONFIG) for p, k in zip(self.honest, self.keys)}
        self.claims = {p: ClassClaims(min_term_s=CONFIG.timeout_s / 2, lapse_terms=lapse_terms) for p in self.honest}
        self.now = 0.0
        self.accepted: dict[int, set[str]] = {}
        self.barred_at: dict[str, int] = {}  # member -> the term it first barred the Sybils' class in

    def live(self, me: str) -> set[str]:
        """RunState.advertising: the others (all took part: the Sybils vote), less barred classes."""
        others = set(self.honest + self.sybils) - {me}
        claims = self.claims[me]
        if not claims.has_lapses:
            return others
        barred = claims.barred(Counter(self.arithmetic[p] for p in others | {me}), MIN_PEERS)
        if barred and me not in self.barred_at:
            self.barred_at[me] = self.nodes[me].term
        return {p for p in others if self.arithmetic[p] not in barred}

    def step(self) -> None:
        self.now += DT
        for me, election in self.nodes.items():
            live = self.live(me)
            classes = sort_classes(TASK, me, {p: self.arithmetic[p] for p in live | {me}}, (), live | {me},
                                   took_part=live)
            out = election.tick(self.now, View(advertising=frozenset(live)), (), may_lead=classes.may_lead)
            candidate = term_candidate(election)
            self.claims[me].tick(self.now, election.term, self.arithmetic.get(candidate or ""), classes.run, fresh=True)
            self.deliver(me, out)
        term = max(e.term for e in self.nodes.values())
        if term > 0:  # the Sybils: the first asks for votes, all vote for it, in the members' term
            self.deliver(self.sybils[0], [VoteRequest(task_cid=TASK, term=term, candidate=self.sybils[0])])
            for voter, key in zip(self.sybils, self.keys[2:]):
                body = Vote(task_cid=TASK, term=term, candidate=self.sybils[0], voter=voter)
                self.deliver(voter, [SignedVote(vote=body, signature=signing.sign(body, key))])

    def deliver(self, sender: str, msgs: list) -> None:
        queue = [(sender, m) for m in msgs]
        while queue:
            src, msg = queue.pop(0)
            for dst in self.honest:
                if dst == src:
                    continue
                out = self.nodes[dst].receive(self.now, src, msg)
                e = self.nodes[dst]
                if e.coordinator is not None:
                    who = self.accepted.setdefault(e.term, set())
                    who.add(e.coordinator)
                    assert len(who) <= 1, f"term {e.term} has coordinators {who}"
                queue += [(dst, m) for m in out]

    def run_until_elected(self, seconds: float) -> str | None:
        end = self.now + seconds
        while self.now < end:
            self.step()
            chosen = {e.coordinator for e in self.nodes.values()}
            if len(chosen) == 1 and None not in chosen:
                return chosen.pop()
        return None


def test_without_lapses_the_sybils_hold_the_class_and_nobody_is_elected():
    pool = Pool(lapse_terms=10**9)
    assert pool.run_until_elected(180.0) is None
    assert all(e.term >= 8 for e in pool.nodes.values())  # terms kept failing


def test_the_sybils_class_lapses_at_the_same_term_at_both_members_and_a_member_is_elected():
    pool = Pool()
    coordinator = pool.run_until_elected(180.0)
    assert coordinator in pool.honest, (coordinator, [e.term for e in pool.nodes.values()])
    assert set(pool.barred_at) == set(pool.honest) and len(set(pool.barred_at.values())) == 1, pool.barred_at
    assert all(c.lapses(FOREIGN) == 1 and c.lapses(HONEST) == 0 for c in pool.claims.values())
