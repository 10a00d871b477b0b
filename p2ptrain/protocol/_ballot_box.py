"""One member's ballots in a task's elections: at most one signed vote per term, ever.

The first of the two facts the election's safety rests on (:mod:`p2ptrain.protocol._election`):
every vote this member signs is signed here, and a second, different ballot in one term is refused.
Ballots are kept per term (a member whose term goes back cannot vote again in a term it passed),
and a term whose ballot is no longer held counts as voted in, for nobody we know: ballots cast
before a restart (the node persists :attr:`BallotBox.voted_through`), terms used before a stop of
the run (:meth:`BallotBox.forget_through`), ballots dropped from memory (``_BALLOT_MEMORY``).
Pure: no clock, no network.
"""

from __future__ import annotations

from libp2p.crypto.keys import KeyPair

from p2ptrain.protocol import signing
from p2ptrain.wire import SignedVote, Vote

# Ballots older than this many terms are forgotten; those elections ended long ago.
_BALLOT_MEMORY = 256
# The ballot of a term at or below BallotBox.forgotten_through: cast for someone we no longer know.
FORGOTTEN = "?"
# BallotBox(voted_through=None): the member cannot tell which terms it voted in, so it votes in none.
_EVERY_TERM = 2**63 - 1  # the largest term the wire carries


class BallotBox:
    """The terms this member voted in, and for whom; the one place its votes are signed."""

    def __init__(self, task_cid: str, key_pair: KeyPair, voted_through: int | None) -> None:
        """``voted_through``: the latest term this member may have voted in when it last ran the
        task (-1: never); None when that is unknown (its file was damaged): it votes in no term."""
        self.task_cid = task_cid
        self.key_pair = key_pair
        self.me = signing.peer_str(key_pair)
        self._ballots: dict[int, str] = {}  # term -> whom I voted for
        # Every term up to this one counts as voted in, for nobody we know. No vote is ever cast in them.
        self.forgotten_through = _EVERY_TERM if voted_through is None else voted_through

    def ballot(self, term: int) -> str | None:
        """Whom we voted for in ``term``: None if nobody, :data:`FORGOTTEN` if we cannot tell."""
        return FORGOTTEN if term <= self.forgotten_through else self._ballots.get(term)

    @property
    def voted_through(self) -> int:
        """The latest term this member may have voted in (-1: none): kept on disk before a vote
        leaves, given back after a restart (run/_ballots_file.py)."""
        return max(self.forgotten_through, max(self._ballots, default=-1))

    def forget_through(self, term: int) -> None:
        """Count every term up to ``term`` as voted in (a resumed run's terms are not used twice)."""
        self.forgotten_through = max(self.forgotten_through, term)

    def vote(self, term: int, candidate: str) -> SignedVote:
        """Sign our vote for ``candidate`` in ``term``: the only vote of ours that term will ever have."""
        assert self.ballot(term) in (None, candidate), "a second vote in one term"
        self._ballots[term] = candidate
        while len(self._ballots) > _BALLOT_MEMORY:
            oldest = min(self._ballots)
            del self._ballots[oldest]
            self.forgotten_through = max(self.forgotten_through, oldest)
        body = Vote(task_cid=self.task_cid, term=term, candidate=candidate, voter=self.me)
        return SignedVote(vote=body, signature=signing.sign(body, self.key_pair))
