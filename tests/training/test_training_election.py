"""Coordinator election, driven in one process through real signed wire bytes.

A small simulated network delivers every broadcast (encoded and decoded by the wire codec) to the
nodes that can hear the sender; time is advanced explicitly. After every delivery the test checks
the safety property: no two nodes ever accept different coordinators for the same term.
"""

import hashlib
import os
import random

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain.protocol import Election, ElectionConfig, View, signing
from p2ptrain.protocol._election import designated
from p2ptrain.wire import CoordinatorBeat, SignedVote, Vote, VoteRequest, decode, encode

TASK = "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o"
HB = 1.0
CONFIG = ElectionConfig(heartbeat_s=HB, timeout_beats=3)


def seeded_keys(n, seed):
    """``n`` key pairs that are the same at every run for one ``seed`` (so are the peer ids and with
    them every term's candidate order): a failure found with a seed replays exactly."""
    return [create_new_key_pair(hashlib.sha256(f"election-{seed}-{i}".encode()).digest()) for i in range(n)]


class Net:
    def __init__(self, n, seed=0, drop=0.0, key_seed=None, wire=True, max_members=None):
        self.keys = [create_new_key_pair() for _ in range(n)] if key_seed is None else seeded_keys(n, key_seed)
        self.ids = [signing.peer_str(k) for k in self.keys]
        self.nodes = {p: Election(TASK, k, CONFIG, max_members=max_members) for p, k in zip(self.ids, self.keys)}
        self.alive = set(self.ids)
        self.groups = [set(self.ids)]  # partitions: a node hears only its own group
        self.roster = tuple(self.ids)
        self.now = 0.0
        self.seq = 0
        self.rng = random.Random(seed)
        self.drop = drop
        # Whether messages travel as signed wire bytes (encoded, decoded) or as the objects (the
        # election still signs and checks every vote): the seed sweep's runs take half the time.
        self.wire = wire
        self.accepted: dict[int, set[str]] = {}
        self.muted: set[str] = set()  # alive in everyone's view, but silent and deaf
        # Heard by the mesh but not at the run's state (resyncing): not advertising, may not lead.
        self.unsynced: set[str] = set()
        self.gone: dict[str, set[str]] = {}  # peer -> peers its rounds found unreachable
        self.connections = False  # whether nodes tell the election which connections are open
        self.disconnected: set[str] = set()  # peers nobody holds a connection to
        self.sent: list[tuple[str, object]] = []  # every broadcast, in order
        self.given_up: list[tuple[str, str]] = []  # (node, the coordinator its tick gave up on)

    def group_of(self, p):
        return next(g for g in self.groups if p in g)

    def view(self, p):
        return {q for q in self.group_of(p) if q in self.alive}

    def view_of(self, p):
        """What node ``p`` hands its election: the mesh hears its group's live peers."""
        seen = frozenset(self.view(p) - {p})
        return View(heard=seen, advertising=seen - self.unsynced, gone=frozenset(self.gone.get(p, ())),
                    connected=seen - self.disconnected if self.connections else None)

    def broadcast(self, sender, msgs):
        if sender in self.muted:
            return
        queue = [(sender, m) for m in msgs]
        while queue:
            src, msg = queue.pop(0)
            self.sent.append((src, msg))
            self.seq += 1
            if self.wire:  # decoded once: every copy is the same bytes
                got = decode(encode(msg, self.keys[self.ids.index(src)], self.seq))
                src, msg = got.sender.to_base58(), got.msg
            for dst in sorted(self.view(src) - {src} - self.muted):
                if self.drop and self.rng.random() < self.drop:
                    continue
                out = self.nodes[dst].receive(self.now, src, msg)
                self.check(dst)
                queue += [(dst, m) for m in out]

    def check(self, p):
        """Note whom node ``p`` (whose state just changed) accepts: no term may ever have two."""
        e = self.nodes[p]
        if e.coordinator is not None:
            who = self.accepted.setdefault(e.term, set())
            who.add(e.coordinator)
            assert len(who) <= 1, f"term {e.term} has coordinators {who}"

    def run(self, seconds, dt=0.25):
        end = self.now + seconds
        while self.now < end - 1e-9:
            self.now += dt
            for p in sorted(self.alive - self.muted):
                out = self.nodes[p].tick(self.now, self.view_of(p), self.roster, may_lead=p not in self.unsynced)
                if self.nodes[p].given_up is not None:
                    self.given_up.append((p, self.nodes[p].given_up))
                self.check(p)
                self.broadcast(p, out)

    def restart(self, p):
        """Restart node ``p``: a fresh Election, given what the node persisted (voted_through), as
        RunState.create does after a restart."""
        key = self.keys[self.ids.index(p)]
        self.nodes[p] = Election(TASK, key, CONFIG, voted_through=self.nodes[p].voted_through)

    def run_until_agreed(self, seconds):
        """Run until every live node accepts one coordinator (or ``seconds`` pass); the agreement."""
        end = self.now + seconds
        while self.agreed() is None and self.now < end:
            self.run(HB)
        return self.agreed()

    def leading(self):
        """Whether some live node leads now (as a coordinator, it sees a quorum of its roster): only
        such a node plans, so only then can a plan admit a member."""
        return any(self.nodes[p].is_coordinator for p in self.alive - self.muted)

    def coordinators(self, among=None):
        """The (term, coordinator) each live node accepts."""
        return {p: (self.nodes[p].term, self.nodes[p].coordinator) for p in (among or self.alive)}

    def agreed(self, among=None):
        views = set(self.coordinators(among).values())
        if len(views) == 1:
            (term, coordinator), = views
            if coordinator is not None:
                return term, coordinator
        return None


