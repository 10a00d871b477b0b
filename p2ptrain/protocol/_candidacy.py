"""The votes a candidate collects in its term, and the certificate they make: pure, no clock.

A candidate counts each roster member's signed vote once and wins a term with a strict majority of
its roster. As coordinator it keeps every vote of its term in its certificate, also those that
came after it won: members whose roster differs a little (a plan they missed) still find a majority
of theirs in it, and a roster that grows by one (a joiner admitted) is still covered, so admitting
a member needs no election. The certificate travels in every heartbeat, hence its bound.
"""

from __future__ import annotations

from collections.abc import Collection

from p2ptrain.protocol import signing
from p2ptrain.protocol._records import quorum
from p2ptrain.wire import SignedVote

# Votes carried in a heartbeat (task.MAX_PEERS members at most, so all of them fit).
MAX_CERTIFICATE = 128


class Candidacy:
    """The votes for this member in its current term (empty unless it stands)."""

    def __init__(self) -> None:
        self.votes: dict[str, SignedVote] = {}
        self.certificate: tuple[SignedVote, ...] = ()  # the votes its heartbeats carry, once it won

    def clear(self) -> None:
        """A new term: no votes yet."""
        self.votes, self.certificate = {}, ()

    def add(self, signed: SignedVote, *, own: bool = False) -> bool:
        """Count ``signed``, a vote for us in our term by a roster member (the caller checked those):
        False if that voter's vote counts already. Raises :class:`~p2ptrain.protocol.signing.SignatureError`
        if its voter did not sign it (``own``: our own vote, signed here)."""
        v = signed.vote
        if v.voter in self.votes:
            return False
        if not own:
            signing.verify(v, v.voter, signed.signature)
        self.votes[v.voter] = signed
        return True

    def won(self, voters: Collection[str]) -> bool:
        """Whether the votes counted make a strict majority of ``voters``."""
        voters = set(voters)
        return sum(1 for v in self.votes if v in voters) >= quorum(len(voters))

    def certify(self, voters: Collection[str]) -> None:
        """Every vote counted of ``voters`` goes into the certificate (not just a quorum)."""
        voters = set(voters)
        self.certificate = tuple(self.votes[v] for v in sorted(self.votes) if v in voters)[:MAX_CERTIFICATE]


def won_alone(certificate: Collection[SignedVote], me: str) -> bool:
    """Whether ``certificate`` (ours, empty unless we coordinate) elected ``me`` by its own vote alone:
    a lone first member, which heard no other member of the task (a fresh home while the run's
    members resume), elects itself with a roster of one. That says nothing about who coordinated the
    term in the run the others keep, so it must not refuse their chain (run/_resync.py)."""
    return bool(certificate) and all(v.vote.voter == me for v in certificate)
