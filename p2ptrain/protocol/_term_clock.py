"""When a term without a coordinator ends: its timer, the backoff of terms that keep failing, the
wait of a member that sees itself alone, and the early end of a fresh run's term 0.

Pure and clock-injected, like the election it serves (:mod:`p2ptrain.protocol._election`).

- **Backoff.** A term passes without a coordinator after ``timeout_beats`` heartbeats (3 s). On a
  loaded machine (load average 6-23 on two cores: eight nodes of a pipelined run) a vote request
  and its votes took longer than that to go there and back: the candidate had moved to the next
  term when its votes came, and every term failed the same way, a new term every ~3 s for minutes.
  From the third failed term in a row, terms last twice as long, then four and eight times (at
  most: 24 s at the default heartbeat), so that one outlasts the round trip; accepting (or
  winning) a coordinator resets it. Only a term that times out counts as failed: one left for a
  later term heard of, or while waiting short of a quorum, says nothing of how long this network
  takes to finish an election. Each member counts its own failures, but members that live through
  the same failed terms count alike, and one whose term ran ahead still votes in recent ones.
- **Alone.** Before the first plan (no roster: the live members vote), a member that sees nobody
  else has a roster of one and wins a term with its own vote. That is how the first member of a run
  leads (its heads re-announce the task), but a member whose view emptied for a moment (a stall of
  its process made its mesh give every peer up) elected itself with a certificate nobody else
  accepts, then renewed it in a new term, designated or not, once it heard the others again. A
  member that saw another member alive within the longest term (:data:`MAX_BACKOFF` timeouts)
  waits instead, as one short of a quorum does.
"""

from __future__ import annotations

# From this many failed terms in a row on, each term's timeout doubles (x2, x4, ...).
BACKOFF_FROM = 3
# The longest a term may last, in plain timeouts; also how long a member alone waits for the others.
MAX_BACKOFF = 8


class TermClock:
    """One member's clock of its current term (see the module docstring)."""

    def __init__(self, timeout_s: float) -> None:
        self.base_timeout_s = timeout_s
        self.started: float | None = None  # None: the term's clock starts at the next tick
        self.failed = 0  # terms in a row that timed out without a coordinator
        self._others_at: float | None = None  # when this member last saw another voter alive

    @property
    def timeout_s(self) -> float:
        """How long the current term may pass without a coordinator."""
        return self.base_timeout_s * min(MAX_BACKOFF, 1 << max(0, self.failed - BACKOFF_FROM + 1))

    def start(self, now: float | None) -> None:
        """The current term (a new one, or one whose wait ends) starts at ``now`` (None: at the next tick)."""
        self.started = now

    def expired(self, now: float) -> bool:
        return self.started is not None and now - self.started >= self.timeout_s

    @staticmethod
    def gathered(term: int, fresh: bool, voters: int, max_members: int | None) -> bool:
        """Whether term 0 of a fresh run (``fresh``: no roster yet, the live members vote) may end
        now. Nobody stands in term 0: its timeout lets the first members hear each other, so that they
        agree on term 1's candidate. Once ``max_members`` (``peers.max``) are alive no other member
        can be in the first roster, and the wait would only delay the run. ``peers.min`` is not
        touched by this: it is at most ``peers.max``, and the plan still waits for it (RoundBook.next_plan)."""
        return term == 0 and fresh and max_members is not None and voters >= max_members

    def note_failed(self) -> None:
        """The current term timed out without a coordinator."""
        self.failed += 1

    def note_coordinator(self) -> None:
        """A coordinator was accepted (or won): elections finish on this network again."""
        self.failed = 0

    def waits_alone(self, now: float, others_alive: bool, alone: bool) -> bool:
        """Whether a member that has a roster of one (``alone``) waits instead of standing: it saw
        another voter alive within :data:`MAX_BACKOFF` timeouts. ``others_alive``: whether it sees
        one now (called at every tick)."""
        if others_alive:
            self._others_at = now
        return alone and self._others_at is not None and now - self._others_at < MAX_BACKOFF * self.base_timeout_s
