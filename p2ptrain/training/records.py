"""Global models as bytes, signed records of them, attestations, and the chain of confirmed records.

Same weights must give the same bytes on every peer, because a member proves it holds the global
model by hashing its own weights to the CID the coordinator published. So a state dict is written as
safetensors with sorted names, contiguous CPU tensors and fixed metadata; nothing else goes in.
Loading uses ``safetensors.torch`` only (never ``torch.load``), after
:func:`p2ptrain.data.tensorfile.read_header` has checked the header (bounded, every byte range
inside the file), and insists on exactly the names, shapes and dtypes of a module built from the
registry. Every way a model file, record or attestation can be bad is one :class:`RecordError`.

A record is *confirmed* when a quorum (a strict majority of the round's members) attest that their
own weights hash to the record's CIDs. Confirmed records form a chain: each record's parent is the
model CID of the previous confirmed record (the first one's parent is the initial model) and versions
count up by one, so the history has no fork and no gap.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any
from enum import Enum

import safetensors.torch
import torch
from libp2p.crypto.keys import KeyPair
from torch import nn

from p2ptrain import boundedjson
from p2ptrain.data.tensorfile import TensorFileError, read_header
from p2ptrain.errors import UserError
from p2ptrain.logs import short_id
from p2ptrain.training import signing
from p2ptrain.training.signing import SignatureError
from p2ptrain.wire.messages import Attestation, ModelRecord, SignedAttestation, SignedModelRecord
from p2ptrain.wire.schema import SchemaError, from_plain, to_plain

log = logging.getLogger(__name__)

# Fixed so that metadata never differs between peers (no versions, no timestamps, no host names).
# One key only: safetensors writes the metadata map in hash order, so two keys can swap places
# between two saves of the same tensors.
_METADATA = {"format": "pt"}
MODEL_CARD_KEY = "p2ptrain.model"
# A signed record is ~1 KiB plus 60 B per member (MAX_PEERS = 128): 64 KiB is ample.
MAX_RECORD_BYTES = 64 * 1024
# A signed record nests four levels (record > metrics/members); eight refuse any bomb early.
MAX_RECORD_DEPTH = 8
# A model card is {"name": ..., "kwargs": {"hidden": [..]}}: three levels.
MAX_CARD_DEPTH = 4
# A chain's bytes (JSON lines of signed records, on disk as chain.jsonl or named by a head's
# chain_cid): 64 MiB is over a thousand checkpoints of the largest record (MAX_RECORD_BYTES) and
# ~100,000 of a typical one (~650 B), and keeps a hostile or damaged chain from being read whole.
MAX_CHAIN_BYTES = 64 * 1024 * 1024
# Records in one chain: each costs a signature check (~0.2 ms here), so 65,536 records take ~13 s of
# one worker thread at most; that is a checkpoint every 10 steps for 655,360 steps.
MAX_CHAIN_RECORDS = 65_536


class RecordError(UserError, ValueError):
    """A record, attestation or model file is invalid or does not fit the chain (one line in the CLI)."""


# --- deterministic tensor files ---------------------------------------------------------------


def tensors_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """Deterministic safetensors bytes: sorted names, contiguous CPU copies, fixed metadata."""
    ordered = {k: tensors[k].detach().to("cpu").contiguous() for k in sorted(tensors)}
    meta = dict(_METADATA if metadata is None else metadata)
    if len(meta) != 1:
        raise ValueError("deterministic safetensors take exactly one metadata key")
    return safetensors.torch.save(ordered, metadata=meta)


def model_bytes(module: nn.Module, card: Mapping[str, Any] | None = None) -> bytes:
    """The bytes whose CID names a model: its state dict as deterministic safetensors.

    ``card`` (the registry name and kwargs of the architecture) is stored as the one metadata value,
    in canonical JSON, so that a model CID alone tells :func:`p2ptrain.load_model` what to build.
    """
    return state_bytes(module.state_dict(), card)


def state_bytes(tensors: Mapping[str, torch.Tensor], card: Mapping[str, Any] | None = None) -> bytes:
    """:func:`model_bytes` of a state dict (or a copy of one): the same bytes for the same tensors."""
    if card is None:
        return tensors_bytes(tensors)
    value = boundedjson.canonical(dict(card)).decode("ascii")
    return tensors_bytes(tensors, metadata={MODEL_CARD_KEY: value})


def read_model_card(data: bytes) -> dict[str, Any] | None:
    """The architecture card in a model file's safetensors header, or None if it has none."""
    try:
        value = read_header(data).metadata.get(MODEL_CARD_KEY)
        card = boundedjson.loads(value, max_depth=MAX_CARD_DEPTH, what="model card") if value is not None else None
    except (TensorFileError, boundedjson.JSONBoundsError) as exc:
        raise RecordError(f"model file header is not valid: {exc}") from None
    if card is not None and not (isinstance(card, dict) and isinstance(card.get("name"), str)
                                 and isinstance(card.get("kwargs"), dict)):
        raise RecordError("model file card must be an object with a name and kwargs")
    return card


