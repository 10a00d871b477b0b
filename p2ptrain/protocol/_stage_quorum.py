"""Which files a pipelined run's manifest names for each stage: those a quorum of *that stage's*
planned replicas signed (issue 31, docs/pipeline.md "Checkpoints").

No member can check a stage it does not hold: it has neither the weights nor the optimizer state.
So a stage's entry cannot be what one member (the stage's first replica, a chunk's owner in a sum)
says; it is the CIDs that a strict majority of the stage's replicas in the span's plan each signed
(:class:`~p2ptrain.wire.StageStatement`, its bytes declared in ``wire/_stage_statements.py``,
gathered by ``Collective.gather``). The replicas come from the plan,
never from a statement or its sender; a statement from a member the plan puts in another stage
counts for nothing and is named. Anyone holding the signed statements can check an entry (:func:`signed_entry_problem`):
they travel in the manifest itself, with the stage's planned replicas, so whoever verifies a chain
checks them without any member's help.

Pure: the runtime (run/_stage_checkpoints.py) gathers the statements and acts on the verdicts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from libp2p.crypto.keys import KeyPair

from p2ptrain.base import short_id
from p2ptrain.protocol import signing
from p2ptrain.protocol._records import quorum
from p2ptrain.wire import SignedStageStatement, StageStatement


def sign_statement(task_cid: str, step: int, stage: int, cids: tuple[str, str],
                   key_pair: KeyPair) -> SignedStageStatement:
    """This member's signed statement that its stage ``stage`` at ``step`` is the files ``cids``
    (model, optimizer)."""
    statement = StageStatement(task_cid=task_cid, step=step, stage=stage, model_cid=cids[0],
                               optimizer_cid=cids[1], replica=signing.peer_str(key_pair))
    return SignedStageStatement(statement=statement, signature=signing.sign(statement, key_pair))


def check_statement(signed: SignedStageStatement, sender: str) -> StageStatement:
    """The statement, once it is signed by its replica, who is ``sender`` (a member speaks for
    itself only): :class:`~p2ptrain.protocol.signing.SignatureError` otherwise."""
    statement = signed.statement
    if statement.replica != sender:
        raise signing.SignatureError(f"a statement in the name of {short_id(statement.replica)}")
    signing.verify(statement, statement.replica, signed.signature)
    return statement


@dataclass(frozen=True)
class StageVerdict:
    """What a stage's planned replicas signed: the CIDs a quorum of them signed (None: no quorum,
    so no checkpoint), the first quorum of signatures of them in plan order (what the manifest
    carries), and each replica that signed something else, with what."""

    stage: int
    replicas: tuple[str, ...]
    cids: tuple[str, str] | None
    signatures: tuple[tuple[str, str], ...] = ()
    dissent: dict[str, tuple[str, str]] = field(default_factory=dict)
    silent: tuple[str, ...] = ()


def stage_verdicts(rings: Sequence[Sequence[str]], statements: Mapping[str, SignedStageStatement]
                   ) -> tuple[list[StageVerdict], dict[str, str]]:
    """Every stage's verdict from ``statements`` (signer -> its checked statement, all of one task
    and step) against ``rings`` (each stage's replicas in the plan's order); and the signers whose
    statement the plan does not allow (a member that signed for a stage the plan does not put it
    in, or a peer in no stage), with why. Deterministic: members that received the same
    statements compute the same verdicts, so the same manifest."""
    stage_of = {member: i for i, ring in enumerate(rings) for member in ring}
    strangers: dict[str, str] = {}
    for signer, signed in statements.items():
        claimed = signed.statement.stage
        if stage_of.get(signer) != claimed:
            where = f"the plan puts it in stage {stage_of[signer]}" if signer in stage_of else "it is in no stage"
            strangers[signer] = f"signed stage {claimed}'s files, but {where}"
    verdicts = []
    for i, ring in enumerate(rings):
        said = {r: _cids(statements[r]) for r in ring if r in statements and r not in strangers}
        counts = Counter(said.values())
        top = max(counts.items(), key=lambda kv: (kv[1], kv[0]), default=None)
        if top is None or top[1] < quorum(len(ring)):
            verdicts.append(StageVerdict(i, tuple(ring), None, dissent=said,
                                         silent=tuple(r for r in ring if r not in said)))
            continue
        cids = top[0]
        signers = [r for r in ring if said.get(r) == cids][: quorum(len(ring))]
        verdicts.append(StageVerdict(
            i, tuple(ring), cids, tuple((r, statements[r].signature) for r in signers),
            {r: c for r, c in said.items() if c != cids}, tuple(r for r in ring if r not in said)))
    return verdicts, strangers


def signed_entry_problem(task_cid: str, step: int, stage: int, cids: tuple[str, str], replicas: Sequence[str],
                         signatures: Sequence[tuple[str, str]]) -> str | None:
    """Why a manifest's entry for ``stage`` is not backed by a quorum of ``replicas`` signing
    ``cids`` at ``step`` of ``task_cid`` (None: it is). The caller checks that ``replicas`` are
    the stage's replicas (a manifest's replicas together are its record's members)."""
    signers = [signer for signer, _ in signatures]
    if len(set(signers)) != len(signers) or not set(signers) <= set(replicas):
        return f"stage {stage}'s signatures are not each of a different replica of the stage"
    need = quorum(len(replicas))
    if len(signers) < need:
        return f"stage {stage}'s files are signed by {len(signers)} of its {len(replicas)} replicas, not a quorum ({need})"
    for signer, signature in signatures:
        statement = StageStatement(task_cid=task_cid, step=step, stage=stage, model_cid=cids[0],
                                   optimizer_cid=cids[1], replica=signer)
        try:
            signing.verify(statement, signer, signature)
        except signing.SignatureError as exc:
            return f"stage {stage}'s files: {exc}"
    return None


def _cids(signed: SignedStageStatement) -> tuple[str, str]:
    return (signed.statement.model_cid, signed.statement.optimizer_cid)
