"""A stage's manifest entry is what a quorum of *its* planned replicas signed (issue 31, F1): the
verdicts every member computes from the signed statements, and the check anyone reading a chain
makes of a manifest (``check_stage_signatures``), with real Ed25519 keys."""

from __future__ import annotations

import dataclasses

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain.protocol import check_statement, sign_statement, stage_verdicts
from p2ptrain.protocol.signing import peer_str, SignatureError
from p2ptrain.training import check_stage_signatures, manifest_bytes, ManifestError, read_manifest, StageFile
from p2ptrain.wire import ModelRecord

from .conftest import CID as TASK

KEYS = [create_new_key_pair(bytes([i]) * 32) for i in range(5)]
A, B, C, D, E = (peer_str(k) for k in KEYS)
RINGS = [(A, B, C), (D, E)]  # stage 0: three replicas (a quorum is 2), stage 1: two (a quorum is 2)
STEP = 10
GOOD = [("QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o", "QmYwAPJzv5CZsnA625s3Xf2nemtYgPpHdWEz79ojWnPbdG"),
        ("bafkreihdwdcefgh4dqkjv67uzcmw7ojee6xedzdetojuzjevtenxquvyku", "QmUNLLsPACCz1vLxQVkXqqLX5R1X345qqfHbsf67hvA3Nn")]
FORGED = ("QmbFMke1KXqnYyBBWxB74N4c5SBnJMVAiMNRcGu6x1AwQH", "QmbFMke1KXqnYyBBWxB74N4c5SBnJMVAiMNRcGu6x1AwQH")


def statement(key: int, stage: int, cids: tuple[str, str], step: int = STEP):
    return sign_statement(TASK, step, stage, cids, KEYS[key])


def honest() -> dict:
    return {peer_str(KEYS[k]): statement(k, s, GOOD[s]) for k, s in enumerate((0, 0, 0, 1, 1))}


def record(members=(A, B, C, D, E), step: int = STEP) -> ModelRecord:
    return ModelRecord(task_cid=TASK, version=1, parent=TASK, round=STEP - 1, step=step, members=members,
                       metrics={}, model_cid=TASK, optimizer_cid=TASK, term=1, coordinator=A)


def manifest_of(verdicts) -> tuple[StageFile, ...]:
    """The manifest a member stores from ``verdicts``, read back as a verifier reads it."""
    entries = [StageFile(i, i, *v.cids, 7, v.replicas, tuple(v.signatures)) for i, v in enumerate(verdicts)]
    return read_manifest(manifest_bytes(entries))


def test_each_stage_is_what_a_quorum_of_its_own_replicas_signed() -> None:
    said = honest()
    said[C] = statement(2, 0, FORGED)  # one replica of stage 0 names files its stage did not train
    verdicts, strangers = stage_verdicts(RINGS, said)
    assert [v.cids for v in verdicts] == GOOD and strangers == {}
    assert verdicts[0].dissent == {C: FORGED}  # named
    assert [r for r, _ in verdicts[0].signatures] == [A, B]  # the first quorum, in plan order
    check_stage_signatures(manifest_of(verdicts), record())


def test_a_member_cannot_sign_for_another_stage() -> None:
    """F1: A (stage 0) signs stage 1's entry with files nobody trained; it counts for nothing there
    and is named, and stage 1 is what its own replicas signed."""
    said = honest()
    said[A] = statement(0, 1, FORGED)
    verdicts, strangers = stage_verdicts(RINGS, said)
    assert list(strangers) == [A] and "the plan puts it in stage 0" in strangers[A]
    assert [v.cids for v in verdicts] == GOOD
    assert [r for r, _ in verdicts[0].signatures] == [B, C]


