"""One member's count of the attestations for the pending checkpoint record.

After a span the coordinator publishes a signed record; each member of the span hashes its own
weights and attests what it got. A record is confirmed at a quorum of matching attestations
(:class:`~p2ptrain.protocol.Tally`) and then extends the chain. The decisions around that
count live here, not in the node, so they are testable without one: which record is taken up (it
must extend our chain, come from the coordinator we accept, and not replace one still pending),
attestations that arrive before their record (gossip takes other paths), the deadline, and whether
this member still owes its own attestation. The node only publishes, stores and reacts to the
:class:`~p2ptrain.protocol.Status` these methods return.
"""

from __future__ import annotations

import logging

from p2ptrain.base import short_id
from p2ptrain.protocol._records import RecordError, Status, Tally, verify_record
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


class Attestations:
    """The pending record's tally, when it started, and the attestations that came early."""

    def __init__(self) -> None:
        self.tally: Tally | None = None
        # With overlapping checkpoints the coordinator publishes the next record as soon as the
        # pending one settles on its side, which can be before it does here: the record that extends
        # the pending one is kept (one, the latest) and taken up when that one settles (take_next).
        self.next: SignedModelRecord | None = None
        self.started = 0.0  # when self.tally was taken up
        self._early: dict[str, list[SignedAttestation]] = {}  # record id -> attestations for it
        self.dropped_early = 0  # early attestations over the bounds, not kept

    @property
    def pending(self) -> bool:
        """Whether a record waits for its quorum."""
        return self.tally is not None and self.tally.status is Status.PENDING

    def offer_record(
        self, signed: SignedModelRecord, book: RoundBook, coordinator: str | None, now: float
    ) -> Status | None:
        """Take up ``signed`` to count attestations for it; the early ones for it are counted now.

        Returns the tally's status, or None when it is the record already taken up (nothing new).
        Raises :class:`RecordError` (one line, the reason) when it is refused: it does not extend
        ``book``'s chain (or its signer's election does not hold up), is not signed by
        ``coordinator`` (when we know one), names other members than its span's plan (or no plan of
        its span is known here: its quorum cannot be counted), or another record is pending.
        """
        if self.pending and self._extends_pending(signed, coordinator):
            self.next = signed
            return None
        record = book.chain.check(signed)
        if coordinator is not None and record.coordinator != coordinator:
            raise RecordError(f"model record v{record.version} from {short_id(record.coordinator)}, not the coordinator")
        members = book.span_members(record)
        if members is None:
            raise RecordError(f"model record v{record.version}: no plan of its span (round {record.round}, "
                              f"term {record.term}) is known here, so its quorum cannot be counted")
        tally = Tally(signed, members)
        if self.tally is not None and self.tally.id == tally.id:
            return None
        if self.pending:
            assert self.tally is not None
            raise RecordError(f"a second model record v{record.version} while v{self.tally.record.version} "
                              "is pending; keeping the first")
        self.tally, self.started = tally, now
        for early in self._early.pop(tally.id, []):
            try:
                tally.add(early)
            except RecordError as exc:
                log.warning("task %s: refused attestation: %s", record.task_cid[:12], exc)
        return tally.status

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

    def take_next(self, book: RoundBook, coordinator: str | None, now: float) -> Status | None:
        """Once the pending record settled: take up the record kept for after it (:meth:`offer_record`,
        so :class:`RecordError` when it does not extend ``book``'s chain: its parent was rejected)."""
        signed, self.next = self.next, None
        if signed is None or self.pending:
            return None
        return self.offer_record(signed, book, coordinator, now)

    def add(self, signed: SignedAttestation) -> Status | None:
        """Count one attestation: the tally's status, or None when its record has not come (kept
        for it, within the bounds). Raises :class:`RecordError` for one that is invalid or not from
        the record's members."""
        tally = self.tally
        if tally is None or signed.attestation.record_id != tally.id:
            self._keep_early(signed)
            return None
        return tally.add(signed)

    def expire(self, now: float) -> Status | None:
        """Status.REJECTED when this call rejected the pending record (ATTEST_TIMEOUT_S passed)."""
        if self.tally is not None and self.pending and now - self.started > ATTEST_TIMEOUT_S:
            return self.tally.expire()
        return None

    def due(self, me: str) -> ModelRecord | None:
        """The pending record that ``me`` is a member of and has not attested yet, else None."""
        tally = self.tally
        if tally is None or tally.status is not Status.PENDING or me not in tally.record.members:
            return None
        if me in tally.matching or me in tally.differing:
            return None
        return tally.record

    def clear(self) -> None:
        """Forget the pending record and the one kept for after it (a resync loaded a chain past them)."""
        self.tally = None
        self.next = None

    def _keep_early(self, signed: SignedAttestation) -> None:
        record_id = signed.attestation.record_id
        kept = self._early.get(record_id)
        if kept is None and len(self._early) < MAX_EARLY_RECORDS:
            kept = self._early[record_id] = []
        if kept is None or len(kept) >= MAX_EARLY_PER_RECORD:
            self.dropped_early += 1
            return
        kept.append(signed)
