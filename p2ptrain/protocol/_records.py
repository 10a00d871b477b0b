"""Global models as bytes, signed records of them, attestations, and the chain of confirmed records.

Same weights must give the same bytes on every peer, because a member proves it holds the global
model by hashing its own weights to the CID the coordinator published. So a state dict is written as
safetensors with sorted names, contiguous CPU tensors and fixed metadata; nothing else goes in.
Loading uses ``safetensors.torch`` only (never ``torch.load``), after
:func:`p2ptrain.base.read_header` has checked the header (bounded, every byte range
inside the file), and insists on exactly the names, shapes and dtypes of a module built from the
registry. Every way a model file, record or attestation can be bad is one :class:`RecordError`.

A record is *confirmed* when a quorum (a strict majority of the span's planned members) attest that
their own weights hash to the record's CIDs (:class:`Tally`). Confirmed records form a chain
(:mod:`p2ptrain.protocol._lineage`): each record's parent is the model CID of the previous confirmed
record (the first one's parent is the initial model) and versions count up by one, so the history
has no fork and no gap.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any
from enum import Enum
from pathlib import Path

import safetensors.torch
import torch
from libp2p.crypto.keys import KeyPair
from torch import nn

from p2ptrain.base import TensorFileError, UserError, boundedjson, read_header, short_id
from p2ptrain.protocol import signing
from p2ptrain.protocol.signing import SignatureError
from p2ptrain.wire import Attestation, ModelRecord, SignedAttestation, SignedModelRecord, SignedVote

log = logging.getLogger(__name__)

# Fixed so that metadata never differs between peers (no versions, no timestamps, no host names).
# One key only: safetensors writes the metadata map in hash order, so two keys can swap places
# between two saves of the same tensors.
_METADATA = {"format": "pt"}
MODEL_CARD_KEY = "p2ptrain.model"
# A chain line nests five levels (line > attestations > attestation > body > field); eight refuse
# any bomb early.
MAX_RECORD_DEPTH = 8
# A model card is {"name": ..., "kwargs": {"hidden": [..]}}: three levels.
MAX_CARD_DEPTH = 4


class RecordError(UserError, ValueError):
    """A record, attestation or model file is invalid or does not fit the chain (one line in the CLI)."""


class Misconduct(RecordError):
    """A validly signed record that breaks the run's rules (members other than its span's plan, a
    signer the votes it carries do not elect): evidence against its signer, not a lost message."""


class Fork(RecordError):
    """A record that cannot extend the chain because the chain confirmed another one at its version
    (or holds another model where it names its parent): whoever sent it follows a different history
    (a member that confirmed a record the coordinator missed sends it that record's proof: run/_attesting.py)."""


# --- deterministic tensor files ---------------------------------------------------------------


def tensors_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """Deterministic safetensors bytes: sorted names, contiguous CPU copies, fixed metadata."""
    return safetensors.torch.save(*_canonical(tensors, metadata))


def _canonical(tensors: Mapping[str, torch.Tensor],
               metadata: Mapping[str, str] | None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    ordered = {k: tensors[k].detach().to("cpu").contiguous() for k in sorted(tensors)}
    meta = dict(_METADATA if metadata is None else metadata)
    if len(meta) != 1:
        raise ValueError("deterministic safetensors take exactly one metadata key")
    return ordered, meta


def model_bytes(module: nn.Module, card: Mapping[str, Any] | None = None) -> bytes:
    """The bytes whose CID names a model: its state dict as deterministic safetensors.

    ``card`` (the registry name and kwargs of the architecture) is stored as the one metadata value,
    in canonical JSON, so that a model CID alone tells :func:`p2ptrain.load_model` what to build.
    """
    return state_bytes(module.state_dict(), card)


def state_bytes(tensors: Mapping[str, torch.Tensor], card: Mapping[str, Any] | None = None) -> bytes:
    """:func:`model_bytes` of a state dict (or a copy of one): the same bytes for the same tensors."""
    return tensors_bytes(tensors, _card_metadata(card))


def _card_metadata(card: Mapping[str, Any] | None) -> dict[str, str] | None:
    return None if card is None else {MODEL_CARD_KEY: boundedjson.canonical(dict(card)).decode("ascii")}


def write_state_file(path: Path, tensors: Mapping[str, torch.Tensor], card: Mapping[str, Any] | None = None) -> None:
    """:func:`state_bytes` written to ``path`` (not atomically: a scratch file), from the tensors'
    own memory: no copy of the file is made in memory (a pipelined member hashes every stage's
    initial file this way, and ``state_bytes`` holds three copies at once)."""
    ordered, meta = _canonical(tensors, _card_metadata(card))
    safetensors.torch.save_file(ordered, str(path), metadata=meta)


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
    module.load_state_dict(model_tensors(module, data), strict=True)
    return module


def model_tensors(module: nn.Module, data: bytes) -> dict[str, torch.Tensor]:
    """The tensors of a model file that fits ``module`` exactly (names, shapes, dtypes), checked and
    not loaded: a caller that loads more than the model (its optimizer state) checks everything
    before it changes anything. :class:`RecordError` otherwise."""
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
    return tensors


# --- signed records -----------------------------------------------------------------------------


def sign_record(record: ModelRecord, key_pair: KeyPair, votes: Sequence[SignedVote] = ()) -> SignedModelRecord:
    """Sign ``record`` as its coordinator (``record.coordinator`` is set to the signer), with the
    ``votes`` that elected it in the record's term (see :func:`certificate`)."""
    record = replace(record, coordinator=signing.peer_str(key_pair))
    return SignedModelRecord(record=record, signature=signing.sign(record, key_pair), votes=tuple(votes))


def certificate(votes: Sequence[SignedVote], members: Sequence[str]) -> tuple[SignedVote, ...]:
    """The votes a record carries: those of its members, one each, sorted by voter, a quorum of the
    members at most (more proves nothing more, and a record's bytes stay small)."""
    by_voter: dict[str, SignedVote] = {}
    for vote in votes:
        if vote.vote.voter in members:
            by_voter.setdefault(vote.vote.voter, vote)
    return tuple(by_voter[v] for v in sorted(by_voter))[: quorum(len(members))]


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
    """Attestations collected for one signed record, from the members of its span's plan only.

    ``members`` is the plan's member list, which every member of the span holds: never the record's
    own, which its signer wrote (a record naming only its coordinator confirmed itself 1/1 before).
    A record whose members differ from the plan's is refused at once. Confirmed at a quorum of
    matching attestations; rejected as soon as a quorum can no longer be reached (too many members
    hashed their weights to something else), or by :meth:`expire` when the attestation deadline
    passes first; a record the deadline alone rejected is confirmed still if its quorum comes later.
    """

    signed: SignedModelRecord
    members: tuple[str, ...]
    matching: dict[str, SignedAttestation] = field(default_factory=dict)  # attester -> its attestation
    differing: dict[str, str] = field(default_factory=dict)  # attester -> the model CID it computed
    expired: bool = False  # rejected by the deadline alone (expire), not by the attestations

    def __post_init__(self) -> None:
        self.record = verify_record(self.signed)
        if tuple(self.record.members) != tuple(self.members):
            raise Misconduct(f"model record v{self.record.version} names {len(self.record.members)} members, "
                              f"not the {len(self.members)} its span's plan put in the round")
        self.id = record_id(self.record)
        self.status = Status.PENDING

    def add(self, signed: SignedAttestation) -> Status:
        """Count one attestation; raise :class:`RecordError` for one that is invalid or not for us."""
        att = verify_attestation(signed)
        # The version too, as the chain's proof check does (attestation_problem): a member's matching
        # attestation naming another version made a quorum here that Chain.append then refused
        # (raising out of the attestation handler; the record never confirmed at that member).
        if (att.record_id, att.task_cid, att.version) != (self.id, self.record.task_cid, self.record.version):
            raise RecordError(f"attestation by {att.attester[:16]} is for another record")
        if att.attester not in self.members:
            raise RecordError(f"attestation by {att.attester[:16]}, not a member of round {self.record.round}")
        if att.attester in self.matching or att.attester in self.differing:
            return self.status  # one voice per member; repeats change nothing
        if (att.model_cid, att.optimizer_cid) == (self.record.model_cid, self.record.optimizer_cid):
            self.matching[att.attester] = signed
        else:
            self.differing[att.attester] = att.model_cid
        self._settle()
        return self.status

    def _settle(self) -> None:
        # A record rejected only because this member's deadline passed is still confirmed by a
        # quorum of matching attestations that comes later: that quorum is what confirmation is (the
        # chain's rules check signatures, not times), and a member that counted it in time holds
        # the record confirmed. Staying rejected here split the run: in a suite at load ~4 the
        # coordinator's deadline passed before the other member's attestation came, that member
        # confirmed v1, and refused every later v1 of the coordinator as a fork.
        if self.status is Status.CONFIRMED or (self.status is Status.REJECTED and not self.expired):
            return
        need = quorum(len(self.members))
        if len(self.matching) >= need:
            if self.status is Status.REJECTED:
                log.info("task %s: model record v%d confirmed after its attestation deadline, by %d of %d members",
                         self.record.task_cid[:12], self.record.version, len(self.matching), len(self.members))
            self.status = Status.CONFIRMED
        elif len(self.members) - len(self.differing) < need:
            if self.status is Status.PENDING:
                self._reject("a quorum can no longer reproduce it")
            self.expired = False  # ruled out by its attestations now, not by a deadline: for good

    def outvoted(self) -> str | None:
        """The model CID that a quorum of the plan's members attested instead of the record's, if
        any: its signer named a model the span did not compute. Each of those attestations is
        signed, so every member that counts them comes to the same answer (a coordinator that signs
        a well-formed record of the plan's members and a model nobody trained is refused so, not
        only by the record's rules)."""
        computed: dict[str, int] = {}
        for cid in self.differing.values():
            computed[cid] = computed.get(cid, 0) + 1
            if computed[cid] >= quorum(len(self.members)):
                return cid
        return None

    def expire(self) -> Status:
        """The deadline passed: a record still short of a quorum is rejected, until a quorum of
        matching attestations comes after all (:meth:`add` then confirms it)."""
        if self.status is Status.PENDING:
            self.expired = True
            self._reject("the attestation deadline passed")
        return self.status

    def _reject(self, why: str) -> None:
        self.status = Status.REJECTED
        r = self.record
        log.warning(
            "task %s: model record v%d (%s, round %d, coordinator %s) rejected: %s; "
            "%d of %d members reproduced it, %d computed other CIDs %s",
            r.task_cid[:12], r.version, r.model_cid, r.round, short_id(r.coordinator), why,
            len(self.matching), len(self.members), len(self.differing), sorted(set(self.differing.values()))[:3],
        )
