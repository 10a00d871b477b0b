"""A run's folder on a node's home (run/_run_dir.py): the names a peer sends never leave
``<home>/tasks``, only CID-named folders are runs, and a model CID finds its confirmed record."""

from __future__ import annotations

from pathlib import Path

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain.ipfs import InvalidCID, open_store
from p2ptrain.protocol import RecordError
from p2ptrain.run import RunDir, record_naming
from p2ptrain.testing import attestations_for, proven_record
from p2ptrain.protocol._lineage import entry_bytes
from p2ptrain.wire import ConfirmedRecord, ModelRecord


@pytest.mark.parametrize("name", ["../../etc", "..", "", "Qm/../x", "bafy" + "a" * 10])
def test_a_name_that_is_not_a_cid_names_no_folder(tmp_path: Path, name: str) -> None:
    with pytest.raises(InvalidCID):
        RunDir.of(tmp_path, name)


def test_runs_are_the_cid_named_folders_in_order(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    cids = sorted(store.add_bytes(f"task {i}".encode(), cid_version=1) for i in range(3))
    for cid in cids:
        RunDir.of(tmp_path, cid).path.mkdir(parents=True)
    (tmp_path / "tasks" / "notes").mkdir()
    assert [run.task_cid for run in RunDir.runs(tmp_path)] == cids
    assert RunDir.runs(tmp_path / "nowhere") == []


def test_feedback_files_are_listed_by_step(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    for step in (40, 5, 300):
        run.feedback(step).write_bytes(b"")
    (tmp_path / "feedback-x.safetensors").write_bytes(b"")
    assert run.feedback_steps() == [5, 40, 300]


def test_a_chain_over_the_limit_is_refused_unread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = RunDir(tmp_path)
    assert run.read_chain() is None
    run.chain.write_bytes(b"x" * 101)
    monkeypatch.setattr("p2ptrain.protocol.MAX_CHAIN_BYTES", 100)  # read_chain imports it when it reads
    with pytest.raises(RecordError, match="over 100 bytes"):
        run.read_chain()


def test_a_model_cid_finds_its_record_and_a_broken_chain_is_passed_over(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    store = open_store(tmp_path)
    keys = [create_new_key_pair() for _ in range(3)]
    broken, task = sorted(store.add_bytes(f"task {i}".encode(), cid_version=1) for i in range(2))
    model = store.add_bytes(b"weights", cid_version=1)
    record = ModelRecord(task_cid=task, version=1, parent=model, round=3, step=4, members=(), metrics={},
                         model_cid=model, optimizer_cid=model, term=1, coordinator="")
    signed = proven_record(record, keys[0], keys)
    line = entry_bytes(ConfirmedRecord(signed=signed, attestations=attestations_for(signed.record, keys[:2])))
    for cid, data in ((broken, b"not a chain line\n"), (task, line + b"\n")):
        RunDir.of(tmp_path, cid).path.mkdir(parents=True)
        RunDir.of(tmp_path, cid).chain.write_bytes(data)
    entry = record_naming(tmp_path, model)
    assert entry is not None and entry.signed.record.task_cid == task and entry.signed.record.step == 4
    assert any(broken in r.getMessage() and "not read" in r.getMessage() for r in caplog.records)
    assert record_naming(tmp_path, store.add_bytes(b"other", cid_version=1)) is None