def test_a_stage_short_of_a_quorum_has_no_entry() -> None:
    said = honest()
    said[E] = statement(4, 1, FORGED)  # stage 1's two replicas disagree: no quorum of 2
    verdicts, _ = stage_verdicts(RINGS, said)
    assert verdicts[0].cids == GOOD[0] and verdicts[1].cids is None
    assert verdicts[1].dissent == {D: GOOD[1], E: FORGED}
    del said[E]  # one silent replica of two: no quorum either
    verdicts, _ = stage_verdicts(RINGS, said)
    assert verdicts[1].cids is None and verdicts[1].silent == (E,)


def test_a_statement_is_its_senders_own_and_signed() -> None:
    signed = statement(0, 0, GOOD[0])
    assert check_statement(signed, A).replica == A
    with pytest.raises(SignatureError):
        check_statement(signed, B)  # relayed as B's: B speaks for itself only
    forged = dataclasses.replace(signed, statement=dataclasses.replace(signed.statement, model_cid=FORGED[0]))
    with pytest.raises(SignatureError):
        check_statement(forged, A)  # garbage: changed after it was signed


def test_a_manifest_whose_entry_lacks_its_stages_quorum_is_refused() -> None:
    verdicts, _ = stage_verdicts(RINGS, honest())
    good = manifest_of(verdicts)
    check_stage_signatures(good, record())

    def refused(stages, rec=None, match=""):
        with pytest.raises(ManifestError, match=match):
            check_stage_signatures(stages, rec or record())

    one = dataclasses.replace(good[1], signatures=good[1].signatures[:1])
    refused((good[0], one), match="stage 1's files are signed by 1 of its 2 replicas, not a quorum")
    forged = dataclasses.replace(good[1], model=FORGED[0])  # another stage's entry changed: signatures break
    refused((good[0], forged), match="bad signature")
    # A's signature (stage 0) lent to stage 1, or stage 1 listed as A and D only.
    lent = dataclasses.replace(good[1], signatures=((A, good[0].signatures[0][1]), good[1].signatures[1]))
    refused((good[0], lent), match="not each of a different replica")
    fewer = dataclasses.replace(good[1], replicas=(D,), signatures=good[1].signatures[:1])
    refused((good[0], fewer), match="not the 5 members")
    refused(good, record(step=STEP + 10), match="bad signature")  # signed for another step
    unsigned = tuple(dataclasses.replace(s, signatures=()) for s in good)
    refused(unsigned, match="stage 0's files are signed by 0 of its 3 replicas")


def test_a_manifest_of_the_first_format_is_refused_by_name() -> None:
    old = (b'{"format":"p2ptrain.stages/1","stages":[{"first":0,"last":0,"model":"' + GOOD[0][0].encode()
           + b'","optimizer":"' + GOOD[0][1].encode() + b'","parameters":1}]}')
    with pytest.raises(ManifestError, match="format"):
        read_manifest(old)


def test_the_latest_model_of_a_fetch_is_checked_stage_by_stage(tmp_path) -> None:
    """``model fetch --latest`` (and a node's verified chain) checks its record's manifest in the
    store: refused with one line when a stage lacks its quorum; a model file is not a manifest."""
    from p2ptrain.ipfs import EmbeddedStore
    from p2ptrain.training import stage_signatures_problem

    store = EmbeddedStore(tmp_path)
    verdicts, _ = stage_verdicts(RINGS, honest())
    good = manifest_of(verdicts)
    cid = str(store.add_bytes(manifest_bytes(good)))
    assert stage_signatures_problem(store, dataclasses.replace(record(), model_cid=cid)) is None
    short = (good[0], dataclasses.replace(good[1], signatures=good[1].signatures[:1]))
    cid = str(store.add_bytes(manifest_bytes(short)))
    problem = stage_signatures_problem(store, dataclasses.replace(record(), model_cid=cid))
    assert problem == f"model {cid}: stage 1's files are signed by 1 of its 2 replicas, not a quorum (2)"
    model = str(store.add_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      "))  # a (tiny) model file's shape
    assert stage_signatures_problem(store, dataclasses.replace(record(), model_cid=model)) is None
