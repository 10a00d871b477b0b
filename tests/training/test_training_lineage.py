"""What a chain proves to someone who took no part in the run (protocol/_lineage.py): every record
signed by a coordinator that a quorum of its members elected, attested by a quorum of them, linked
to the one before; the rules from the task, not from the chain. Real keys and signatures."""

import dataclasses

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain.testing import attestations_for, proven_chain, proven_record, votes_for
from p2ptrain.protocol import Chain, ChainRules, Misconduct, RecordError, audit, sign_record, signing
from p2ptrain.protocol._lineage import entry_bytes, first_parent
from p2ptrain.wire import ConfirmedRecord, ModelRecord

TASK = "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o"
INITIAL = "Qminit"
KEYS = [create_new_key_pair() for _ in range(6)]
PEERS = [signing.peer_str(k) for k in KEYS]
RULES = ChainRules(TASK, 2, 8)
MODELS = ["Qm1", "Qm2", "Qm3"]


def honest() -> Chain:
    return proven_chain(TASK, INITIAL, MODELS, KEYS[:4], rules=RULES)


def next_record(chain: Chain, **change) -> ModelRecord:
    last = chain.records[-1].record
    fields = dict(task_cid=TASK, version=last.version + 1, parent=last.model_cid, round=last.round + 10,
                  step=last.step + 10, members=(), metrics={}, model_cid="Qmnext", optimizer_cid="Qmnext",
                  term=last.term, coordinator="")
    fields.update(change)
    return ModelRecord(**fields)


def test_an_honest_chain_verifies_and_reads_back_with_its_proofs():
    chain = honest()
    again = Chain.from_bytes(TASK, first_parent(chain.to_bytes()), chain.to_bytes(), RULES)
    assert [s.record.model_cid for s in again.records] == MODELS
    assert all(len(p) == 3 for p in again.proofs)  # a quorum of 4 is kept, not every attestation
    assert audit(RULES, INITIAL, chain.to_bytes())[1] == []


def test_a_record_its_coordinator_attests_alone_is_refused():
    """The hostile coordinator of issue 27, as an outsider sees its chain: one member, its own vote,
    its own attestation. Under the task's peers.min = 2 it is no span at all; with two identities of
    its own it would be a span, which is what the allowlist below is for."""
    chain = honest()
    alone = proven_record(next_record(chain), KEYS[5], [KEYS[5]])
    with pytest.raises(Misconduct, match="names 1 members, the task allows 2 to 8"):
        chain.append(alone, attestations_for(alone.record, [KEYS[5]]))
    closed = ChainRules(TASK, 1, 8, allow=frozenset(PEERS[:4]))
    chain = proven_chain(TASK, INITIAL, MODELS, KEYS[:4], rules=closed)
    sybils = proven_record(next_record(chain), KEYS[4], KEYS[4:6])
    with pytest.raises(Misconduct, match="allowlist"):
        chain.append(sybils, attestations_for(sybils.record, KEYS[4:6]))


def test_a_record_short_of_a_quorum_of_attestations_is_refused():
    chain = honest()
    signed = proven_record(next_record(chain), KEYS[0], KEYS[:4])
    with pytest.raises(RecordError, match="2 of its 4 members attested it, a quorum is 3"):
        chain.append(signed, attestations_for(signed.record, KEYS[:2]))
    # Attestations of another model (a member that computed something else) do not count.
    other = dataclasses.replace(signed.record, model_cid="Qmother")
    with pytest.raises(RecordError, match="2 of its 4"):
        chain.append(signed, attestations_for(signed.record, KEYS[:2]) + attestations_for(other, KEYS[2:4]))
    chain.append(signed, attestations_for(signed.record, KEYS[1:4]))
    assert chain.version == 4


def test_a_signer_the_votes_do_not_elect_is_refused():
    chain = honest()
    record = dataclasses.replace(next_record(chain), members=tuple(PEERS[:4]))
    few = sign_record(record, KEYS[0], votes_for(TASK, record.term, PEERS[0], KEYS[:2]))
    with pytest.raises(Misconduct, match="2 valid roster votes, a quorum is 3"):
        chain.check(few)
    outsiders = sign_record(record, KEYS[0], votes_for(TASK, record.term, PEERS[0], [KEYS[0]] + KEYS[4:6]))
    with pytest.raises(Misconduct, match="1 valid roster votes"):
        chain.check(outsiders)
    for_another = sign_record(record, KEYS[0], votes_for(TASK, record.term, PEERS[1], KEYS[:4]))
    with pytest.raises(Misconduct, match="another election"):
        chain.check(for_another)
    other_term = sign_record(dataclasses.replace(record, term=record.term + 1), KEYS[0],
                             votes_for(TASK, record.term, PEERS[0], KEYS[:4]))
    with pytest.raises(Misconduct, match="another election"):
        chain.check(other_term)


def test_audit_names_every_break_one_line_each():
    chain = honest()
    entries = chain.entries
    r2 = entries[1].signed.record
    # v2: the member list changed after signing (a forged record: the signature breaks).
    forged = dataclasses.replace(entries[1].signed, record=dataclasses.replace(r2, members=tuple(PEERS[:3])))
    # v3: one attestation short of a quorum.
    short = dataclasses.replace(entries[2], attestations=entries[2].attestations[:2])
    data = b"".join(entry_bytes(e) + b"\n" for e in [entries[0], dataclasses.replace(entries[1], signed=forged), short])
    _, problems = audit(RULES, INITIAL, data)
    assert len(problems) == 2, problems
    assert problems[0].startswith("record v2 (line 2") and "bad signature" in problems[0]
    assert problems[1].startswith("record v3") and "2 of its 4 members attested it" in problems[1]
    # A wrong parent and a wrong initial model are links, named too.
    _, problems = audit(RULES, "Qmsomethingelse", chain.to_bytes())
    assert problems == [f"record v1 (line 1, model Qm1): its parent {INITIAL} is not the model before it"]
    bad_line = b"".join(entry_bytes(e) + b"\n" for e in entries[:2]) + b'{"signed":1}\n'
    _, problems = audit(RULES, INITIAL, bad_line)
    assert len(problems) == 1 and problems[0].startswith("line 3: not a chain line")


def test_a_chain_line_keeps_a_quorum_of_matching_attestations_sorted():
    chain = Chain(TASK, INITIAL, RULES)
    record = ModelRecord(task_cid=TASK, version=1, parent=INITIAL, round=9, step=10, members=(), metrics={},
                         model_cid="Qm1", optimizer_cid="Qm1", term=1, coordinator="")
    signed = proven_record(record, KEYS[0], KEYS[:5])
    given = list(reversed(attestations_for(signed.record, KEYS[:5])))
    chain.append(signed, given)
    kept = [a.attestation.attester for a in chain.proofs[0]]
    assert kept == sorted(PEERS[:5])[:3]
    assert ConfirmedRecord(signed=signed, attestations=chain.proofs[0]) == chain.entries[0]
