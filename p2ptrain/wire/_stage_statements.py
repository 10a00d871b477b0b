"""A replica's signed stage statement: its part of a pipelined checkpoint's gather (issue 31,
docs/pipeline.md "Checkpoints").

'At ``step`` of task ``task_cid`` my stage ``stage``'s files hash to these CIDs', with the replica's
detached Ed25519 signature (:mod:`p2ptrain.protocol.signing`, whose domain tag names the class, so
the class keeps its name). It travels as canonical JSON inside a ``Collective.gather`` and again
inside the stage manifest, so its bytes are a contract with peers running older code. Only the
layout lives here; who signs what and which statements count (``sign_statement``,
``check_statement``, the verdicts) stay in ``protocol/_stage_quorum.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from p2ptrain.base import boundedjson
from p2ptrain.wire._messages import _CID, _SIG
from p2ptrain.wire._schema import from_plain, SchemaError, to_plain

# A signed statement's canonical bytes: two CIDs, a task CID and a peer ID of at most 128
# characters each, a signature of 128, the field names: under 1 KiB.
MAX_STATEMENT_BYTES = 1024


@dataclass(frozen=True)
class StageStatement:
    """A replica's statement in a pipelined run: 'at ``step`` of task ``task_cid`` my stage
    ``stage``'s files hash to these CIDs'."""

    task_cid: str = field(metadata=_CID)
    step: int
    stage: int
    model_cid: str = field(metadata=_CID)
    optimizer_cid: str = field(metadata=_CID)
    replica: str = field(metadata=_CID)


@dataclass(frozen=True)
class SignedStageStatement:
    """A statement with its replica's detached signature (:mod:`p2ptrain.protocol.signing`)."""

    statement: StageStatement
    signature: str = field(metadata=_SIG)


class StatementError(ValueError):
    """Bytes that are not a signed stage statement (the one error of :func:`read_statement`)."""


def statement_bytes(signed: SignedStageStatement) -> bytes:
    """What a member puts in the checkpoint's gather: its signed statement's canonical JSON (the
    same bytes ``protocol.signing.canonical_bytes`` gives)."""
    return boundedjson.canonical(to_plain(signed))


def read_statement(raw: bytes) -> SignedStageStatement:
    """A member's part of the gather: :class:`StatementError` for anything that is not a signed
    statement of this shape within :data:`MAX_STATEMENT_BYTES` (its signature is checked by
    ``protocol.check_statement``)."""
    try:
        plain = boundedjson.loads(raw, max_bytes=MAX_STATEMENT_BYTES, max_depth=3, what="stage statement")
        return from_plain(SignedStageStatement, plain)
    except (boundedjson.JSONBoundsError, SchemaError) as exc:
        raise StatementError(str(exc)) from None
