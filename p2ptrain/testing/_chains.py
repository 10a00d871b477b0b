"""Confirmed chains made to order: what a run of given members would have confirmed, with every
proof a verifier asks for (the coordinator's signature, the votes that elected it, a quorum of
attestations), for tests of whatever reads, serves, verifies or resyncs from a chain.

A test that needs a *bad* chain starts from one of these and breaks one thing (drop an attestation,
change a member list, re-sign with another key), so what it checks is exactly that one rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from libp2p.crypto.keys import KeyPair

from p2ptrain.protocol import Chain, ChainRules, attest, sign_record, signing
from p2ptrain.wire import ModelRecord, SignedAttestation, SignedModelRecord, SignedVote, Vote

__all__ = ["attestations_for", "proven_chain", "proven_record", "rules_task", "votes_for"]

# A dataset manifest CID a rules-only task names (the empty file's): such a task is never trained.
_NO_DATA = "QmbFMke1KXqnYyBBWxB74N4c5SBnJMVAiMNRcGu6x1AwQH"


def rules_task(
    store: Any, *, min_peers: int = 1, max_peers: int = 8, allow: Sequence[str] | None = None,
) -> tuple[str, ChainRules]:
    """Store a small task whose chains a test forges or checks (its CID and its :class:`ChainRules`):
    a reader of a chain fetches the task for its rules, as a verifier would. Never trained."""
    from p2ptrain.task import TASK_TEMPLATE, load_task, task_bytes

    text = TASK_TEMPLATE.format(manifest=_NO_DATA, steps=100, checkpoint=10, density=0.01, peers=max_peers)
    text = text.replace("min = 2", f"min = {min_peers}")
    if allow is not None:
        text += 'admission = "allowlist"\nallow = [' + ", ".join(f'"{p}"' for p in allow) + "]\n"
    task = load_task(text)
    task_cid = store.add_bytes(task_bytes(task))
    return task_cid, ChainRules.of(task, task_cid)


def votes_for(task_cid: str, term: int, candidate: str, voters: Sequence[KeyPair]) -> tuple[SignedVote, ...]:
    """Each of ``voters``' signed vote for ``candidate`` in ``term``."""
    out = []
    for key in voters:
        body = Vote(task_cid=task_cid, term=term, candidate=candidate, voter=signing.peer_str(key))
        out.append(SignedVote(vote=body, signature=signing.sign(body, key)))
    return tuple(out)


def attestations_for(record: ModelRecord, attesters: Sequence[KeyPair]) -> tuple[SignedAttestation, ...]:
    """Each of ``attesters``' attestation that its state hashes to ``record``'s CIDs."""
    return tuple(attest(record, record.model_cid, record.optimizer_cid, key) for key in attesters)


def proven_record(record: ModelRecord, coordinator: KeyPair, members: Sequence[KeyPair]) -> SignedModelRecord:
    """``record`` with ``members`` as its members, signed by ``coordinator`` (one of them), carrying
    every member's vote for it in the record's term."""
    record = replace(record, members=tuple(signing.peer_str(k) for k in members))
    votes = votes_for(record.task_cid, record.term, signing.peer_str(coordinator), members)
    return sign_record(record, coordinator, votes)


def proven_chain(
    task_cid: str, initial_cid: str, models: Sequence[str], members: Sequence[KeyPair], *,
    rules: ChainRules | None = None, interval: int = 10, term: int = 1,
) -> Chain:
    """A chain of ``task_cid`` over ``models`` (version i names models[i-1]), every record of
    ``members`` with ``members[0]`` as the elected coordinator of ``term``, checkpoints every
    ``interval`` steps, each attested by every member. ``rules`` (default: any number of members
    from 1 to 128, open admission) are checked as every record is appended."""
    rules = rules or ChainRules(task_cid, 1, 128)
    chain = Chain(task_cid, initial_cid, rules)
    for version, model in enumerate(models, start=1):
        record = ModelRecord(
            task_cid=task_cid, version=version, parent=chain.head_cid, round=version * interval - 1,
            step=version * interval, members=(), metrics={"accuracy": 0.5}, model_cid=model,
            optimizer_cid=model, term=term, coordinator="",
        )
        signed = proven_record(record, members[0], members)
        chain.append(signed, attestations_for(signed.record, members))
    return chain
