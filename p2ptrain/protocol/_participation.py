"""Who takes part in a run: a participation ledger, so that advertising a task is not membership.

Any peer can name a task in its heartbeats for free. Counted as it is (before issue 27), a few
identities that only did that stopped a run: a new task's election counted them as voters and never
reached a quorum (terms churned), and a running task admitted them as joiners at its next
checkpoint, where the span's round failed on them and no retry could keep a quorum of the plan.

The ledger keeps, per peer that advertises the task, what this member saw it do, and
:meth:`Participation.counted` says which of them count (for the election's live peers, plans and
``peers.max``). Pure and clock-injected: the run hands in the time and the evidence.

- Evidence: a vote it signed, a coordinator heartbeat of it that the election accepted (*takes part
  in elections*), and a round this member completed with it in the ring (*takes part in rounds*,
  the strong kind: nobody completes a ring round without every member's bytes). What an election
  message shows is read off the election as it receives it (:func:`receive_noting`): a vote heard
  while this member has no coordinator, and a vote for it that came after it was elected, counted
  into its certificate within ``answer_s`` of the request (a slow voter's: it did vote in the term,
  and was struck for not voting, as the election's census left it out).
- A newcomer counts: it gets one chance (its grace) to take part. That chance ends, with a strike,
  when (a) a round it was planned in failed naming it, or it did not report the failure of a
  round it was planned in (the coordinator checks, when it plans the retry), and it neither
  completed a round with us nor voted within ``grace_s``; or (b) it had never taken part and did
  not vote within ``answer_s`` of a vote request that this member heard (or sent) while it had no
  coordinator (every peer in that state votes) from another candidate.
- A struck peer does not count for ``grace_s * 2**strikes`` (at most ``max_backoff_s``); then
  it gets its next chance. Any evidence clears its strikes at once: a slow but honest peer that
  votes, or completes a round, is back; one that missed a round is tried again later, never locked
  out for good.

What this bounds (docs/security.md, "Sybils"): a heartbeat-only identity costs a run at most one
failed round attempt per chance, its first at once and then one per ``max_backoff_s``; a new
identity is a new chance, so an attacker that keeps minting them costs one attempt each. A peer that
really votes and trains is a member: only ``[peers] admission = "allowlist"`` keeps those out.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from p2ptrain.protocol._election import _LOWER_TERM_VOTES
from p2ptrain.wire import SignedVote, VoteRequest

if TYPE_CHECKING:
    from p2ptrain.protocol._election import Election, ElectionMessage

# Entries of peers that no longer advertise the task are dropped after this long, and the ledger
# holds at most MAX_ENTRIES (heartbeats are capped upstream: mesh/_membership.py); a dropped Sybil
# that comes back is a fresh identity, which it could have been anyway.
FORGET_S = 600.0
MAX_ENTRIES = 4096


@dataclass
class _Entry:
    since: float  # when this member first saw it advertise the task
    touched: float  # last time it advertised the task (or left evidence)
    rounds_at: float | None = None  # last round this member completed with it
    voted_at: float | None = None  # last vote of it in an election this member was in
    proven: bool = False  # it left evidence since its last strike
    strikes: int = 0
    struck_until: float = 0.0


@dataclass
class Participation:
    """One member's ledger of who takes part in one run (see the module docstring)."""

    grace_s: float = 30.0
    answer_s: float = 3.0
    max_backoff_s: float = 600.0
    _peers: dict[str, _Entry] = field(default_factory=dict)
    # A vote request heard while this member had no coordinator: (when, its candidate).
    _asked: tuple[float, str] | None = None
    _last_round_at: float | None = None  # when this member last completed a round

    def _entry(self, now: float, peer: str) -> _Entry:
        entry = self._peers.get(peer)
        if entry is None:
            entry = self._peers[peer] = _Entry(since=now, touched=now)
        return entry

    def note_vote(self, now: float, peer: str) -> None:
        """``peer`` voted in an election this member is in (it had no coordinator), or was
        accepted as coordinator: it takes part in elections."""
        entry = self._proven(now, peer)
        entry.voted_at = now

    def note_late_vote(self, now: float, peer: str) -> None:
        """A vote of ``peer`` for this member in the term it leads, counted into its certificate
        after the quorum that elected it: evidence as a vote in the election is when it comes
        within ``answer_s`` of the vote request this member sent or heard (the time an election's
        voter has, :meth:`note_asked`); later it is a vote at a time of its sender's choosing,
        which is free to send and must not clear a strike."""
        if self._asked is not None and now - self._asked[0] < self.answer_s:
            self.note_vote(now, peer)

    def note_round(self, now: float, members: Collection[str]) -> None:
        """This member completed a round whose ring was ``members``: each of them took part."""
        for peer in members:
            self._proven(now, peer).rounds_at = now
        self._last_round_at = now

    def note_missed(self, now: float, peer: str) -> None:
        """A round this member was in failed naming ``peer``: unless it was in the last round we
        completed, or completed a round with us or voted within ``grace_s`` (an honest member that
        failed once, however long rounds take, or whose first round was blamed on it for a
        neighbour's absence: the book's quarantine covers it), that was its chance: it is struck."""
        entry = self._entry(now, peer)
        if entry.struck_until > now or (entry.rounds_at is not None and entry.rounds_at == self._last_round_at) or any(
                at is not None and now - at < self.grace_s for at in (entry.rounds_at, entry.voted_at)):
            return
        self._strike(now, entry)

    def note_asked(self, now: float, candidate: str) -> None:
        """A vote request from ``candidate`` arrived while this member has no coordinator: every
        peer in this state votes in it (or has voted in its term), so one that never took part and
        does not vote within ``answer_s`` is struck (checked in :meth:`counted`)."""
        if self._asked is None:
            self._asked = (now, candidate)

    def note_sent(self, now: float, me: str, outs: Collection[object]) -> None:
        """What this member ``me`` sends at ``now``: a vote request of its own asks every peer in its
        state to vote now (:meth:`note_asked`). Its election's tick and its receive both send."""
        if any(isinstance(out, VoteRequest) for out in outs):
            self.note_asked(now, me)

    def counted(self, now: float, advertising: Collection[str], needed: int = 0) -> frozenset[str]:
        """Of the peers that advertise the task, those that count at ``now``.

        ``needed``: how many of them the run cannot go on without (``peers.min`` less this member).
        When fewer count, struck peers make up the shortfall (:meth:`_retry_order`): a run
        that waits anyway loses nothing by trying them again, and an honest newcomer whose first
        round failed (a slow start) would otherwise keep a run of ``peers.min`` members waiting out
        its backoff. At most the shortfall is let in, and one that fails again is not struck again
        meanwhile (:meth:`note_missed`): Sybils gain no more than the attempts the run would not
        have made anyway."""
        for peer in advertising:
            self._entry(now, peer).touched = now
        if self._asked is not None and now - self._asked[0] >= self.answer_s:
            asked_at, candidate = self._asked
            self._asked = None
            for peer, entry in self._peers.items():
                if peer != candidate and not entry.proven and entry.since <= asked_at and entry.struck_until <= now:
                    self._strike(now, entry)
        self._forget(now)
        counted = [p for p in advertising if self._peers[p].struck_until <= now]
        if len(counted) < needed:
            struck = sorted((p for p in advertising if self._peers[p].struck_until > now),
                            key=lambda p: self._retry_order(self._peers[p], p))
            counted += struck[: needed - len(counted)]
        return frozenset(counted)

    def took_part(self, now: float) -> frozenset[str]:
        """Peers that left evidence (a vote, an accepted coordinator heartbeat, a completed round)
        since their last strike, and are not struck at ``now``: the census of a fresh run's
        arithmetic (protocol/_arithmetics.py), where advertising alone must not count."""
        return frozenset(p for p, e in self._peers.items() if e.proven and e.struck_until <= now)

    def struck(self, now: float) -> frozenset[str]:
        """Peers that do not count at ``now`` (for logs and `task status`)."""
        return frozenset(p for p, e in self._peers.items() if e.struck_until > now)

    def _proven(self, now: float, peer: str) -> _Entry:
        entry = self._entry(now, peer)
        entry.touched, entry.proven, entry.strikes, entry.struck_until = now, True, 0, 0.0
        return entry

    @staticmethod
    def _retry_order(entry: _Entry, peer: str) -> tuple[float, float, str]:
        """Who of the struck makes up a shortfall first: one that ever took part (the latest
        first), then the one whose backoff ends soonest."""
        last = max((at for at in (entry.rounds_at, entry.voted_at) if at is not None), default=None)
        return (-last if last is not None else float("inf"), entry.struck_until, peer)

    def _strike(self, now: float, entry: _Entry) -> None:
        entry.strikes += 1
        entry.proven = False
        entry.struck_until = now + min(self.grace_s * 2**entry.strikes, self.max_backoff_s)

    def _forget(self, now: float) -> None:
        stale = [p for p, e in self._peers.items() if now - e.touched > FORGET_S and e.struck_until <= now]
        for peer in stale:
            del self._peers[peer]
        if len(self._peers) > MAX_ENTRIES:
            for peer in sorted(self._peers, key=lambda p: self._peers[p].touched)[: len(self._peers) - MAX_ENTRIES]:
                del self._peers[peer]