def read_tensors(data: bytes) -> dict[str, torch.Tensor]:
    """Parse safetensors bytes (no pickle involved); raise :class:`RecordError` if malformed.

    The header is checked by :func:`read_header` first, so safetensors only ever builds tensors
    from bytes whose every range lies inside the file.
    """
    try:
        read_header(data)
    except TensorFileError as exc:
        raise RecordError(f"not a valid safetensors file: {exc}") from None
    try:
        return safetensors.torch.load(data)
    except Exception as exc:  # safetensors raises its own error types for every malformation
        raise RecordError(f"not a valid safetensors file: {exc}") from None


def load_model_bytes(module: nn.Module, data: bytes) -> nn.Module:
    """Load deterministic safetensors bytes into ``module``, which must match them exactly."""
    tensors = read_tensors(data)
    expected = module.state_dict()
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or extra:
        raise RecordError(f"model file does not fit the architecture: missing {missing[:5]}, extra {extra[:5]}")
    for name, want in expected.items():
        got = tensors[name]
        if got.shape != want.shape or got.dtype != want.dtype:
            raise RecordError(
                f"model file tensor {name}: {tuple(got.shape)} {got.dtype}, "
                f"architecture needs {tuple(want.shape)} {want.dtype}"
            )
    module.load_state_dict(tensors, strict=True)
    return module


# --- signed records -----------------------------------------------------------------------------


def sign_record(record: ModelRecord, key_pair: KeyPair) -> SignedModelRecord:
    """Sign ``record`` as its coordinator (``record.coordinator`` is set to the signer)."""
    record = replace(record, coordinator=signing.peer_str(key_pair))
    return SignedModelRecord(record=record, signature=signing.sign(record, key_pair))


def verify_record(signed: SignedModelRecord) -> ModelRecord:
    """The record if its coordinator's signature verifies; :class:`RecordError` otherwise."""
    try:
        signing.verify(signed.record, signed.record.coordinator, signed.signature)
    except SignatureError as exc:
        raise RecordError(f"model record v{signed.record.version}: {exc}") from None
    return signed.record


def record_id(record: ModelRecord) -> str:
    """What attestations name a record by: sha256 hex of its canonical bytes."""
    return signing.body_id(record)


def record_bytes(signed: SignedModelRecord) -> bytes:
    """Canonical JSON of a signed record, for storing by CID or on disk."""
    return boundedjson.canonical(to_plain(signed))


def record_from_bytes(data: bytes) -> SignedModelRecord:
    """Parse and verify a stored signed record."""
    if len(data) > MAX_RECORD_BYTES:
        raise RecordError(f"model record of {len(data)} B is over the {MAX_RECORD_BYTES} B limit")
    try:
        plain = boundedjson.loads(data, max_depth=MAX_RECORD_DEPTH, what="model record")
        signed = from_plain(SignedModelRecord, plain, "model_record")
    except (boundedjson.JSONBoundsError, SchemaError) as exc:
        raise RecordError(f"not a model record: {exc}") from None
    verify_record(signed)
    return signed


def attest(record: ModelRecord, model_cid: str, optimizer_cid: str, key_pair: KeyPair) -> SignedAttestation:
    """Sign what our own state hashes to for ``record`` (matching or not: a mismatch is evidence too)."""
    body = Attestation(
        task_cid=record.task_cid,
        version=record.version,
        record_id=record_id(record),
        model_cid=model_cid,
        optimizer_cid=optimizer_cid,
        attester=signing.peer_str(key_pair),
    )
    return SignedAttestation(attestation=body, signature=signing.sign(body, key_pair))


def verify_attestation(signed: SignedAttestation) -> Attestation:
    try:
        signing.verify(signed.attestation, signed.attestation.attester, signed.signature)
    except SignatureError as exc:
        raise RecordError(f"attestation: {exc}") from None
    return signed.attestation


# --- confirmation ------------------------------------------------------------------------------


class Status(Enum):
    PENDING = "pending"
    CONFIRMED = "confirmed"
    REJECTED = "rejected"


def quorum(members: int) -> int:
    """A strict majority: any two quorums of the same members share at least one member."""
    return members // 2 + 1


