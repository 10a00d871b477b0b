"""One member's count of the attestations for the pending checkpoint record.

After a span the coordinator publishes a signed record; each member of the span hashes its own
weights and attests what it got. A record is confirmed at a quorum of matching attestations
(:class:`~p2ptrain.protocol.Tally`) and then extends the chain. The decisions around that
count live here, not in the node, so they are testable without one: which record is taken up (it
must extend our chain, come from the coordinator we accept, and not replace one still pending),
attestations that arrive before their record (gossip takes other paths), the deadline, whether
this member still owes its own attestation, and the two rules that keep one history when members'
deadlines disagree (below). The node only publishes, stores and reacts to the tallies these
methods return.

A deadline is a guess about the network, not about the record: a quorum that came in time at one
member can come late at another, and both see the same signed attestations in the end. So a record
rejected by the deadline alone stays *open* here (:attr:`Attestations.open`): its quorum still
confirms it when it comes, even once the coordinator has taken up the record after it (whose
version it then takes: that one is set aside). And an attestation binds: a member that attested a
record does not attest another record of the same version and parent (a sibling) for
``BINDING_DEADLINES`` deadlines after (:meth:`Attestations.bound_to`), so two siblings cannot both
gather a quorum of honest members (two quorums share a member) while either may still be confirmed
somewhere. A tests/runtime/test_early_votes.py run at load ~4 split so: the coordinator's deadline
passed before the other member's attestation came, that member confirmed v1, and the coordinator's
next v1 was refused by it as a fork for as long as the run lasted.
"""

from __future__ import annotations

import logging
import math

from p2ptrain.base import short_id
from p2ptrain.protocol._lineage import Chain
from p2ptrain.protocol._records import RecordError, Status, Tally, record_id, verify_attestation, verify_record
from p2ptrain.protocol._round_book import RoundBook
from p2ptrain.wire import ModelRecord, SignedAttestation, SignedModelRecord

log = logging.getLogger(__name__)

# A record short of a quorum of attestations by then is rejected (the checkpoint barrier opens and
# training goes on; the next checkpoint tries again). Members attest after their span ends, up to a
# start timeout (15 s) apart, plus storing the state: 20 s.
ATTEST_TIMEOUT_S = 20.0
# Attestations that come before their record are kept until it comes: for at most this many record
# ids (the one about to be published and a few stale or forged ones)...
MAX_EARLY_RECORDS = 8
# ...and at most this many for each (task.MAX_PEERS = 128 members, with room for repeats). Anyone
# on the topic can send them, unverified until counted: the bound keeps that to ~8 x 1024 small
# messages (a few MiB).
MAX_EARLY_PER_RECORD = 1024
# Records kept open for a late quorum (rejected by the deadline alone, or a sibling of the pending
# record sent by a member that confirmed it): the oldest goes first. Each holds one tally (a quorum
# of attestations at most, ~0.5 KiB each).
MAX_OPEN = 4
# An attestation binds its attester this many deadlines (ATTEST_TIMEOUT_S, read when used) after
# it was sent: long enough for an attestation that missed one member's deadline to reach it (the
# split above came seconds late), short enough that a record nobody else will ever attest (its
# members died, or their last round failed) holds a member back for one or two checkpoints only.
BINDING_DEADLINES = 2
# A fork of a record this member confirmed is answered with that record and its proof (a quorum of
# attestations) at most once per this long, whatever the version: an honest coordinator is one
# record behind at most, and publishes one record per checkpoint.
ANSWER_EVERY_S = ATTEST_TIMEOUT_S


