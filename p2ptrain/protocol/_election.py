"""Coordinator election among a task's members, with terms: a pure state machine.

No network and no clock inside: the node feeds it the time, a :class:`~p2ptrain.protocol.View`
of its peers (who counts as alive is decided here, from it: :mod:`p2ptrain.protocol._voters`), the
roster (the members of the last round plan; before the first round, the live members of the task),
whether this member is at the run's state (one that is not never leads), and the messages it
receives, and broadcasts the messages it returns. So every property is testable by driving several
machines in one process. Its parts with a job of their own: the ballots (one vote per term, ever:
:mod:`~p2ptrain.protocol._ballot_box`), the candidate's votes and certificate
(:mod:`~p2ptrain.protocol._candidacy`), and when a term without a coordinator ends
(:mod:`~p2ptrain.protocol._term_clock`).

The scheme is Raft's election with a deterministic candidate:

- Terms count up. A member votes at most once per term (first valid request wins) and only for a
  live roster member; its vote is a signed :class:`~p2ptrain.wire.Vote`.
- A candidate that collects votes from a strict majority of the roster is coordinator for that
  term. Its heartbeat carries those signed votes, and a member accepts a coordinator only with such
  a quorum certificate.
- When the accepted coordinator is silent for ``timeout_beats`` heartbeats (or a term passes with no
  coordinator), a member moves to the next term. Only the *designated* candidate of a term asks for
  votes: the live roster member (not suspected: given up as silent, until it beats or asks for votes)
  with the lowest ``sha256(task, term, peer)``. Members with the same view agree on it without talking, so
  elections do not split; when views differ and votes split, the term times out and the next term's
  ranking (a fresh hash order) picks again. From the third term in a row that times out, terms last
  longer (x2, x4, x8 at most) until a coordinator is accepted: on a loaded machine a request and its
  votes took longer than a term to go there and back, and every term failed alike.
- Nobody stands in term 0 of a fresh run (no roster yet): its timeout lets the first members hear
  each other. A member that sees ``max_members`` (the task's ``peers.max``) alive ends it at once:
  no one else can be in the first roster. Before the first plan, a member that sees nobody else
  (a roster of one) stands alone only if it saw no other member lately: one whose view emptied for
  a moment (a stall) elected itself with a certificate nobody accepts.
- Stale terms are ignored; a valid heartbeat of a higher term moves a member to it (a coordinator
  steps down). A member that hears its coordinator, and the coordinator itself, ignore vote
  requests, so a peer that rejoins with a stale view cannot disrupt a working term; such a peer
  (no coordinator, term run ahead on its own) follows the first heartbeat with a valid certificate.
- A coordinator that no longer sees a quorum of its roster alive steps down, so the minority side of
  a partition stops issuing rounds; one that steps down because its state fell behind does not
  stand in the next term (the others will suspect it, so its own vote would only split the term).
- A member that sees fewer of its roster alive than a quorum (a lone member of a two-member run, the
  minority side of a partition) cannot win any term: it neither stands nor lets its term time out,
  and says how many more peers it waits for (``short_of_quorum``). It still votes when asked, and
  its term's timer starts afresh when enough peers are back.
- A coordinator whose votes no longer cover the roster (its certificate keeps every vote of its
  term, so a roster that grows by one is covered) renews its mandate: it stands in the next term at once, designated or not,
  and the members that follow it vote for it although their term is still working: the request comes
  from their own coordinator (else every admission cost a heartbeat timeout, 3 s, without rounds).
- A member without a coordinator still votes, once, in a term up to ``_LOWER_TERM_VOTES`` behind
  its own (terms time out on each member's own clock), and follows that term's winner; without
  this, a member one term ahead ignored every request and elections went round for dozens of seconds.
- A member that still hears its coordinator sets a request of a later term aside, and votes for it
  at once if it gives that coordinator up and enters that term: the candidate is usually the member
  that saw the coordinator die first, and would otherwise ask again only a heartbeat later.

Safety (at most one coordinator accepted per term) rests on two facts. (1) One vote per member per
term, ever (:class:`~p2ptrain.protocol._ballot_box.BallotBox` signs every vote, refuses a second,
and counts a term whose ballot it lost as voted; the node persists ``voted_through``). (2) Two
majorities of one roster share a member, so two certificates of one term name the same coordinator
while the rosters they are checked against have intersecting majorities: the same roster, or
rosters one member apart. No rule above may break (1) or count votes on other grounds than (2);
where rosters differ more, (2) fails (docs/training.md, "Election").
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from libp2p.crypto.keys import KeyPair

from p2ptrain.base import short_id
from p2ptrain.protocol import signing
from p2ptrain.protocol._ballot_box import BallotBox
from p2ptrain.protocol._candidacy import Candidacy
from p2ptrain.protocol._records import quorum
from p2ptrain.protocol._term_clock import TermClock
from p2ptrain.protocol.signing import SignatureError
from p2ptrain.protocol._voters import ElectionConfig as ElectionConfig  # re-exported with View: what a tick takes
from p2ptrain.protocol._voters import View as View, certificate_problem, designated, voters_alive
from p2ptrain.wire import CoordinatorBeat, SignedVote, VoteRequest

log = logging.getLogger(__name__)

ElectionMessage = VoteRequest | SignedVote | CoordinatorBeat
# How many terms back a member without a coordinator still votes (see Election._on_request).
_LOWER_TERM_VOTES = 2


class Election:
    """One member's view of the election of one task."""

    def __init__(self, task_cid: str, key_pair: KeyPair, config: ElectionConfig = ElectionConfig(), *,
                 voted_through: int | None = -1, max_members: int | None = None) -> None:
        """``voted_through``: :attr:`voted_through` when this member last ran the task (-1: never);
        None when that is unknown (its file was damaged): it then votes and stands in no term.
        ``max_members``: the task's ``peers.max``; once that many members are alive, term 0 of a
        fresh run ends without waiting out its timeout (:meth:`TermClock.gathered`)."""
        self.task_cid = task_cid
        self.key_pair = key_pair
        self.me = signing.peer_str(key_pair)
        self.config = config
        self.max_members = max_members
        self.term = 0
        self.coordinator: str | None = None  # accepted for self.term
        self._box = BallotBox(task_cid, key_pair, voted_through)  # one vote per term, ever
        self.live: frozenset[str] = frozenset()
        self.roster: tuple[str, ...] = ()
        self.suspects: set[str] = set()  # peers whose coordinatorship timed out
        # Peers this member caught breaking the run's rules as coordinator (give_up), with the term
        # it caught them in: it never votes for them again, nor names them as a term's candidate,
        # nor follows them in that term or an earlier one. Unlike suspects they are not forgiven
        # when heard again: a peer that signs a forged record is not merely slow.
        self.accused: dict[str, int] = {}
        # The coordinator the latest tick gave up on (it fell silent), else None: most likely dead,
        # so the planner leaves it out like a peer a round named (RoundBook.note_silent_coordinator).
        self.given_up: str | None = None
        self._candidacy = Candidacy()  # votes for me in self.term, and the certificate they make
        self._certified_for: tuple[int, tuple[str, ...]] | None = None
        self._clock = TermClock(config.timeout_s)  # when a term without a coordinator ends
        self._last_heard = 0.0
        self._last_sent = -1e18
        # The term after one a coordinator stepped down from: it does not stand in it.
        self._abstain_term = -1
        # The term in which a coordinator renews its mandate under a changed roster: it stands.
        self._renew_term = -1
        # A request of a later term that came while our coordinator still looked alive: (term,
        # candidate). If we give that coordinator up and enter that term, we vote for it at once
        # instead of waiting a heartbeat for the candidate to ask again.
        self._deferred: tuple[int, str] | None = None
        # How many more roster members must be alive before an election can be won (0: enough);
        # while short, the member waits in its term instead of standing and timing out term after term.
        self.short_of_quorum = 0

    def resume_after(self, term: int) -> None:
        """This member resumes a run whose confirmed chain ends with a record of ``term`` (after a
        stop; its ballots of that time are forgotten): it goes to the next term and votes in no
        term up to ``term``. Terms are not used twice, so a chain never holds two coordinators'
        records under one term, and the run's first election takes one term, not a timeout first.
        Called again once the member may lead, while no coordinator is known: that term's clock
        starts afresh (a term that ran out while every member was still loading would cost another)."""
        self._box.forget_through(term)
        if self.coordinator is None and self.term <= term + 1:
            self._new_term(0.0, term + 1)
            self._clock.start(None)  # the term's clock starts at the next tick

    # --- queries --------------------------------------------------------------------------------

    @property
    def voted_for(self) -> str | None:
        return self._box.ballot(self.term)

    @property
    def voted_through(self) -> int:
        """The latest term this member may have voted in (-1: none): kept on disk before a vote
        leaves, given back after a restart (run/_ballots_file.py)."""
        return self._box.voted_through

    @property
    def failed_terms(self) -> int:
        """Terms in a row that timed out without a coordinator (they last longer from the third on)."""
        return self._clock.failed

    @property
    def is_coordinator(self) -> bool:
        return self.coordinator == self.me

    @property
    def heard_at(self) -> float:
        """When the accepted coordinator's last heartbeat arrived (or it was accepted)."""
        return self._last_heard

    def _voters(self) -> tuple[str, ...]:
        return self.roster or tuple(sorted(self.live | {self.me}))

    def _votable(self, candidate: str) -> bool:
        """Whether we may vote for ``candidate``: a live roster member (or ourselves), never one we
        caught breaking the run's rules."""
        return candidate in self._voters() and candidate in self.live | {self.me} and candidate not in self.accused

    def eligible(self) -> list[str]:
        """Who may be designated a term's candidate: live roster members neither suspected nor accused."""
        alive = self.live | {self.me}
        return [p for p in self._voters() if p in alive and p not in self.suspects and p not in self.accused]

    # --- inputs ---------------------------------------------------------------------------------

    def tick(self, now: float, view: View, roster: Sequence[str] = (), *, may_lead: bool = True) -> list[ElectionMessage]:
        """Advance time with the current view; return messages to broadcast.

        ``view``: what the node sees of its peers; who counts as alive is computed from it
        (:func:`~p2ptrain.protocol._voters.voters_alive`). ``may_lead``: whether this member is at
        the run's state. One that is not must not lead the run: it does not stand for a term (so it
        cannot win one), and a coordinator steps down; it still votes, and its vote counts.
        """
        self.roster = tuple(roster)
        self.live = voters_alive(view, self.roster, self.me, coordinator=self.coordinator,
                                 heard_at=self._last_heard, now=now, config=self.config)
        self.given_up = None
        voters = self._voters()
        # Before the first plan, a member that sees nobody else but saw other members lately does not
        # elect itself with a roster of one (_term_clock.py says why): it waits for one, as one short does.
        alone = self._clock.waits_alone(now, bool(self.live - {self.me}), not self.roster and voters == (self.me,))
        short = max(int(alone), quorum(len(voters)) - sum(1 for p in voters if p in self.live or p == self.me))
        if short and not self.short_of_quorum:
            log.info("task %s: %s sees too few of its roster of %d alive; waiting for %d more peer(s) "
                     "instead of moving to new terms", self.task_cid[:12], short_id(self.me), len(voters), short)
        self.short_of_quorum = short
        if self.is_coordinator and not may_lead:
            self.step_down(now)
        if self._clock.started is None:
            self._clock.start(now)
        out: list[ElectionMessage] = []
        if self.is_coordinator:
            if sum(1 for p in voters if p in self.live or p == self.me) < quorum(len(voters)):
                log.warning("task %s: coordinator %s sees no quorum of its roster alive; stepping down (term %d)",
                            self.task_cid[:12], short_id(self.me), self.term)
                self._new_term(now, self.term + 1)
            elif self._certified_for != (self.term, voters) and self.check_certificate(self._beat()) is not None:
                # The roster changed under us (members died or joined) and our votes no longer make
                # a quorum of it: peers that check our certificate against today's roster (a joiner,
                # a member that resynced) would refuse us. Call an election among today's roster.
                log.info("task %s: coordinator %s's votes no longer cover the roster; asks for them again "
                         "in term %d", self.task_cid[:12], short_id(self.me), self.term + 1)
                self._new_term(now, self.term + 1)
                self._renew_term = self.term
                self._last_sent = -1e18  # ask now, not a heartbeat after the last beat
                return self._stand(now)
            else:
                # Checked once per (term, roster): verifying every vote's signature at each tick is waste.
                self._certified_for = (self.term, voters)
                if now - self._last_sent >= self.config.heartbeat_s:
                    self._last_sent = now
                    out.append(self._beat())
            return out
        if self.coordinator is not None:
            if now - self._last_heard < self.config.timeout_s and self.coordinator in self.live:
                return out
            log.info("task %s: coordinator %s silent; %s moves to term %d",
                     self.task_cid[:12], short_id(self.coordinator), short_id(self.me), self.term + 1)
            self.suspects.add(self.coordinator)
            self.given_up = self.coordinator
            self._new_term(now, self.term + 1)
            if self._deferred is not None and self._deferred[0] == self.term:
                candidate = self._deferred[1]
                if candidate in self.eligible() and self.voted_for in (None, candidate):
                    log.info("task %s: %s votes for %s in term %d (asked while its coordinator looked alive)",
                             self.task_cid[:12], short_id(self.me), short_id(candidate), self.term)
                    out.append(self._vote(candidate))
        elif short:
            # No election can be won without a quorum of the roster alive: standing and timing out
            # term after term only churns terms (a lone member of a two-member run moved to a new
            # term every 3 s). Wait in this term; its timer starts when enough peers are back.
            self._clock.start(now)
            return out
        elif self._clock.gathered(self.term, not self.roster, len(voters), self.max_members):
            log.info("task %s: all %d members of a fresh run are alive; %s ends term 0 early",
                     self.task_cid[:12], len(self._voters()), short_id(self.me))
            self._new_term(now, self.term + 1)
        elif self._clock.expired(now):
            if self.term > 0:  # nobody stands in term 0: its end is no failed election
                self._clock.note_failed()
            log.info("task %s: term %d passed without a coordinator; %s moves to term %d (voted for %s; "
                     "%.0f s a term now)", self.task_cid[:12], self.term, short_id(self.me), self.term + 1,
                     short_id(self.voted_for or "nobody"), self._clock.timeout_s)
            self._new_term(now, self.term + 1)
        mine = designated(self.task_cid, self.term, self.eligible()) == self.me or self.term == self._renew_term
        if (may_lead and not short and self.term > 0 and self.voted_for in (None, self.me) and mine
                and self.term != self._abstain_term):
            out += self._stand(now)
        return out

    def receive(self, now: float, sender: str, msg: ElectionMessage) -> list[ElectionMessage]:
        """Handle one election message from ``sender`` (its wire envelope already verified)."""
        if msg.task_cid != self.task_cid:
            return []
        if isinstance(msg, VoteRequest):
            return self._on_request(now, sender, msg)
        if isinstance(msg, SignedVote):
            return self._on_vote(now, msg)
        return self._on_beat(now, sender, msg) if isinstance(msg, CoordinatorBeat) else []

    def give_up(self, now: float, peer: str) -> None:
        """Stop following coordinator ``peer`` now: it signed a plan or record that breaks the run's
        rules. We move to the next term (so does every member that saw the same evidence) and never
        vote for it again; a quorum that did not see it can still elect it, and we follow a valid
        certificate as always (a minority must not cut itself off from the run)."""
        if peer == self.me:
            return
        self.accused[peer] = max(self.term, self.accused.get(peer, 0))
        if self.coordinator != peer:
            return
        log.warning("task %s: %s stops following coordinator %s (it broke the run's rules); moves to term %d",
                    self.task_cid[:12], short_id(self.me), short_id(peer), self.term + 1)
        self.suspects.add(peer)
        self._new_term(now, self.term + 1)

    @property
    def certificate(self) -> tuple[SignedVote, ...]:
        """The votes that elected this member in the current term (empty unless coordinator)."""
        return self._candidacy.certificate if self.is_coordinator else ()

    def step_down(self, now: float) -> None:
        """Give up coordinatorship (e.g. our state fell behind the run): move to the next term, so
        the members time out on us and elect the next term's candidate."""
        if self.is_coordinator:
            log.info("task %s: coordinator %s steps down (term %d)", self.task_cid[:12], short_id(self.me), self.term)
            self._new_term(now, self.term + 1)
            self._abstain_term = self.term

    # --- transitions ------------------------------------------------------------------------------

    def _new_term(self, now: float, term: int) -> None:
        self.term = term
        self.coordinator = None
        self._candidacy.clear()
        self._clock.start(now)

    def _vote(self, candidate: str) -> SignedVote:
        return self._box.vote(self.term, candidate)

    def _stand(self, now: float) -> list[ElectionMessage]:
        """Vote for myself and ask for votes (again each heartbeat, in case a request was lost)."""
        if self.voted_for not in (None, self.me):
            return []  # our one vote of this term went elsewhere (or may have: see BallotBox.ballot)
        if self.voted_for is None:
            self._candidacy.add(self._vote(self.me), own=True)
            log.info("task %s: %s stands for term %d (roster %d, eligible %s)", self.task_cid[:12], short_id(self.me),
                     self.term, len(self._voters()), ", ".join(sorted(short_id(p) for p in self.eligible())))
        out: list[ElectionMessage] = []
        if self._candidacy.won(self._voters()):
            return [self._become_coordinator(now)]
        if now - self._last_sent >= self.config.heartbeat_s:
            self._last_sent = now
            out.append(VoteRequest(task_cid=self.task_cid, term=self.term, candidate=self.me))
        return out

    def _become_coordinator(self, now: float) -> CoordinatorBeat:
        self._candidacy.certify(self._voters())
        self.coordinator = self.me
        self._last_heard = self._last_sent = now
        self._clock.note_coordinator()
        log.info("task %s: %s is coordinator of term %d (%d votes)", self.task_cid[:12], short_id(self.me),
                 self.term, len(self._candidacy.votes))
        return self._beat()

    def _beat(self) -> CoordinatorBeat:
        return CoordinatorBeat(task_cid=self.task_cid, term=self.term, coordinator=self.me, votes=self._candidacy.certificate)

    def _on_request(self, now: float, sender: str, msg: VoteRequest) -> list[ElectionMessage]:
        if sender != msg.candidate or msg.term <= self._box.forgotten_through:
            return []  # (a term we may have voted in: nothing to answer)
        # A suspect that asks for votes is not the hung coordinator we gave up: it may be designated
        # again. Otherwise members that each suspect all the others each stood alone, term after term.
        self.suspects.discard(msg.candidate)
        if msg.term < self.term:
            # Our terms time out on our own clock, so ours may have run ahead of the candidate's
            # (a coordinator that gave up its term starts the next one before the others notice).
            # With no coordinator we still vote in that recent term, once: ballots are per term,
            # so no term gets two coordinators, and its winner is followed (see _on_beat).
            if (self.coordinator is None and msg.term >= self.term - _LOWER_TERM_VOTES
                    and self._box.ballot(msg.term) is None and self._votable(msg.candidate)):
                log.info("task %s: %s votes for %s in earlier term %d (at term %d)", self.task_cid[:12],
                         short_id(self.me), short_id(msg.candidate), msg.term, self.term)
                return [self._box.vote(msg.term, msg.candidate)]
            return []
        renewal = msg.candidate == self.coordinator and msg.term > self.term  # see the module docstring
        if self.coordinator is not None and not renewal and (
            self.is_coordinator or now - self._last_heard < self.config.timeout_s
        ):
            if msg.term > self.term and not self.is_coordinator:
                self._deferred = (msg.term, msg.candidate)
            return []  # a working term is not disrupted by one peer's stale view
        if msg.term > self.term:
            self._new_term(now, msg.term)
        if not self._votable(msg.candidate):
            return []
        if self.voted_for not in (None, msg.candidate):
            return []
        if self.voted_for is None:
            log.info("task %s: %s votes for %s in term %d", self.task_cid[:12], short_id(self.me), short_id(msg.candidate),
                     self.term)
        return [self._vote(msg.candidate)]

    def _on_vote(self, now: float, signed: SignedVote) -> list[ElectionMessage]:
        v = signed.vote
        if v.term > self.term and self.coordinator is None:
            # Someone is voting in a later term: we missed its start. Catch up (but we have no vote
            # to count yet: the vote is for that term's candidate).
            self._new_term(now, v.term)
            return []
        if v.term != self.term or v.candidate != self.me:
            return []
        if (self.coordinator is not None and not self.is_coordinator) or v.voter not in self._voters():
            return []
        try:
            if not self._candidacy.add(signed):
                return []
        except SignatureError as exc:
            log.warning("task %s: dropped vote: %s", self.task_cid[:12], exc)
            return []
        if self.is_coordinator:
            # A vote that came after we had a quorum still goes into the certificate (_candidacy.py).
            self._candidacy.certify(self._voters())
            self._last_sent = -1e18  # beat at the next tick: members that refused the smaller one accept
            return []
        if self.voted_for == self.me and self._candidacy.won(self._voters()):
            return [self._become_coordinator(now)]
        return []

    def check_certificate(self, beat: CoordinatorBeat) -> str | None:
        """Why ``beat``'s votes do not elect its coordinator under our roster, or None if they do."""
        return certificate_problem(self.task_cid, beat, self._voters())

    def _on_beat(self, now: float, sender: str, beat: CoordinatorBeat) -> list[ElectionMessage]:
        if sender != beat.coordinator:
            return []
        if beat.term <= self.accused.get(beat.coordinator, -1):
            return []  # the term we caught it in, or an earlier one: its certificate changes nothing
        if beat.term < self.term and self.coordinator is not None:
            return []  # stale: we follow (or are) the coordinator of a later term
        if beat.term == self.term and self.coordinator is not None:
            if self.coordinator == beat.coordinator:
                self._last_heard = now
            elif not self.is_coordinator:
                log.error("task %s: two coordinators claim term %d (%s, %s); keeping the first",
                          self.task_cid[:12], beat.term, short_id(self.coordinator), short_id(beat.coordinator))
            return []
        problem = self.check_certificate(beat)
        if problem is not None:
            # Alone in our own view (just started, no peer or head heard yet) we cannot judge any
            # certificate: that is no news worth a warning.
            level = logging.WARNING if len(self._voters()) > 1 else logging.DEBUG
            log.log(level, "task %s: ignored coordinator %s for term %d: %s",
                    self.task_cid[:12], short_id(beat.coordinator), beat.term, problem)
            return []
        if beat.term != self.term:
            # Later term: catch up. Earlier term while we have no coordinator: our own term ran
            # ahead alone (we were cut off, or stood without being heard) while this coordinator
            # kept a quorum; follow it. Ballots are kept per term, so going back never lets us vote
            # twice in one term.
            self._new_term(now, beat.term)
        self.coordinator = beat.coordinator
        self.suspects.discard(beat.coordinator)
        self._last_heard = now
        self._clock.note_coordinator()
        log.info("task %s: %s accepts coordinator %s for term %d",
                 self.task_cid[:12], short_id(self.me), short_id(beat.coordinator), beat.term)
        return []