@dataclass
class Tally:
    """Attestations collected for one signed record, from its round's members only.

    Confirmed at a quorum of matching attestations; rejected as soon as a quorum can no longer be
    reached (too many members hashed their weights to something else), or by :meth:`expire` when
    the attestation deadline passes first.
    """

    signed: SignedModelRecord
    matching: set[str] = field(default_factory=set)
    differing: dict[str, str] = field(default_factory=dict)  # attester -> the model CID it computed

    def __post_init__(self) -> None:
        self.record = verify_record(self.signed)
        self.id = record_id(self.record)
        self.status = Status.PENDING

    def add(self, signed: SignedAttestation) -> Status:
        """Count one attestation; raise :class:`RecordError` for one that is invalid or not for us."""
        att = verify_attestation(signed)
        if att.record_id != self.id or att.task_cid != self.record.task_cid:
            raise RecordError(f"attestation by {att.attester[:16]} is for another record")
        if att.attester not in self.record.members:
            raise RecordError(f"attestation by {att.attester[:16]}, not a member of round {self.record.round}")
        if att.attester in self.matching or att.attester in self.differing:
            return self.status  # one voice per member; repeats change nothing
        if (att.model_cid, att.optimizer_cid) == (self.record.model_cid, self.record.optimizer_cid):
            self.matching.add(att.attester)
        else:
            self.differing[att.attester] = att.model_cid
        self._settle()
        return self.status

    def _settle(self) -> None:
        if self.status is not Status.PENDING:
            return
        need = quorum(len(self.record.members))
        if len(self.matching) >= need:
            self.status = Status.CONFIRMED
        elif len(self.record.members) - len(self.differing) < need:
            self._reject("a quorum can no longer reproduce it")

    def expire(self) -> Status:
        """The deadline passed: a record still short of a quorum is rejected."""
        if self.status is Status.PENDING:
            self._reject("the attestation deadline passed")
        return self.status

    def _reject(self, why: str) -> None:
        self.status = Status.REJECTED
        r = self.record
        log.warning(
            "task %s: model record v%d (%s, round %d, coordinator %s) rejected: %s; "
            "%d of %d members reproduced it, %d computed other CIDs %s",
            r.task_cid[:12], r.version, r.model_cid, r.round, short_id(r.coordinator), why,
            len(self.matching), len(r.members), len(self.differing), sorted(set(self.differing.values()))[:3],
        )


class Chain:
    """The confirmed history of one task: versions 1, 2, … each the child of the one before."""

    def __init__(self, task_cid: str, initial_cid: str) -> None:
        self.task_cid = task_cid
        self.initial_cid = initial_cid
        self.records: list[SignedModelRecord] = []

    @property
    def version(self) -> int:
        return len(self.records)

    @property
    def head_cid(self) -> str:
        """The latest confirmed model CID (the initial model before any record)."""
        return self.records[-1].record.model_cid if self.records else self.initial_cid

    def check(self, signed: SignedModelRecord) -> ModelRecord:
        """Verify ``signed`` and that it extends the chain; :class:`RecordError` names fork or gap."""
        r = verify_record(signed)
        if r.version < 1:
            raise RecordError(f"model record v{r.version}: versions start at 1")
        if r.task_cid != self.task_cid:
            raise RecordError(f"model record v{r.version} belongs to task {r.task_cid[:16]}")
        if r.version <= self.version:
            held = self.records[r.version - 1].record if r.version >= 1 else None
            if held is not None and record_id(held) == record_id(r):
                raise RecordError(f"model record v{r.version} is already in the chain")
            raise RecordError(f"fork: a different model record v{r.version} is already confirmed")
        if r.version != self.version + 1:
            raise RecordError(f"gap: model record v{r.version} after v{self.version}")
        if r.parent != self.head_cid:
            raise RecordError(
                f"fork: model record v{r.version} has parent {r.parent}, the chain's head is {self.head_cid}"
            )
        return r

    def extension(self, other: Chain) -> list[SignedModelRecord]:
        """The records ``other`` adds to this chain, which must be a prefix of it: the same records
        at every version this chain holds. A different record at a version we confirmed is a fork
        (:class:`RecordError`); a shorter chain adds nothing (an empty list)."""
        if (other.task_cid, other.initial_cid) != (self.task_cid, self.initial_cid):
            raise RecordError("fork: the chain starts from another task or initial model")
        for mine, theirs in zip(self.records, other.records):
            if record_id(mine.record) != record_id(theirs.record):
                raise RecordError(f"fork: a different model record v{mine.record.version} than the one confirmed here")
        return other.records[self.version:]

    def append(self, signed: SignedModelRecord) -> None:
        """Add a confirmed record (checked by :meth:`check` again)."""
        self.check(signed)
        self.records.append(signed)

    def to_bytes(self) -> bytes:
        """JSON lines of the signed records, oldest first."""
        return b"".join(record_bytes(s) + b"\n" for s in self.records)

    @classmethod
    def from_bytes(cls, task_cid: str, initial_cid: str, data: bytes) -> Chain:
        """Rebuild and re-verify a chain saved by :meth:`to_bytes` (at most :data:`MAX_CHAIN_BYTES`
        and :data:`MAX_CHAIN_RECORDS`); every way it can be bad is a :class:`RecordError`."""
        if len(data) > MAX_CHAIN_BYTES:
            raise RecordError(f"chain of {len(data)} B is over the {MAX_CHAIN_BYTES} B limit")
        lines = [line for line in data.splitlines() if line.strip()]
        if len(lines) > MAX_CHAIN_RECORDS:
            raise RecordError(f"chain of {len(lines)} records is over the {MAX_CHAIN_RECORDS} record limit")
        chain = cls(task_cid, initial_cid)
        for line in lines:
            chain.append(record_from_bytes(line))
        return chain