def receive_noting(election: Election, ledger: Participation, now: float, sender: str,
                   msg: ElectionMessage) -> list[ElectionMessage]:
    """``election.receive(now, sender, msg)``, with what the message shows of ``sender`` noted in
    ``ledger``: a vote request while no coordinator is known (every peer votes now), a vote in an
    election this member is in (it had no coordinator, and the vote's term is one it still votes
    in), a late vote for it as coordinator (:meth:`Participation.note_late_vote`), a coordinator
    it accepts or follows, and its own requests. One function for the runtime (run/_leading.py) and
    the simulations, which copied these rules. Votes at any other time are free to send, and
    would keep a peer that never trains counted."""
    before, term = election.coordinator, election.term
    if isinstance(msg, VoteRequest) and before is None and msg.term >= term:
        ledger.note_asked(now, sender)  # every peer without a coordinator votes now
    certified = {v.vote.voter for v in election.certificate}
    outs = election.receive(now, sender, msg)
    vote = msg.vote if isinstance(msg, SignedVote) and msg.vote.voter == sender else None
    if (vote is not None and before is None and vote.term >= term - _LOWER_TERM_VOTES) or election.coordinator == sender:
        ledger.note_vote(now, sender)
    elif vote is not None and before == election.me and sender in {v.vote.voter for v in election.certificate} - certified:
        ledger.note_late_vote(now, sender)  # its vote went into our certificate just now
    ledger.note_sent(now, election.me, outs)
    return outs