def test_first_election_is_quick_and_deterministic():
    net = Net(4)
    net.run(CONFIG.timeout_s + 2 * HB)
    term, coordinator = net.agreed()
    assert term == 1 and coordinator == designated(TASK, 1, net.ids)
    assert net.nodes[coordinator].is_coordinator


def test_a_fresh_run_ends_term_0_once_peers_max_members_are_alive_and_only_then():
    """Before the first plan (no roster: the live members vote) nobody stands in term 0, so that the
    first members hear each other; once the task's peers.max are alive, no one else can be in the
    first roster and term 1 starts at the next tick instead of after the term's timeout."""
    full = Net(3, max_members=3)
    full.roster = ()
    full.run(2 * HB)  # a heartbeat for the views to form (a member not yet ticked votes for nobody), one to elect
    assert 2 * HB < CONFIG.timeout_s
    term, coordinator = full.agreed()
    assert term == 1 and coordinator == designated(TASK, 1, full.ids)
    # One member short of peers.max: term 0 runs its whole timeout, as before.
    short = Net(3, max_members=4)
    short.roster = ()
    short.run(CONFIG.timeout_s - HB / 2)
    assert all(e.term == 0 and e.coordinator is None for e in short.nodes.values())
    short.run(2 * HB)
    assert short.agreed() == (1, designated(TASK, 1, short.ids))
    # Members that do not all hear each other yet (a view of 2 of the 3) wait out term 0 too.
    partial = Net(3, max_members=3)
    partial.roster = ()
    partial.groups = [{partial.ids[0]}, set(partial.ids[1:])]
    partial.run(CONFIG.timeout_s - HB / 2)
    assert all(e.term == 0 for e in partial.nodes.values())


def test_coordinator_death_elects_another_within_a_few_heartbeats():
    net = Net(4)
    net.run(6)
    term, old = net.agreed()
    net.alive.discard(old)  # killed: the mesh has dropped it from the live view
    net.run(2 * HB)  # no need to wait for our own timeout: the mesh already says it is gone
    new_term, new = net.agreed()
    assert new != old and new_term > term


def test_hung_coordinator_still_in_the_live_view_is_replaced():
    net = Net(4)
    net.run(6)
    term, old = net.agreed()
    net.muted.add(old)  # hung, not dead: the mesh still lists it, but it sends and hears nothing
    net.run(CONFIG.timeout_s + 3 * HB)
    new_term, new = net.agreed(set(net.ids) - {old})
    assert new != old and new_term > term
    assert old in net.nodes[new].suspects


