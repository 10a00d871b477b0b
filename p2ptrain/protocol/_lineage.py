"""The confirmed history of a task, and the proof that makes it believable to whoever took no part.

A record is confirmed when a quorum of its span's planned members attest that their own weights
hash to its CIDs. A chain keeps, with every record, what that confirmation rests on, so that anyone
can check it later without having seen the run (``p2ptrain model verify``, ``model fetch --latest``,
a member loading a head's chain):

- the coordinator's signature on the record;
- the votes that elected the coordinator in the record's term (carried in the signed record): a
  quorum of the record's members, each vote signed by its voter;
- the matching attestations of a quorum of the record's members, each signed by its attester
  (:class:`~p2ptrain.wire.ConfirmedRecord`, one line of the chain);
- links: versions count up from 1, each record's parent is the model of the one before (the
  first one's the run's initial model), steps, rounds and terms move forward.

The rules of that check come from the task, never from the chain being checked
(:class:`ChainRules`): how many members a span has at least and at most, and, for a task with
``admission = "allowlist"``, who may be one. A record's member list itself is the coordinator's
word: members that took part hold the span's plan and refuse a record whose members differ from it
(:mod:`p2ptrain.protocol._attestations`); an outsider has only the record. So for a task with open
admission a chain proves that a quorum of the identities it names signed it, not that those
identities are distinct people: docs/security.md says what follows from that.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from p2ptrain.base import boundedjson
from p2ptrain.protocol._records import (
    MAX_RECORD_DEPTH,
    Fork,
    Misconduct,
    RecordError,
    quorum,
    record_id,
    verify_attestation,
    verify_record,
)
from p2ptrain.task import Task
from p2ptrain.protocol._voters import certificate_problem
from p2ptrain.wire import (
    ConfirmedRecord,
    CoordinatorBeat,
    ModelRecord,
    SchemaError,
    SignedAttestation,
    SignedModelRecord,
    from_plain,
    to_plain,
)

# One chain line: a record (~1 KiB + 60 B a member), its certificate and its attestations (~450 B
# each, a quorum of at most task.MAX_PEERS = 128 members): 256 KiB holds the largest with room.
MAX_ENTRY_BYTES = 256 * 1024
# A chain's bytes (on disk as chain.jsonl, or named by a head's chain_cid): 64 MiB is ~16,000
# checkpoints of a 4-member run (~4 KiB a line) and keeps a hostile or damaged chain from being read
# whole.
MAX_CHAIN_BYTES = 64 * 1024 * 1024
# Records in one chain: each costs a few signature checks (~0.2 ms each here), so 65,536 records of
# a small run take under a minute of one worker thread; that is a checkpoint every 10 steps for
# 655,360 steps.
MAX_CHAIN_RECORDS = 65_536


@dataclass(frozen=True)
class ChainRules:
    """What a chain of ``task_cid`` must satisfy, taken from the task (never from the chain)."""

    task_cid: str
    min_members: int
    max_members: int
    allow: frozenset[str] | None = None  # admission = "allowlist": the only possible members

    @classmethod
    def of(cls, task: Task, task_cid: str) -> ChainRules:
        allow = frozenset(task.peers.allow) if task.peers.allow is not None else None
        return cls(task_cid, task.peers.min, task.peers.max, allow)


# --- one record's proof -------------------------------------------------------------------------


def members_problem(record: ModelRecord, rules: ChainRules) -> str | None:
    """Why ``record``'s member list cannot be a span's, or None: distinct, within the task's
    bounds, only admitted peers, and the coordinator among them."""
    members = record.members
    if len(set(members)) != len(members):
        return "its members are not distinct"
    if not rules.min_members <= len(members) <= rules.max_members:
        return f"it names {len(members)} members, the task allows {rules.min_members} to {rules.max_members}"
    if rules.allow is not None:
        outsiders = sorted(m for m in members if m not in rules.allow)
        if outsiders:
            return f"it names {len(outsiders)} member(s) the task's allowlist does not, e.g. {outsiders[0]}"
    if record.coordinator not in members:
        return "its signer is not one of its members"
    return None


def election_problem(signed: SignedModelRecord, rules: ChainRules) -> str | None:
    """Why the votes ``signed`` carries do not elect its signer in its term, or None: a quorum of
    the record's members voted for it (each vote's signature checked)."""
    r = signed.record
    beat = CoordinatorBeat(task_cid=rules.task_cid, term=r.term, coordinator=r.coordinator, votes=signed.votes)
    problem = certificate_problem(rules.task_cid, beat, r.members)
    return None if problem is None else f"its signer's election: {problem}"


def attestation_problem(record: ModelRecord, attestations: Iterable[SignedAttestation]) -> str | None:
    """Why ``attestations`` do not confirm ``record``, or None: a quorum of its members signed that
    their own state hashes to its model and optimizer CIDs."""
    rid, need = record_id(record), quorum(len(record.members))
    members = set(record.members)
    agreed: set[str] = set()
    for signed in attestations:
        a = signed.attestation
        if a.attester in agreed or a.attester not in members:
            continue
        if (a.task_cid, a.version, a.record_id, a.model_cid, a.optimizer_cid) != (
            record.task_cid, record.version, rid, record.model_cid, record.optimizer_cid
        ):
            continue
        try:
            verify_attestation(signed)
        except RecordError:
            return f"the attestation of {a.attester[:16]} has a bad signature"
        agreed.add(a.attester)
    if len(agreed) < need:
        return f"{len(agreed)} of its {len(members)} members attested it, a quorum is {need}"
    return None


def record_problems(signed: SignedModelRecord, rules: ChainRules) -> list[str]:
    """What is wrong with a record before its attestations: signature, task, members, election."""
    try:
        r = verify_record(signed)
    except RecordError as exc:
        return [str(exc)]
    if r.task_cid != rules.task_cid:
        return [f"it belongs to task {r.task_cid[:16]}"]
    return [p for p in (members_problem(r, rules), election_problem(signed, rules)) if p is not None]


def proof(record: ModelRecord, attestations: Iterable[SignedAttestation]) -> tuple[SignedAttestation, ...]:
    """The attestations a chain keeps for ``record``: a quorum of its members' matching ones,
    sorted by attester, so that the same set gives the same bytes."""
    rid = record_id(record)
    by_attester: dict[str, SignedAttestation] = {}
    for signed in attestations:
        a = signed.attestation
        if (a.record_id, a.model_cid, a.optimizer_cid) == (rid, record.model_cid, record.optimizer_cid):
            by_attester.setdefault(a.attester, signed)
    kept = [by_attester[p] for p in sorted(by_attester) if p in record.members]
    return tuple(kept[: quorum(len(record.members))])


# --- chain lines --------------------------------------------------------------------------------


def entry_bytes(entry: ConfirmedRecord) -> bytes:
    """Canonical JSON of one chain line (without its newline)."""
    return boundedjson.canonical(to_plain(entry))


def entry_from_bytes(data: bytes) -> ConfirmedRecord:
    """Parse one chain line, its record's signature checked; :class:`RecordError` for anything else."""
    entry = parse_entry(data)
    verify_record(entry.signed)
    return entry


