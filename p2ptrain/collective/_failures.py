"""What a failed all-reduce round raises.

Every failure names one peer, so the caller can drop it and retry on a new ring. A round fails as a
whole: no partial result is ever returned.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from libp2p.peer.id import ID

from p2ptrain.base import short_id


class CollectiveError(Exception):
    """An all-reduce round could not complete (bad arguments, disagreement, or a peer failure)."""


class PeerFailed(CollectiveError):
    """A peer died, stalled past a deadline, or sent something we refuse to sum.

    ``peer_id`` is the peer to blame; ``reported_by`` is the peer that saw it when the news came in an
    abort notice rather than from our own neighbour. ``gone``: its channel broke or it could not be
    reached, so it is dead or has left the round (rather than silent, late or misbehaving).
    """

    def __init__(self, peer_id: ID, reason: str, *, reported_by: ID | None = None, gone: bool = False) -> None:
        self.peer_id = peer_id
        self.reason = reason
        self.reported_by = reported_by
        self.gone = gone
        via = f" (reported by {short_id(reported_by)})" if reported_by is not None else ""
        super().__init__(f"peer {short_id(peer_id)} failed: {reason}{via}")


class BadPayload(PeerFailed):
    """A peer sent a malformed frame: wrong round, step, length, dtype, NaN/Inf, or bad indices."""


class Misbehaved(PeerFailed):
    """A peer's well-formed bytes are proven wrong by this member's own check in a robust round: an
    owner whose chunk is not the reduction of its contributions, a member that sent different bytes
    to different members (equivocation), a signature that its claimed signer never made
    (:mod:`p2ptrain.collective._witness`)."""


@contextmanager
def single_failure() -> Iterator[None]:
    """Turn a nursery's exception group into the one failure a caller can act on.

    trio wraps even a single child's exception in a group; callers of a round want one
    :class:`PeerFailed` naming one peer. The first PeerFailed wins, then the first other exception.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        leaves = list(_leaves(group))
        for leaf in leaves:
            if isinstance(leaf, PeerFailed):
                raise leaf from None
        for leaf in leaves:
            if isinstance(leaf, Exception):
                raise leaf from None
        raise


def _leaves(error: BaseException) -> Iterator[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            yield from _leaves(inner)
    else:
        yield error