def test_split_halves_elect_nobody_and_wait_then_converge():
    net = Net(4)
    a, b, c, d = net.ids
    net.groups = [{a, b}, {c, d}]  # two halves of a four-member roster: no side has a quorum (3)
    net.run(4 * CONFIG.timeout_s)
    assert all(coordinator is None for _, coordinator in net.coordinators().values())
    # Neither half can win a term, so neither churns through terms: each waits for one more peer.
    assert max(e.term for e in net.nodes.values()) == 0
    assert {e.short_of_quorum for e in net.nodes.values()} == {1}
    net.groups = [set(net.ids)]
    net.run(3 * CONFIG.timeout_s)
    assert net.agreed() is not None


def test_minority_coordinator_steps_down_and_old_terms_are_ignored():
    net = Net(5)
    net.run(6)
    term, old = net.agreed()
    rest = set(net.ids) - {old}
    buddy = sorted(rest)[0]
    net.groups = [{old, buddy}, rest - {buddy}]  # old coordinator cut off with one follower
    net.run(3 * CONFIG.timeout_s)
    majority = net.agreed(rest - {buddy})
    assert majority is not None and majority[0] > term and majority[1] != old
    assert not net.nodes[old].is_coordinator  # no quorum of its roster in sight: stepped down
    # A beat of the old term, replayed to a follower of the new term, changes nothing.
    follower = sorted(rest - {buddy} - {majority[1]})[0]
    stale = CoordinatorBeat(task_cid=TASK, term=term, coordinator=old, votes=())
    assert net.nodes[follower].receive(net.now, old, stale) == []
    assert net.nodes[follower].coordinator == majority[1]
    net.groups = [set(net.ids)]
    net.run(3 * HB)
    assert net.agreed() == majority  # healed without another election


def test_rejoining_peer_follows_without_disrupting():
    net = Net(4)
    net.run(6)
    term, coordinator = net.agreed()
    loner = next(p for p in net.ids if p != coordinator)
    net.groups = [{loner}, set(net.ids) - {loner}]
    net.run(5 * CONFIG.timeout_s)  # alone, its term runs ahead; the others keep their term
    assert net.nodes[loner].term > term and net.nodes[loner].coordinator is None
    assert net.agreed(set(net.ids) - {loner}) == (term, coordinator)
    net.groups = [set(net.ids)]
    net.run(2 * HB)
    assert net.agreed() == (term, coordinator)
    # A restarted peer (fresh state) also just follows.
    net.restart(loner)
    net.run(2 * HB)
    assert net.agreed() == (term, coordinator)


def test_forged_or_short_certificates_are_refused():
    net = Net(4)
    a, b, c, d = net.ids
    follower = net.nodes[d]
    follower.tick(0.0, View(advertising=frozenset({a, b, c})), net.roster)

    def vote(key, candidate, term=1):
        body = Vote(task_cid=TASK, term=term, candidate=candidate, voter=signing.peer_str(key))
        return SignedVote(vote=body, signature=signing.sign(body, key))

    short = CoordinatorBeat(task_cid=TASK, term=1, coordinator=a, votes=(vote(net.keys[0], a), vote(net.keys[1], a)))
    assert "quorum is 3" in follower.check_certificate(short)
    doubled = CoordinatorBeat(task_cid=TASK, term=1, coordinator=a, votes=short.votes + short.votes)
    assert "quorum is 3" in follower.check_certificate(doubled)
    outsider = create_new_key_pair()
    padded = CoordinatorBeat(task_cid=TASK, term=1, coordinator=a, votes=short.votes + (vote(outsider, a),))
    assert "quorum is 3" in follower.check_certificate(padded)
    forged_sig = SignedVote(vote=vote(net.keys[2], a).vote, signature=vote(net.keys[1], a).signature)
    forged = CoordinatorBeat(task_cid=TASK, term=1, coordinator=a, votes=short.votes + (forged_sig,))
    assert "bad signature" in follower.check_certificate(forged)
    other_term = CoordinatorBeat(task_cid=TASK, term=1, coordinator=a, votes=short.votes + (vote(net.keys[2], a, 2),))
    assert "another election" in follower.check_certificate(other_term)
    for beat in (short, padded, forged, other_term):
        follower.receive(1.0, a, beat)
        assert follower.coordinator is None
    good = CoordinatorBeat(task_cid=TASK, term=1, coordinator=a, votes=short.votes + (vote(net.keys[2], a),))
    follower.receive(1.0, b, good)  # relayed by someone else: the coordinator must send its own beat
    assert follower.coordinator is None
    follower.receive(1.0, a, good)
    assert follower.coordinator == a and follower.term == 1


