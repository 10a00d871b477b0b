"""A member left behind at a run's end: when it asks the mesh for the run's head, and which head heard
while it knows no coordinator it may load. Pure: the caller passes the time and what it knows.

A finished run's coordinator publishes no heads any more, and a member of a run under way acts on a
head only from the coordinator its election accepted (run/_resync.py, ``head_problem``: a stranger's
head of v10^9 heard between terms once stalled a run). A member that only follows the run's records
(left out of the plans for its arithmetic, or one more than ``peers.max``) and missed the last ones
was stuck so: at v2 after the run ended at v3, it heard no head, stood in term after term with
nobody to vote, and never ended ``done`` (tests/runtime/test_mixed_arithmetic.py, once in a suite).

Such a member asks (:class:`HeadAsking`: a :class:`~p2ptrain.wire.HeadRequest`, which the run's
finished members answer, services/_head_answers.py) and takes an answer from one of the run's own
members (:class:`HeadOffers`), but loads what it names only if every record its chain adds is one
this member would have taken live (:func:`witness_problem`): of a span whose plan it accepted from
the coordinator its election accepted, signed by that coordinator. The chain's own proofs (votes,
a quorum of attestations) are checked as for any head; a stranger's head is refused unread, and a
chain made of a stranger's own identities adds records of no span this member saw.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence

from p2ptrain.base import short_id
from p2ptrain.protocol._lineage import MAX_CHAIN_BYTES, MAX_ENTRY_BYTES
from p2ptrain.wire import ModelRecord, SignedModelRecord, TaskHead

# A member that knows of a later version than it holds (it refused the coordinator's record vN as a
# gap) asks as soon as no coordinator is known; one that knows of none once no coordinator was heard
# for QUIET_S (a few election terms of 3 heartbeats: an honest run elects one within a term or two).
# Then again after ASK_EVERY_S, doubling up to ASK_MAX_EVERY_S: finished members answer one request
# per task per second (services/_head_answers.py), and a run that simply waits for peers, or one
# nobody answers for, costs the mesh (and the log) one small message per 30 s.
ASK_EVERY_S = 2.0
QUIET_S = 10.0
ASK_MAX_EVERY_S = 30.0
# Heads are taken as answers this long after this member's own request (an answering member reads
# its chain from disk first; a loaded box took seconds): no other head is tried, whoever sends it.
ANSWER_WAIT_S = 5.0
# A member of the run whose offered head could not be loaded is not tried again for this long.
RETRY_SENDER_S = 30.0
# Senders remembered for that (the run's members: peers.max is at most 1024).
MAX_FAILED_SENDERS = 1024


class HeadAsking:
    """When to ask the mesh for the run's head: only while no coordinator is known, at once when a
    later version is known, else after QUIET_S; then at doubling intervals."""

    def __init__(self) -> None:
        self.later = 0  # the latest version this member knows the run confirmed (note_later)
        self._quiet_since: float | None = None  # since when no coordinator is known
        self._last = -math.inf  # when it last asked
        self._every = ASK_EVERY_S  # the wait after the last ask

    def note_later(self, version: int) -> None:
        """The coordinator this member follows signed record ``version``, which it could not take
        (a gap: it missed the ones before)."""
        self.later = max(self.later, version)

    def awaiting(self, now: float) -> bool:
        """Whether a head heard now answers this member's own request (ANSWER_WAIT_S since it asked)."""
        return now - self._last <= ANSWER_WAIT_S

    def due(self, now: float, *, version: int, coordinator_known: bool) -> bool:
        """Whether to ask now, holding model ``version``; True counts as asking at ``now``."""
        if coordinator_known:
            self._quiet_since, self._last, self._every = None, -math.inf, ASK_EVERY_S
            return False
        if self._quiet_since is None:
            self._quiet_since = now
        if self.later <= version and now - self._quiet_since < QUIET_S:
            return False
        if now - self._last < self._every:
            return False
        if self._last > -math.inf:
            self._every = min(2 * self._every, ASK_MAX_EVERY_S)
        self._last = now
        return True