def parse_entry(data: bytes) -> ConfirmedRecord:
    """One chain line's structure (bounded, schema-checked), no signature checked yet: for a reader
    that reports a bad signature as one break among others (:func:`audit`)."""
    if len(data) > MAX_ENTRY_BYTES:
        raise RecordError(f"chain line of {len(data)} B is over the {MAX_ENTRY_BYTES} B limit")
    try:
        plain = boundedjson.loads(data, max_depth=MAX_RECORD_DEPTH, what="chain line")
        return from_plain(ConfirmedRecord, plain, "chain_line")
    except (boundedjson.JSONBoundsError, SchemaError) as exc:
        raise RecordError(f"not a chain line: {exc}") from None


def chain_lines(data: bytes) -> list[bytes]:
    """A chain's non-empty lines, within MAX_CHAIN_BYTES and MAX_CHAIN_RECORDS."""
    if len(data) > MAX_CHAIN_BYTES:
        raise RecordError(f"chain of {len(data)} B is over the {MAX_CHAIN_BYTES} B limit")
    lines = [line for line in data.splitlines() if line.strip()]
    if len(lines) > MAX_CHAIN_RECORDS:
        raise RecordError(f"chain of {len(lines)} records is over the {MAX_CHAIN_RECORDS} record limit")
    return lines