def test_one_vote_per_term():
    net = Net(3)
    a, b, c = net.ids
    voter = net.nodes[c]
    voter.tick(0.0, View(advertising=frozenset({a, b})), net.roster)
    first = voter.receive(0.1, a, VoteRequest(task_cid=TASK, term=1, candidate=a))
    assert [m.vote.candidate for m in first] == [a]
    assert voter.receive(0.2, b, VoteRequest(task_cid=TASK, term=1, candidate=b)) == []
    again = voter.receive(0.3, a, VoteRequest(task_cid=TASK, term=1, candidate=a))  # lost vote resent
    assert [m.vote.candidate for m in again] == [a]
    assert voter.receive(0.4, c, VoteRequest(task_cid=TASK, term=1, candidate=b)) == []  # sender != candidate


def test_a_restarted_member_never_votes_again_in_a_term_it_voted_in():
    """One vote per term must hold across restarts (Raft persists its vote for this). Three
    members; the one that would be term 1's candidate with all three in view is cut off, so the
    other two elect one of themselves in term 1, 2 votes of 3. That coordinator restarts, its voter
    dies, the cut heals: the restarted member and the cut-off one both reach term 1, whose candidate
    the cut-off one is. Before the node persisted voted_through, the restarted member voted for it,
    and term 1 elected a second coordinator."""
    net = Net(3, key_seed=0)
    late = designated(TASK, 1, net.ids)
    net.groups = [{late}, set(net.ids) - {late}]
    net.run(CONFIG.timeout_s + 2 * HB)
    term, first = net.agreed(set(net.ids) - {late})
    assert term == 1 and net.nodes[late].term == 0  # alone, short of a quorum: it waits in term 0
    voter = next(p for p in net.ids if p not in (late, first))
    net.alive.discard(voter)
    net.restart(first)
    net.groups = [set(net.ids)]
    term, second = net.run_until_agreed(6 * CONFIG.timeout_s)  # net.check: never two in a term
    assert term > 1
    assert not [m for p, m in net.sent if p == first and isinstance(m, SignedVote) and m.vote.term == 1
                and m.vote.candidate != first]


def test_a_member_that_cannot_tell_where_it_voted_votes_nowhere_but_follows():
    """Election(voted_through=None) (its ballots file was damaged): it asks for no vote and casts
    none, in any term, yet the others elect a coordinator that it follows."""
    net = Net(3, key_seed=2)
    blind = net.ids[0]
    net.nodes[blind] = Election(TASK, net.keys[0], CONFIG, voted_through=None)
    term, coordinator = net.run_until_agreed(6 * CONFIG.timeout_s)
    assert coordinator != blind
    assert not [m for p, m in net.sent if p == blind and isinstance(m, (SignedVote, VoteRequest))]
    net.alive.discard(coordinator)  # the next election needs both of the others: it cannot be won
    net.run(4 * CONFIG.timeout_s)
    assert all(e.coordinator is None for p, e in net.nodes.items() if p != coordinator)
    assert not [m for p, m in net.sent if p == blind and isinstance(m, (SignedVote, VoteRequest))]