class HeadOffers:
    """Heads heard while no coordinator is known: the latest one of each member of the run, tried one
    at a time, the latest version first, each sender in its retry wait after a failure.

    One per sender, not one in all: a hostile member of the run that answered the same request with
    a later version (or the same, later) displaced the honest answer, which was then not tried until
    the next request (2 to 30 s later). Now the honest answer is tried as soon as the hostile one
    failed. A sender's latest head replaces its earlier one, so a sender holds one place."""

    def __init__(self) -> None:
        self._offers: dict[str, TaskHead] = {}  # sender -> its latest head offered (last offered last)
        self._failed: dict[str, float] = {}  # sender -> when its offer last failed

    def offer(self, now: float, sender: str, head: TaskHead, *, version: int, most: int, roster: Collection[str],
              asked: bool) -> str | None:
        """Keep ``head`` from ``sender`` to try, or say why not (it is then ignored): only while it
        may answer this member's own request (``asked``, :meth:`HeadAsking.awaiting`), from a member
        of the run (``roster``: the members of the latest plan this member accepted and of its
        chain's last record), naming a later version than ``version``, the one held here, by at most
        ``most`` (:func:`witnessable`: one record per span whose plan
        this member holds past its chain; a chain that adds more holds a record it cannot take,
        :func:`witness_problem`, so it is refused unread, before its chain is fetched and verified)."""
        if not asked:
            return "while no coordinator is known, and this member did not ask for the run's head"
        if sender not in roster:
            return f"from {short_id(sender)}, not a member of the run, while no coordinator is known"
        if head.version <= version:
            return f"model v{head.version} is not after this member's v{version}"
        if head.version > version + most:
            return (f"model v{head.version} from {short_id(sender)} is more than {most} record(s) past this member's "
                    f"v{version}, as many as it holds the plans of spans to witness")
        failed = self._failed.get(sender)
        if failed is not None and now - failed < RETRY_SENDER_S:
            return f"from {short_id(sender)}, whose last head could not be loaded"
        self._offers.pop(sender, None)  # a sender holds one place (roster members: at most 1024)
        self._offers[sender] = head
        return None

    def take(self, version: int) -> tuple[str, TaskHead] | None:
        """The head to try now (sender, head), or None: the latest version offered after ``version``
        (the one held now), of equal ones the last offered; taken: it is not offered again."""
        for sender in [s for s, h in self._offers.items() if h.version <= version]:
            del self._offers[sender]  # nothing new any more (an earlier offer was loaded)
        if not self._offers:
            return None
        sender = max(reversed(self._offers), key=lambda s: self._offers[s].version)
        return sender, self._offers.pop(sender)

    def clear(self) -> None:
        """A coordinator is known again: its heads are the ones to act on."""
        self._offers.clear()

    def failed(self, now: float, sender: str) -> None:
        """``sender``'s head could not be loaded: not tried again for RETRY_SENDER_S."""
        self._failed.pop(sender, None)
        while len(self._failed) >= MAX_FAILED_SENDERS:
            del self._failed[next(iter(self._failed))]
        self._failed[sender] = now


def witnessable(span_ends: Collection[int], head_step: int) -> int:
    """How many records a head's chain could add that a member would take with no coordinator known
    (:func:`witness_problem`): one per span whose plan it holds (``span_ends``, the end steps of
    ``RoundBook.span_plans``, at most KEPT_SPAN_PLANS) ending past its chain's head (``head_step``)."""
    return sum(1 for end in span_ends if end > head_step)


def witnessed_chain_limits(version: int, most: int) -> tuple[int, int]:
    """The most records and bytes of a chain named by a head heard with no coordinator known, to
    this member holding ``version`` and the plans of ``most`` spans past it (as
    :meth:`HeadOffers.offer`): the records it holds and those it could witness, each line at most
    ``MAX_ENTRY_BYTES``. Before, a member of the run could name a chain of its own identities of
    65,536 records (64 MiB), which the member left behind fetched and verified whole (about a minute
    of signature checks) before it found the first record it had not witnessed."""
    records = version + most
    return records, min(MAX_CHAIN_BYTES, records * (MAX_ENTRY_BYTES + 1))


def witness_problem(records: Sequence[SignedModelRecord], span_members: Callable[[ModelRecord], tuple[str, ...] | None],
                    coordinators: Mapping[int, str]) -> str | None:
    """Why a member that knows no coordinator cannot take ``records`` (those a head's chain adds to
    its own, each verified already under the task's rules), or None: each must end a span whose plan
    this member accepted (``span_members``, :meth:`~p2ptrain.protocol.RoundBook.span_members`),
    name exactly its members, and be signed by the coordinator its election accepted for the
    record's term (``coordinators``). Its quorum of attestations is then a quorum of that plan's
    members, as for a record taken live."""
    for signed in records:
        r = signed.record
        members = span_members(r)
        if members is None:
            return f"model record v{r.version}: this member holds no plan of its span (term {r.term}, round {r.round})"
        if tuple(r.members) != members:
            return f"model record v{r.version} names other members than its span's plan"
        if coordinators.get(r.term) != r.coordinator:
            return f"model record v{r.version} of term {r.term} is not signed by a coordinator this member accepted"
    return None
