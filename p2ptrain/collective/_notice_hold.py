"""Abort notices from the owner of a chunk that is being checked wait for its verifier's verdict.

Every member believes an abort notice from any member of its round at once (:mod:`._round_hub`):
that is what lets a member that was merely waiting on a healthy neighbour fail within milliseconds
naming the true culprit. In a sampled round (:mod:`._sampling`) it also let an owner escape its
check: it learns at CONFIRM that its chunk is drawn, and ends the round with a notice naming an
honest member before its verifier has recomputed the chunk (issue 27; docs/collective.md, "Abort
notices while a drawn chunk is checked"). So from the moment a member learns that chunk c is drawn
(its verifier's CONFIRM; as the verifier, when it sends its own), the notices of c's owner are *held*, not
acted on, until the verifier's verdict on c:

- its CHECKED (c is the reduction it claims), or, as the verifier, our own check passing and our
  CHECKED sent: the owner is *released*, and a notice of its that we hold is acted on now;
- an abort notice from the verifier naming the owner: the owner is *named*; its notices are dropped
  (counted) for the rest of the round;
- an abort notice from the verifier naming anyone else (the check could not be made: a contributor
  withheld its copy, or the round failed elsewhere first): the owner is released.

A held owner's notices are not dropped at once because an honest owner's notice may be true (it saw
a member crash); a verifier's verdict on its own owner is the one report an owner cannot forge or
pre-empt. Holding every member's notices from the start of a round instead would turn every
crash-fault blame into a timeout. :class:`RoundLinks` asks :meth:`NoticeHold.resolved` before
blaming a held peer whose channel broke: the held notice may explain the break once released.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

import trio
from libp2p.peer.id import ID

from p2ptrain.base import count_rejection, short_id
from p2ptrain.collective._failures import PeerFailed

logger = logging.getLogger(__name__)


class NoticeHold:
    """One member's held abort notices in one round, shared by its hub (notices on their own
    streams) and its :class:`RoundLinks` (notices in-band, and channel breaks)."""

    def __init__(self, me: ID, apply: Callable[[PeerFailed], None], refused: collections.Counter[str]) -> None:
        self._me = me
        self._apply = apply  # ends the round with this failure (if it is still running)
        self._refused = refused
        self._verifier: dict[ID, ID] = {}  # held owner -> the verifier whose verdict ends the hold
        self._kept: dict[ID, PeerFailed] = {}  # held owner -> the first notice it sent while held
        self._named: set[ID] = set()  # owners named by their verifier: their notices never count
        self._resolved: dict[ID, trio.Event] = {}

    def hold(self, owner: ID, verifier: ID) -> None:
        """Hold ``owner``'s notices until ``verifier``'s verdict on its chunk (idempotent)."""
        if owner != self._me and owner not in self._resolved:
            self._verifier[owner] = verifier
            self._resolved[owner] = trio.Event()

    def release(self, owner: ID) -> None:
        """``owner``'s chunk was checked: its notices count again, and a held one is acted on now."""
        if self._verifier.pop(owner, None) is None:
            return
        self._resolved[owner].set()
        kept = self._kept.pop(owner, None)
        if kept is not None:
            logger.info("collective: acting on %s's held notice: %s", short_id(owner), kept)
            self._apply(kept)

    def notice(self, reporter: ID, failure: PeerFailed) -> None:
        """An abort notice from ``reporter``, a member of the round: acted on now, unless
        ``reporter`` is held (kept) or was named by its verifier (dropped); then it is taken as
        ``reporter``'s verdict on every held owner whose chunk it verifies."""
        if reporter in self._named:
            count_rejection(self._refused, "abort_from_named_owner", logger, logging.INFO,
                            "collective: dropped a notice from %s, named by its verifier: %s", short_id(reporter),
                            failure)
        elif reporter in self._verifier:
            count_rejection(self._refused, "abort_held", logger, logging.INFO,
                            "collective: holding a notice from %s until its chunk is checked: %s",
                            short_id(reporter), failure)
            self._kept.setdefault(reporter, failure)
        else:
            self._apply(failure)
        for owner, verifier in list(self._verifier.items()):
            if verifier != reporter:
                continue
            if failure.peer_id == owner:
                self._name(owner)
            else:
                self.release(owner)

    def _name(self, owner: ID) -> None:
        del self._verifier[owner]
        self._named.add(owner)
        self._resolved[owner].set()
        kept = self._kept.pop(owner, None)
        if kept is not None:
            count_rejection(self._refused, "abort_from_named_owner", logger, logging.INFO,
                            "collective: dropped the held notice of %s, named by its verifier: %s", short_id(owner),
                            kept)

    def holds(self, peer: ID) -> bool:
        """Whether ``peer``'s notices do not count now (held, or named by its verifier)."""
        return peer in self._verifier or peer in self._named

    def keeps(self, peer: ID) -> bool:
        """Whether a notice of ``peer``'s is held here, waiting for another member's verdict."""
        return peer in self._kept and self._verifier.get(peer) != self._me

    async def resolved(self, peer: ID) -> None:
        """Until ``peer``'s hold ends (released: its notice acted on, which cancels the round; or
        named by its verifier)."""
        await self._resolved[peer].wait()