def test_a_request_set_aside_is_not_answered_in_a_term_already_voted_in():
    # A member whose term ran ahead votes in an earlier term (4), then follows a coordinator of an
    # even earlier one (3) and sets aside a request of term 4 from another candidate. Giving that
    # coordinator up, it enters term 4 again: it must not vote there a second time.
    keys = seeded_keys(4, 1)
    ids = [signing.peer_str(k) for k in keys]
    m, x, y, z = ids
    member = Election(TASK, keys[0], CONFIG)
    member.tick(0.0, View(advertising=frozenset(ids[1:])), ids)
    member._new_term(0.0, 5)
    assert [v.vote.candidate for v in member.receive(0.1, z, VoteRequest(task_cid=TASK, term=4, candidate=z))] == [z]
    votes = []
    for key in keys[1:]:
        body = Vote(task_cid=TASK, term=3, candidate=x, voter=signing.peer_str(key))
        votes.append(SignedVote(vote=body, signature=signing.sign(body, key)))
    member.receive(0.2, x, CoordinatorBeat(task_cid=TASK, term=3, coordinator=x, votes=tuple(votes)))
    assert (member.term, member.coordinator) == (3, x)
    assert member.receive(0.3, y, VoteRequest(task_cid=TASK, term=4, candidate=y)) == []  # set aside
    out = member.tick(0.2 + CONFIG.timeout_s, View(advertising=frozenset(ids[1:])), ids)  # x silent
    assert member.term == 4 and member.voted_for == z
    assert not [msg for msg in out if isinstance(msg, SignedVote)]


def random_failures(seed, grow, wire=False):
    """Twelve random events (kills, restarts, partitions, heals, admissions when ``grow``) with 10%
    message loss, then a healed network with a quorum up: ``net.check`` asserts after every delivery
    that no term has two coordinators, and in the end the live nodes must agree on one. The seed
    picks the keys (so the peer ids and every term's candidate order) and the events; ``wire``: whether
    messages travel as wire bytes (the sweep hands the objects over: the same runs in a third of the time)."""
    net = Net(5, seed=seed, drop=0.1, key_seed=seed, wire=wire)
    if grow:  # the roster starts with three members and grows as plans admit the others
        net.roster = tuple(net.ids[:3])
    rng = random.Random(seed)
    for _ in range(12):
        event = rng.choice(["kill", "revive", "partition", "heal", "nothing"] + (["admit"] if grow else []))
        if event == "admit" and len(net.roster) < 5 and net.leading():
            net.roster = tuple(net.ids[: len(net.roster) + 1])
        elif event == "kill" and len(net.alive) > 3:
            net.alive.discard(rng.choice(sorted(net.alive)))
        elif event == "revive":
            dead = sorted(set(net.ids) - net.alive)
            if dead:
                p = rng.choice(dead)
                net.alive.add(p)
                net.restart(p)
        elif event == "partition":
            cut = set(rng.sample(net.ids, rng.randint(1, 2)))
            net.groups = [cut, set(net.ids) - cut]
        elif event == "heal":
            net.groups = [set(net.ids)]
        net.run(rng.choice([1.0, 2.5, 5.0]))
    net.groups = [set(net.ids)]
    net.alive = set(net.ids[:3]) | (net.alive & set(net.ids[3:]))  # a quorum of the roster is up
    net.drop = 0.0
    net.run(6 * CONFIG.timeout_s)
    assert net.agreed() is not None, "no agreement on a coordinator"


# Seeds per kind in the sweep below: 40 keep this file fast (about 2 s); the full sweep is
# P2PTRAIN_ELECTION_SEEDS=1000 (1.5-2.5 min on the shared 2-core machine). Before voted_through,
# 5 of 1000 runs with joiners elected two coordinators in one term (the seeds replayed next).
RANDOM_SEEDS = int(os.environ.get("P2PTRAIN_ELECTION_SEEDS", "40"))


@pytest.mark.parametrize("seed", [60, 610, 806, 948, 966])
def test_random_failures_that_once_gave_two_coordinators_per_term(seed):
    """The seeds of 1000 that failed before voted_through (all with joiners admitted: a restarted
    member voted again in term 1 or 2), replayed through real wire bytes."""
    random_failures(seed, grow=True, wire=True)