# --- the chain ----------------------------------------------------------------------------------


class Chain:
    """The confirmed history of one task: versions 1, 2, … each the child of the one before.

    With ``rules`` (a member's own chain, any chain from the network) every record added must carry
    its proof (:func:`record_problems`, :func:`attestation_problem`). Without (a chain read back from
    this home's own disk by a tool that does not know the task: ``repo gc``, ``task report``) only
    signatures and links are checked.
    """

    def __init__(self, task_cid: str, initial_cid: str, rules: ChainRules | None = None) -> None:
        if rules is not None and rules.task_cid != task_cid:
            raise ValueError("a chain's rules must be its own task's")
        self.task_cid = task_cid
        self.initial_cid = initial_cid
        self.rules = rules
        self.records: list[SignedModelRecord] = []
        self.proofs: list[tuple[SignedAttestation, ...]] = []  # the attestations kept for each record

    @property
    def version(self) -> int:
        return len(self.records)

    @property
    def head_cid(self) -> str:
        """The latest confirmed model CID (the initial model before any record)."""
        return self.records[-1].record.model_cid if self.records else self.initial_cid

    @property
    def entries(self) -> list[ConfirmedRecord]:
        return [ConfirmedRecord(signed=s, attestations=p) for s, p in zip(self.records, self.proofs)]

    def check(self, signed: SignedModelRecord) -> ModelRecord:
        """Verify ``signed`` and that it extends the chain (and, with rules, its members and its
        signer's election); :class:`RecordError` names the first problem, a fork or a gap."""
        r = verify_record(signed)
        if r.version < 1:
            raise RecordError(f"model record v{r.version}: versions start at 1")
        if r.task_cid != self.task_cid:
            raise RecordError(f"model record v{r.version} belongs to task {r.task_cid[:16]}")
        if r.version <= self.version:
            held = self.records[r.version - 1].record
            if record_id(held) == record_id(r):
                raise RecordError(f"model record v{r.version} is already in the chain")
            raise Fork(f"fork: a different model record v{r.version} is already confirmed")
        if r.version != self.version + 1:
            raise RecordError(f"gap: model record v{r.version} after v{self.version}")
        problem = link_problem(self.records[-1].record if self.records else None, self.initial_cid, r)
        if problem is not None:
            fork = r.parent != self.head_cid
            raise (Fork if fork else RecordError)(f"{'fork: ' if fork else ''}model record v{r.version}: {problem}")
        if self.rules is not None:
            problems = record_problems(signed, self.rules)
            if problems:
                raise Misconduct(f"model record v{r.version}: {problems[0]}")
        return r

    def holds(self, record: ModelRecord) -> bool:
        """Whether ``record`` itself is confirmed here (at its version, the same record id)."""
        return 1 <= record.version <= self.version \
            and record_id(self.records[record.version - 1].record) == record_id(record)

    def extension(self, other: Chain) -> list[SignedModelRecord]:
        """The records ``other`` adds to this chain, which must be a prefix of it: the same records
        at every version this chain holds. A different record at a version we confirmed is a fork
        (:class:`RecordError`); a shorter chain adds nothing (an empty list)."""
        if (other.task_cid, other.initial_cid) != (self.task_cid, self.initial_cid):
            raise RecordError("fork: the chain starts from another task or initial model")
        for mine, theirs in zip(self.records, other.records):
            if record_id(mine.record) != record_id(theirs.record):
                raise Fork(f"fork: a different model record v{mine.record.version} than the one confirmed here")
        return other.records[self.version:]

    def append(self, signed: SignedModelRecord, attestations: Sequence[SignedAttestation] = ()) -> None:
        """Add a confirmed record with the attestations that confirmed it (checked by :meth:`check`
        again, and with rules the attestations must make a quorum)."""
        record = self.check(signed)
        kept = proof(record, attestations)
        if self.rules is not None:
            problem = attestation_problem(record, kept)
            if problem is not None:
                raise RecordError(f"model record v{record.version}: {problem}")
        self.records.append(signed)
        self.proofs.append(kept)

    def to_bytes(self, since: int = 0) -> bytes:
        """JSON lines of the confirmed records with their proofs, oldest first; ``since``: only
        those past version ``since`` (what a file holding that many lines lacks)."""
        return b"".join(entry_bytes(e) + b"\n" for e in self.entries[since:])

    @classmethod
    def from_bytes(cls, task_cid: str, initial_cid: str, data: bytes, rules: ChainRules | None = None) -> Chain:
        """Rebuild and re-verify a chain saved by :meth:`to_bytes` (at most :data:`MAX_CHAIN_BYTES`
        and :data:`MAX_CHAIN_RECORDS`); every way it can be bad is a :class:`RecordError`."""
        chain = cls(task_cid, initial_cid, rules)
        for line in chain_lines(data):
            entry = entry_from_bytes(line)
            chain.append(entry.signed, entry.attestations)
        return chain


