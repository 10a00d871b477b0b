"""A vote that reaches a coordinator after its election (the quorum came first) is taking part in
the term: pure simulations of three members, each an Election and a Participation ledger wired by
``receive_noting`` (as run/_leading.py wires them), time advanced explicitly, every vote signed
and checked, the links to one loaded member slow.

The loaded member's vote went into the coordinator's certificate, but its ledger noted only votes
heard while it had no coordinator: the loaded member was left out of its census (took_part), and
at the end of the vote request's answer time struck for not voting, by the very coordinator its
vote helped certify. Now such a vote counts when it comes within ``answer_s`` of the request (the
time any voter has); later, it is a vote at a time of its sender's choosing, and counts for nothing.
"""

from __future__ import annotations

from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain.protocol import Election, ElectionConfig, ElectionMessage, Participation, View, receive_noting, signing
from p2ptrain.protocol._voters import designated

from tests.protocol._books import over_links

CONFIG = ElectionConfig(heartbeat_s=1.0, timeout_beats=3)
ANSWER_S = 3.0
FAST_S, SLOW_S = 0.05, 1.0  # one way, between the two others / to or from the loaded member
KEYS = [create_new_key_pair(bytes([i + 7]) * 32) for i in range(3)]  # fixed: the same ranks every run
PEERS = [signing.peer_str(k) for k in KEYS]


def _setting() -> tuple[str, str, str, str]:
    """The task CID, and its term-1 candidate, the other fast member and the loaded one."""
    cid = "QmTaskLateVotes"
    candidate = designated(cid, 1, PEERS)
    fast, loaded = (p for p in PEERS if p != candidate)
    return cid, candidate, fast, loaded


class Member:
    def __init__(self, task_cid: str, key: object) -> None:
        self.election = Election(task_cid, key, CONFIG)  # type: ignore[arg-type]
        self.me = self.election.me
        self.ledger = Participation(answer_s=ANSWER_S)

    def tick(self, now: float) -> list[ElectionMessage]:
        live = self.ledger.counted(now, set(PEERS) - {self.me}) | {self.me}
        outs = self.election.tick(now, View(advertising=frozenset(live)))
        self.ledger.note_sent(now, self.me, outs)  # as run/_leading.py's tick
        return outs


def _simulate(seconds: float, loaded: str, slow_s: float = SLOW_S) -> dict[str, Member]:
    task_cid = _setting()[0]
    members = {m.me: m for m in (Member(task_cid, k) for k in KEYS)}
    over_links(members, seconds, lambda src, dst: slow_s if loaded in (src, dst) else FAST_S,
               lambda dst, now, src, msg: receive_noting(members[dst].election, members[dst].ledger, now, src, msg))
    return members


def test_a_vote_that_comes_after_the_election_takes_part_and_is_not_struck() -> None:
    """Fails on 6d977b5 (run/_leading.py noted no vote once elected): the coordinator's took_part
    lacks the loaded member, which it strikes at the end of the answer time."""
    _, candidate, fast, loaded = _setting()
    members = _simulate(ANSWER_S + 6.0, loaded)
    coordinator = members[candidate]
    assert coordinator.election.is_coordinator and coordinator.election.term == 1
    voters = {v.vote.voter for v in coordinator.election.certificate}
    assert voters == {candidate, fast, loaded}  # the loaded member's vote came, after the quorum
    now = ANSWER_S + 6.0
    assert coordinator.ledger.took_part(now) >= {fast, loaded}
    assert loaded not in coordinator.ledger.struck(now)


def test_a_late_vote_counts_only_within_the_answer_time_of_the_request() -> None:
    """The rule alone: a vote at a time its sender chose (long after any request) is free to send,
    and must not clear a strike or keep a peer that never trains counted."""
    ledger = Participation(answer_s=ANSWER_S)
    ledger.counted(9.0, ["slow", "silent"])  # both advertise the task
    ledger.note_asked(10.0, "me")
    ledger.note_late_vote(10.0 + ANSWER_S - 0.5, "slow")
    assert ledger.took_part(12.0) == {"slow"}
    ledger.counted(10.0 + ANSWER_S, ["slow", "silent"])  # the answer time ends: the silent one is struck
    ledger.note_late_vote(30.0, "silent")
    assert ledger.struck(30.0) == {"silent"} and ledger.took_part(30.0) == {"slow"}
    fresh = Participation(answer_s=ANSWER_S)
    fresh.note_late_vote(1.0, "unasked")  # no request heard or sent: nobody had a vote to give
    assert fresh.took_part(1.0) == frozenset()


def test_a_vote_that_comes_after_the_answer_time_clears_no_strike() -> None:
    """Red team h-attack7, through the wiring (``receive_noting``), not the rule alone: a vote that
    reaches the coordinator later than ``answer_s`` after its request (a link so slow that the round
    trip takes 4 s of the 3) counts for nothing: its voter is struck at the answer time's end (and,
    no voter of a fresh run's election once struck, its vote does not even enter the certificate)
    and stays so. A Sybil that times its vote gains nothing it would not have had voting in time."""
    _, candidate, fast, loaded = _setting()
    now = ANSWER_S + 6.0
    coordinator = _simulate(now, loaded, slow_s=2.0)[candidate]
    assert coordinator.election.is_coordinator and coordinator.election.term == 1
    assert {v.vote.voter for v in coordinator.election.certificate} == {candidate, fast}
    assert loaded in coordinator.ledger.struck(now) and loaded not in coordinator.ledger.took_part(now)
    assert fast in coordinator.ledger.took_part(now)