@pytest.mark.parametrize("grow", [False, True], ids=["fixed roster", "joiners admitted"])
def test_random_failures_never_give_two_coordinators_per_term(grow):
    for seed in range(RANDOM_SEEDS):
        try:
            random_failures(seed, grow)
        except AssertionError as exc:
            raise AssertionError(f"seed {seed}: {exc}") from None


def test_largest_certificate_fits_the_wire():
    """A task admits at most task.MAX_PEERS members; a heartbeat with all their votes must encode."""
    from p2ptrain.task._spec import MAX_PEERS

    keys = [create_new_key_pair() for _ in range(MAX_PEERS)]
    candidate = signing.peer_str(keys[0])
    votes = []
    for key in keys:
        body = Vote(task_cid=TASK, term=7, candidate=candidate, voter=signing.peer_str(key))
        votes.append(SignedVote(vote=body, signature=signing.sign(body, key)))
    beat = CoordinatorBeat(task_cid=TASK, term=7, coordinator=candidate, votes=tuple(votes))
    got = decode(encode(beat, keys[0], 1)).msg
    assert got == beat
    judge = Election(TASK, keys[1], CONFIG)
    judge.tick(0.0, View(advertising=frozenset({signing.peer_str(k) for k in keys[2:]} | {candidate})),
               [signing.peer_str(k) for k in keys])
    assert judge.check_certificate(got) is None


def test_a_joiner_is_admitted_without_an_election_when_every_vote_was_kept():
    # Three members elect; the coordinator wins at two votes but keeps the third, so admitting a
    # fourth member (quorum 3 of 4) needs no new term.
    net = Net(4)
    net.roster = tuple(net.ids[:3])
    net.run(6)
    term, coordinator = net.agreed()
    assert len(net.nodes[coordinator]._beat().votes) == 3
    net.roster = tuple(net.ids)
    net.run(2 * HB)
    assert net.agreed() == (term, coordinator)


def test_a_coordinator_whose_votes_no_longer_cover_the_roster_renews_them_at_once():
    net = Net(7)
    net.roster = tuple(net.ids[:3])
    net.run(6)
    term, coordinator = net.agreed(set(net.ids[:3]))
    net.roster = tuple(net.ids)  # four joiners: three votes are not a quorum of seven
    net.run(0.5)  # not a heartbeat timeout: its followers vote for it although their term works
    assert net.agreed() == (term + 1, coordinator)
    assert net.nodes[coordinator].check_certificate(net.nodes[coordinator]._beat()) is None


def test_a_coordinator_that_steps_down_does_not_stand_in_the_next_term():
    # Its state fell behind the run: the others will suspect it, so a vote for itself would only
    # split the term.
    for _ in range(100):
        net = Net(4)
        net.run(6)
        term, old = net.agreed()
        if designated(TASK, term + 1, net.ids) == old:  # it would be the next term's candidate
            break
    e = net.nodes[old]
    e.step_down(net.now)
    net.run(2.0)  # the others still hear nothing wrong for a while (timeout is 3 s)
    assert not e.is_coordinator and e.term == term + 1 and e.voted_for is None
    net.run(2 * CONFIG.timeout_s)
    new_term, new = net.agreed()
    assert new_term > term and new != old


def test_a_member_whose_term_ran_ahead_still_votes_once_in_a_recent_one():
    keys = [create_new_key_pair() for _ in range(3)]
    a, b, c = (Election(TASK, k, CONFIG) for k in keys)
    ids = [signing.peer_str(k) for k in keys]
    roster = tuple(ids)
    for e in (a, b, c):
        e.tick(0.0, View(advertising=frozenset(set(ids) - {e.me})), roster)
    a._new_term(0.0, 5)  # its own clock moved it on; it has voted in none of these terms
    out = a.receive(0.1, ids[1], VoteRequest(task_cid=TASK, term=4, candidate=ids[1]))
    assert [(m.vote.term, m.vote.candidate) for m in out] == [(4, ids[1])]
    assert a.term == 5  # it stays where it is
    assert a.receive(0.2, ids[2], VoteRequest(task_cid=TASK, term=4, candidate=ids[2])) == []  # once per term
    assert a.receive(0.3, ids[2], VoteRequest(task_cid=TASK, term=2, candidate=ids[2])) == []  # too old