def read_chain(task_cid: str, data: bytes, rules: ChainRules | None = None) -> Chain:
    """:meth:`Chain.from_bytes` of a chain whose initial model is what its first record names (a
    chain a head named, or one on disk, read by whoever cannot rebuild the initial model)."""
    return Chain.from_bytes(task_cid, first_parent(data) if data.strip() else "", data, rules)


def link_problem(previous: ModelRecord | None, initial_cid: str, record: ModelRecord) -> str | None:
    """Why ``record`` cannot follow ``previous`` (None: it is the first, after ``initial_cid``):
    its parent is the previous model, and step, round and term do not go back."""
    if record.parent != (previous.model_cid if previous else initial_cid):
        return f"its parent {record.parent} is not the model before it"
    if previous is None:
        return None
    if record.step <= previous.step or record.round <= previous.round:
        return f"its step {record.step} (round {record.round}) is not after v{previous.version}'s {previous.step}"
    if record.term < previous.term:
        return f"its term {record.term} is before v{previous.version}'s {previous.term}"
    return None


def first_parent(data: bytes) -> str:
    """The initial model a chain's first record names as its parent (a fetcher's starting point
    when it cannot rebuild the initial model itself)."""
    lines = chain_lines(data)
    if not lines:
        raise RecordError("an empty chain")
    return entry_from_bytes(lines[0]).signed.record.parent


def audit(rules: ChainRules, initial_cid: str, data: bytes) -> tuple[list[ConfirmedRecord], list[str]]:
    """Every break in a chain's bytes, one line each (``model verify``), and the records read.

    Unlike :meth:`Chain.from_bytes`, which stops at the first problem, this goes on to the end,
    judging each record on its own proof and against the record before it.
    """
    try:
        lines = chain_lines(data)
    except RecordError as exc:
        return [], [str(exc)]
    entries: list[ConfirmedRecord] = []
    problems: list[str] = []
    previous: ModelRecord | None = None
    for number, line in enumerate(lines, start=1):
        try:
            entry = parse_entry(line)
        except RecordError as exc:
            problems.append(f"line {number}: {exc}")
            continue
        r = entry.signed.record
        where = f"record v{r.version} (line {number}, model {r.model_cid})"
        found = [] if r.version == number else [f"its version should be {number}"]
        link = link_problem(previous, initial_cid, r)
        found += [link] if link is not None else []
        try:
            verify_record(entry.signed)
        except RecordError as exc:
            found.append(str(exc))  # a forged record: what else it claims is noise
        else:
            found += record_problems(entry.signed, rules)
            attested = attestation_problem(r, entry.attestations)
            found += [attested] if attested is not None else []
        problems += [f"{where}: {p}" for p in found]
        entries.append(entry)
        previous = r
    if not lines:
        problems.append("the chain has no record")
    return entries, problems