class Attestations:
    """The pending record's tally, when it started, the records kept open for a late quorum, this
    member's own attestations (what binds it), and the attestations that came early."""

    def __init__(self) -> None:
        self.tally: Tally | None = None
        # With overlapping checkpoints the coordinator publishes the next record as soon as the
        # pending one settles on its side, which can be before it does here: the record that extends
        # the pending one is kept (one, the latest) and taken up when that one settles (take_next).
        self.next: SignedModelRecord | None = None
        self.started = 0.0  # when self.tally was taken up
        self.open: list[Tally] = []  # confirmable by a quorum that comes late (MAX_OPEN, oldest first)
        self._attested: dict[tuple[int, str], tuple[str, float]] = {}  # (version, parent) -> (record id, when)
        self._early: dict[str, list[SignedAttestation]] = {}  # record id -> attestations for it
        self.dropped_early = 0  # early attestations over the bounds, not kept
        self._settled = 0  # the last version whose early attestations were dropped (_passed)

    @property
    def pending(self) -> bool:
        """Whether a record waits for its quorum."""
        return self.tally is not None and self.tally.status is Status.PENDING

    def offer_record(
        self, signed: SignedModelRecord, book: RoundBook, coordinator: str | None, now: float
    ) -> Tally | None:
        """Take up ``signed`` to count attestations for it; the early ones for it are counted now.

        Returns its tally, or None when it is a record taken up already or kept for after the pending
        one (nothing new). Raises :class:`RecordError` (one line, the reason) when it is refused: it
        does not extend ``book``'s chain (or its signer's election does not hold up), names other
        members than its span's plan (or no plan of its span is known here: its quorum cannot be
        counted), or is not signed by ``coordinator`` (when we know one: records are taken from the
        coordinator only, but one that the attestations that came before it confirm already:
        :meth:`_proven`). One that comes while another is pending is kept open (:attr:`open`): a
        member that confirmed it sends it to a coordinator that missed its quorum; refused while no
        coordinator is known.
        """
        self._passed(book.chain.version)
        if self.pending and self._extends_pending(signed, coordinator):
            self.next = signed
            return None
        if self._tally_of(record_id(signed.record)) is not None:
            return None
        record = book.chain.check(signed)
        foreign = None
        if coordinator is not None and record.coordinator != coordinator:
            foreign = f"model record v{record.version} from {short_id(record.coordinator)}, not the coordinator"
        elif coordinator is None and self.pending:
            # Between terms: a peer elected in an earlier term (the one just given up) could have its
            # sibling of the pending record kept open, attested, and confirmed over the pending one,
            # while members that already follow the next coordinator refuse it.
            foreign = (f"model record v{record.version} from {short_id(record.coordinator)} while another "
                       "is pending and no coordinator is known here: not kept open")
        members = book.span_members(record)
        if members is None:
            raise RecordError(foreign or f"model record v{record.version}: no plan of its span (round {record.round}, "
                              f"term {record.term}) is known here, so its quorum cannot be counted")
        tally = Tally(signed, members)
        if foreign is not None:
            return self._proven(tally, foreign)
        if self.pending:
            self._keep_open(tally)
        else:
            previous = self.tally
            if previous is not None and previous.status is Status.REJECTED and previous.expired:
                self._keep_open(previous)
            elif previous is not None and previous.status is Status.REJECTED:
                self._release(previous)
            self.tally, self.started = tally, now
        self._count_early(tally)
        self._early.pop(tally.id, None)
        if tally is self.tally and tally.status is Status.CONFIRMED:
            self._passed(record.version)
        return tally

    def _proven(self, tally: Tally, refusal: str) -> Tally:
        """A record not from the coordinator we follow (``refusal`` says why) is taken as a proof only:
        confirmed already by a quorum of its plan's attestations that came before it, which a member
        answering a fork sends first (run/_attesting.py). A coordinator elected after that record's
        quorum missed it (its messages lost) refused it from the members that confirmed it, and the
        run stayed split. Kept open, CONFIRMED, for the run to take; :class:`RecordError` otherwise
        (never attested here, never pending: records are taken from the coordinator only)."""
        self._count_early(tally)  # (kept, unless they confirm it: counted again if it is taken up later)
        if tally.status is not Status.CONFIRMED:
            raise RecordError(refusal)
        del self._early[tally.id]
        self._keep_open(tally)
        return tally

    def _count_early(self, tally: Tally) -> None:
        """Count into ``tally`` the attestations that came before its record (they stay kept)."""
        for early in self._early.get(tally.id, []):
            try:
                tally.add(early)
            except RecordError as exc:
                log.warning("task %s: refused attestation: %s", tally.record.task_cid[:12], exc)

    def _extends_pending(self, signed: SignedModelRecord, coordinator: str | None) -> bool:
        """Whether ``signed`` is the record after the pending one (its child, the next version),
        signed by ``coordinator``: checked in full against the chain when it is taken up."""
        assert self.tally is not None
        pending, record = self.tally.record, signed.record
        if (record.version, record.parent) != (pending.version + 1, pending.model_cid):
            return False
        if coordinator is None or record.coordinator != coordinator:
            return False
        verify_record(signed)  # a forged one must not take the slot of the coordinator's
        return True

    def take_next(self, book: RoundBook, coordinator: str | None, now: float) -> Tally | None:
        """Once the pending record settled: take up the record kept for after it (:meth:`offer_record`,
        so :class:`RecordError` when it does not extend ``book``'s chain: its parent was rejected)."""
        signed, self.next = self.next, None
        if signed is None or self.pending:
            return None
        return self.offer_record(signed, book, coordinator, now)

    def add(self, signed: SignedAttestation, book: RoundBook | None = None) -> Tally | None:
        """Count one attestation: the tally it counted in (the pending record's or an open one's),
        or None when its record has not come (kept for it, within the bounds; with ``book``, only
        a signed one of a version past its chain's, by a member of a span plan known here). Raises
        :class:`RecordError` for one that is invalid or not from the record's members."""
        tally = self._tally_of(signed.attestation.record_id)
        if tally is None:
            if book is None or _may_come(signed, book):
                self._keep_early(signed)
            else:
                self.dropped_early += 1
            return None
        tally.add(signed)
        if tally is self.tally and tally.status is Status.CONFIRMED:
            self._passed(tally.record.version)
        elif tally is not self.tally and _ruled_out(tally):
            self.open.remove(tally)
            self._release(tally)
        return tally

    def expire(self, now: float) -> Tally | None:
        """The pending record's tally when this call rejected it (ATTEST_TIMEOUT_S passed); it stays
        confirmable by a quorum that comes later."""
        if self.tally is not None and self.pending and now - self.started > ATTEST_TIMEOUT_S:
            self.tally.expire()
            return self.tally
        return None

    def confirmed_late(self, tally: Tally, version: int) -> Tally | None:
        """An open ``tally`` reached its quorum and the chain took its record as ``version``: forget the
        records that can no longer extend the chain. Returns the pending record's tally when it was
        one of them (a sibling: its checkpoint counts as rejected), which is set aside with the
        record kept for after it."""
        self._passed(version)  # (``tally`` among the records it forgets: its version is ``version``)
        pending = self.tally
        if pending is None or pending.record.version > version:
            return None
        self.tally = self.next = None
        return pending

    def owed(self, me: str) -> list[ModelRecord]:
        """The records that ``me`` is a member of and has not attested: the pending one first (also
        once its deadline passed), then the open ones. A late attestation still counts: a matching
        one may confirm a record after all, and one of other CIDs rules it out, which frees those
        it binds (a member whose last round failed had its state only after the deadline, and the
        coordinator stayed bound to a record that member could never attest)."""
        tallies = [t for t in (self.tally, *self.open)
                   if t is not None and t.status is not Status.CONFIRMED and not _ruled_out(t)]
        return [t.record for t in tallies if me in t.members and me not in t.matching and me not in t.differing]

    def attesting(self, record: ModelRecord, now: float) -> None:
        """This member attests that its state is ``record``'s now: it is bound to it (:meth:`bound_to`).
        An attestation of other CIDs binds nothing: it never counts towards a quorum."""
        self._attested = {key: held for key, held in self._attested.items() if not self._lapsed(held, now)}
        self._attested.setdefault((record.version, record.parent), (record_id(record), now))

    def bound_to(self, record: ModelRecord, now: float) -> tuple[str, float] | None:
        """The id of the sibling of ``record`` (same version and parent) whose state this member
        attested, and when, if that still binds it: it may be confirmed somewhere, so attesting
        ``record``'s too could confirm two records of one version. None when this member may. A
        sibling binds for BINDING_DEADLINES deadlines, and no longer once the attestations counted
        here rule it out (a quorum of its members computed something else)."""
        held = self._attested.get((record.version, record.parent))
        if held is None or held[0] == record_id(record) or self._lapsed(held, now):
            return None
        tally = self._tally_of(held[0])
        return None if tally is not None and _ruled_out(tally) else held

    def clear(self) -> None:
        """Forget the pending record, the one kept for after it and the open ones (a resync loaded
        another chain)."""
        self.tally = None
        self.next = None
        self.open = []
        self._settled = 0

    @staticmethod
    def _lapsed(held: tuple[str, float], now: float) -> bool:
        return now - held[1] > BINDING_DEADLINES * ATTEST_TIMEOUT_S

    def _release(self, tally: Tally) -> None:
        """``tally``'s record was ruled out by its attestations: it binds nobody any more."""
        self._attested = {key: held for key, held in self._attested.items() if held[0] != tally.id}

    def _tally_of(self, rid: str) -> Tally | None:
        for tally in (self.tally, *self.open):
            if tally is not None and tally.id == rid:
                return tally
        return None

    def _passed(self, version: int) -> None:
        """Records up to ``version`` are settled here: forget the open ones (siblings that can no
        longer extend the chain) and the early attestations of any record of such a version.
        An open sibling outliving the pending record's confirmation stayed owed, and once the
        binding lapsed this member attested a sibling of the record it confirmed (a second
        verifiable record of that version, of honest attestations); an early attestation of a
        settled record (the last member's, after the quorum; a fork answer's proof) held its slot
        for good, and after MAX_EARLY_RECORDS of them every early attestation was dropped."""
        self.open = [t for t in self.open if t.record.version > version]
        if version > self._settled:  # (each attestation kept looked at once per version, not per message)
            self._settled = version
            self._early = {rid: kept for rid, held in self._early.items()
                           if (kept := [a for a in held if a.attestation.version > version])}

    def _keep_open(self, tally: Tally) -> None:
        self.open.append(tally)
        del self.open[:-MAX_OPEN]

    def _keep_early(self, signed: SignedAttestation) -> None:
        record_id = signed.attestation.record_id
        kept = self._early.get(record_id)
        if kept is None and len(self._early) >= MAX_EARLY_RECORDS:
            # Full: the record furthest ahead gives way to a nearer one (the next records come
            # first; anyone on the topic can sign attestations of records of any version to come).
            furthest = max(self._early, key=lambda rid: self._early[rid][0].attestation.version)
            if self._early[furthest][0].attestation.version > signed.attestation.version:
                self.dropped_early += len(self._early.pop(furthest))
        if kept is None and len(self._early) < MAX_EARLY_RECORDS:
            kept = self._early[record_id] = []
        if kept is None or len(kept) >= MAX_EARLY_PER_RECORD:
            self.dropped_early += 1
            return
        kept.append(signed)