def test_a_request_that_came_while_the_coordinator_looked_alive_is_answered_once_it_is_gone():
    # The designated candidate saw the coordinator die a moment before the others (its round with
    # it failed first): they still followed the coordinator and set the request aside. When they
    # see the death too, they vote at once instead of waiting for the candidate's next request.
    net = Net(4)
    net.run(6)
    term, old = net.agreed()
    others = [p for p in net.ids if p != old]
    candidate = designated(TASK, term + 1, others)
    base_view = net.view
    net.view = lambda p: base_view(p) - ({old} if p == candidate else set())
    net.muted.add(old)  # dead, but only the candidate knows yet
    net.run(0.25)
    assert net.nodes[candidate].term == term + 1 and net.nodes[candidate].coordinator is None
    assert all(net.nodes[p].coordinator == old for p in others if p != candidate)
    net.alive.discard(old)  # now everyone does
    net.run(0.25)  # one tick, far less than the candidate's next request (a heartbeat)
    assert net.agreed() == (term + 1, candidate)


# --- liveness and standing (what the node's view says; protocol/_voters.py) ----------------------


def test_a_dead_coordinator_with_no_connection_is_given_up_after_one_and_a_half_beats():
    # Dead between rounds: the mesh still lists it (it drops a peer only after 5 s) and nothing
    # else tells the members, but nobody holds a connection to it any more. Waiting for the beat
    # timeout (3 s) cost 3 s without rounds; 1.5 beats and no connection is enough.
    net = Net(4)
    net.connections = True
    net.run(6)
    term, old = net.agreed()
    net.muted.add(old)
    net.disconnected.add(old)
    net.run(CONFIG.unconnected_silent_beats * HB + 2 * 0.25)
    others = set(net.ids) - {old}
    new_term, new = net.agreed(others)
    assert new != old and new_term > term
    assert {p for p, gave_up in net.given_up if gave_up == old} == others


def test_a_silent_coordinator_still_connected_keeps_the_full_timeout():
    # Only both together count: a coordinator we are still connected to may be slow, not dead.
    net = Net(4)
    net.connections = True
    net.run(6)
    term, old = net.agreed()
    net.muted.add(old)
    net.run(CONFIG.unconnected_silent_beats * HB + 2 * 0.25)
    assert net.agreed(set(net.ids) - {old}) == (term, old)
    assert net.given_up == []


def test_a_resyncing_roster_member_is_still_a_voter():
    # Two of three roster members resync (heard, not advertising the task): they still count for
    # the coordinator's quorum and still vote, so the one member at the run's state leads.
    net = Net(3)
    leader = net.ids[0]
    net.unsynced = set(net.ids[1:])
    # Terms whose candidate resyncs pass without a coordinator (each is the leader's with odds 1/3):
    # within 40 timeouts that failed 3 runs in 100 (random identities), within 160 none in 1,000.
    term, coordinator = net.run_until_agreed(160 * CONFIG.timeout_s)
    assert coordinator == leader
    assert len(net.nodes[leader]._beat().votes) >= 2
    net.run(4 * CONFIG.timeout_s)
    assert net.agreed() == (term, leader)  # and it does not step down for want of live voters


def test_a_member_not_at_the_runs_state_never_stands():
    net = Net(4)
    behind = designated(TASK, 1, net.ids)  # the first term's candidate
    net.unsynced = {behind}
    term, coordinator = net.run_until_agreed(40 * CONFIG.timeout_s)
    assert coordinator != behind
    assert not [m for p, m in net.sent if p == behind and isinstance(m, (VoteRequest, CoordinatorBeat))]
    assert net.nodes[behind].voted_for == coordinator  # it still votes


def test_a_member_not_at_the_runs_state_steps_down():
    net = Net(3)
    net.run(6)
    term, old = net.agreed()
    net.unsynced = {old}
    net.run(CONFIG.timeout_s + 4 * HB)
    new_term, new = net.agreed()
    assert new != old and new_term > term and not net.nodes[old].is_coordinator


def test_a_peer_a_round_found_gone_is_not_voted_for():
    net = Net(4)
    gone = designated(TASK, 1, net.ids)  # it would be the first term's candidate
    for p in net.ids:
        if p != gone:
            net.gone[p] = {gone}  # their rounds found it unreachable; it still runs and stands
    net.run(3 * CONFIG.timeout_s)
    assert not [m for p, m in net.sent if isinstance(m, SignedVote) and m.vote.candidate == gone and p != gone]
    term, coordinator = net.agreed(set(net.ids) - {gone})
    assert coordinator != gone


def test_a_lone_member_below_a_quorum_waits_instead_of_cycling_through_terms():
    """A two-member run after one member stopped: the other cannot win any term (a quorum of its
    roster is 2), so it neither stands nor moves term after term; it says it waits for one more peer.
    When the peer is back, one election settles it."""
    net = Net(2)
    term, coordinator = net.run_until_agreed(4 * CONFIG.timeout_s)
    gone = next(p for p in net.ids if p != coordinator)
    for stopped in (gone, coordinator):  # a follower left alone, and a coordinator left alone
        lone = next(p for p in net.ids if p != stopped)
        net.alive.discard(stopped)
        net.run(2 * CONFIG.timeout_s)  # gives its coordinator up (or steps down): at most one term on
        waiting_term = net.nodes[lone].term
        assert net.nodes[lone].coordinator is None and net.nodes[lone].short_of_quorum == 1
        sent = len(net.sent)
        net.run(10 * CONFIG.timeout_s)  # thirty seconds alone: before, ten new terms and their requests
        assert net.nodes[lone].term == waiting_term
        assert net.sent[sent:] == []
        net.alive.add(stopped)
        net.restart(stopped)
        assert net.run_until_agreed(4 * CONFIG.timeout_s) is not None
        assert all(e.short_of_quorum == 0 for e in net.nodes.values())


def test_a_coordinator_caught_breaking_the_rules_is_given_up_and_never_voted_for_again():
    """Issue 27: members that hold evidence against their coordinator (a forged record or a plan
    that breaks the task's rules) leave it at once and elect another; it can stand again, but no
    member that accused it votes for it, so it never gets a quorum of them."""
    net = Net(4)
    net.run(CONFIG.timeout_s + 2 * HB)
    term, hostile = net.agreed()
    honest = [p for p in net.ids if p != hostile]
    for p in honest:
        net.nodes[p].give_up(net.now, hostile)
        assert net.nodes[p].coordinator is None and net.nodes[p].term == term + 1
    net.run(2 * CONFIG.timeout_s + 4 * HB)
    new_term, new = net.agreed(honest)
    assert new != hostile and new_term > term
    # The honest coordinator dies: the hostile peer is now a designated candidate in some terms and
    # stands, but the two honest members left never vote for it, so it never leads again.
    net.alive.discard(new)
    left = [p for p in honest if p != new]
    for _ in range(6):
        net.run(CONFIG.timeout_s + HB)
        net.broadcast(hostile, [VoteRequest(task_cid=TASK, term=net.nodes[hostile].term, candidate=hostile)])
        assert all(net.nodes[p].coordinator != hostile for p in left)
    assert not any(isinstance(m, SignedVote) and m.vote.candidate == hostile and m.vote.voter in left
                   and m.vote.term > term for _, m in net.sent)


def test_members_that_resume_a_stopped_run_elect_in_the_term_after_its_last_record_at_once():
    """After a stop of the whole run (ballots forgotten), a term of the chain is never used again:
    the members go to the term after the last record's and elect its designated candidate without
    waiting for a term to time out; a request for a term up to the record's gets no vote."""
    net = Net(3)
    for node in net.nodes.values():
        node.resume_after(7)
    stale = net.ids[0]
    net.broadcast(stale, [VoteRequest(task_cid=TASK, term=7, candidate=stale)])
    assert not [m for _, m in net.sent if isinstance(m, SignedVote)]
    net.run(2 * HB)
    assert net.agreed() == (8, designated(TASK, 8, net.ids))