def _may_come(signed: SignedAttestation, book: RoundBook) -> bool:
    """Whether an attestation whose record has not come here may be counted when it comes: of a
    version past the chain's, signed by a member of a span plan this member holds (a record of
    another span is never taken up). Anyone on the topic can sign attestations of made-up records:
    eight of them a checkpoint kept every early attestation out."""
    att = signed.attestation
    if att.version <= book.chain.version or not any(att.attester in p.members for p in book.span_plans.values()):
        return False
    verify_attestation(signed)  # (the attester named is who signed it)
    return True


def _ruled_out(tally: Tally) -> bool:
    """Whether ``tally``'s record can never be confirmed: its attestations, not a deadline, rejected it."""
    return tally.status is Status.REJECTED and not tally.expired


class ForkAnswers:
    """When this member answers a fork with the record it confirmed at that version and its proof.

    The coordinator we follow published a sibling of a record confirmed here: it missed that
    record's quorum and goes on from the model before it, which splits the run for good unless
    it gets the proof (it keeps the record open and confirms it, :class:`Attestations`). An
    answer is a quorum's worth of messages from each member that confirmed the record, so it is
    sent for the coordinator's own publication only (the message's sender, which the mesh
    checked: anyone could send the coordinator's signed sibling again, and each one made every
    such member answer) and at most once per ANSWER_EVERY_S in all (per version, an elected
    coordinator cycling siblings of more versions than were remembered got an answer for each).
    """

    def __init__(self) -> None:
        self.last = -math.inf  # when this member last answered

    def due(self, chain: Chain, signed: SignedModelRecord, sender: str, coordinator: str | None,
            now: float) -> int | None:
        """The version of ``chain`` to send with its proof in answer to ``signed``, refused as a
        fork; None when no answer is due (not the coordinator's own, too soon, or its parent is
        not ours: its chain parted from ours earlier, past what one record mends)."""
        record = signed.record
        if coordinator is None or sender != coordinator or record.coordinator != coordinator:
            return None
        if not 1 <= record.version <= chain.version or now - self.last < ANSWER_EVERY_S:
            return None
        parent = chain.records[record.version - 2].record.model_cid if record.version > 1 else chain.initial_cid
        if record.parent != parent:
            return None
        self.last = now
        return record.version
