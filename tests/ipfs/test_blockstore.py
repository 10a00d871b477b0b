"""The block store verifies on write and read, quarantines rot, writes atomically, and keeps pins."""

import multiprocessing
import os

import pytest

from p2ptrain.ipfs._blockstore import BlockNotFound
from p2ptrain.ipfs import BlockMismatch, BlockStore, CorruptBlock, PinFileError, cid_str, make_cid

DATA = b"some block bytes"
CID = make_cid(DATA)


def test_put_get_has_delete(tmp_path):
    store = BlockStore(tmp_path)
    assert not store.has(CID)
    store.put(CID, DATA)
    assert store.has(CID) and store.has(cid_str(CID))
    assert store.get(CID) == DATA
    assert list(store.iter_cids()) == [CID]
    assert store.size_bytes() == len(DATA)
    store.delete(CID)
    with pytest.raises(BlockNotFound, match=cid_str(CID)):
        store.get(CID)


def test_cidv0_and_cidv1_of_one_block_share_it(tmp_path):
    store = BlockStore(tmp_path)
    v0 = make_cid(DATA, "dag-pb", 0)
    store.put(v0, DATA)
    assert store.get(make_cid(DATA, "dag-pb", 1)) == DATA


def test_put_refuses_bytes_that_do_not_match(tmp_path):
    store = BlockStore(tmp_path)
    with pytest.raises(BlockMismatch, match=cid_str(CID)):
        store.put(CID, DATA + b"!")
    assert not store.has(CID)


def test_corrupted_block_is_rejected_and_quarantined(tmp_path):
    store = BlockStore(tmp_path)
    store.put(CID, DATA)
    (path,) = [p for p in tmp_path.rglob("*.data")]
    path.write_bytes(b"X" + DATA[1:])
    with pytest.raises(CorruptBlock, match=cid_str(CID)) as info:
        store.get(CID)
    assert "quarantined" in str(info.value)
    assert not store.has(CID)  # so it can be fetched again
    assert (tmp_path / "quarantine" / path.name).exists()
    store.put(CID, DATA)
    assert store.get(CID) == DATA


def test_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    store = BlockStore(tmp_path)

    def broken_fsync(fd):
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk on fire"):
        store.put(CID, DATA)
    monkeypatch.undo()
    assert not store.has(CID)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_pins_persist_and_recursive_is_not_downgraded(tmp_path):
    a, b = make_cid(b"a"), make_cid(b"b")
    store = BlockStore(tmp_path)
    store.pin_add(a)
    store.pin_add(b, recursive=False)
    store.pin_add(a, recursive=False)
    again = BlockStore(tmp_path)
    assert again.pin_ls() == {cid_str(a): "recursive", cid_str(b): "direct"}
    assert again.pin_rm(b) is True
    assert again.pin_rm(b) is False
    assert BlockStore(tmp_path).pin_ls() == {cid_str(a): "recursive"}


def test_broken_pin_file_is_reported_not_overwritten(tmp_path):
    (tmp_path / "pins.json").write_text("{not json")
    store = BlockStore(tmp_path)
    with pytest.raises(PinFileError, match="pins.json"):
        store.pin_add(CID)
    assert (tmp_path / "pins.json").read_text() == "{not json"


def _pin_many(root, start):
    store = BlockStore(root)
    for i in range(start, start + 20):
        store.pin_add(make_cid(str(i).encode()))


def test_concurrent_pinners_lose_nothing(tmp_path):
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_pin_many, args=(tmp_path, k * 100)) for k in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert len(BlockStore(tmp_path).pin_ls()) == 60


def test_put_many_stores_good_blocks_and_reports_a_bad_one(tmp_path):
    store = BlockStore(tmp_path)
    good = [(make_cid(bytes([i]) * 1000), bytes([i]) * 1000) for i in range(40)]
    store.put_many(good)
    assert all(store.get(cid) == data for cid, data in good)
    with pytest.raises(BlockMismatch):
        store.put_many([(make_cid(b"a"), b"b")])
    assert not store.has(make_cid(b"a"))


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000,  # RecursionError from json.loads before boundedjson
        '{"version": 1, "pins": {"' + "[" * 50 + '": "recursive"}}',
        '{"version": 1' + "0" * 400 + ', "pins": {}}',
        '{"version": 1, "pins": {"not a cid": "recursive"}}',
    ],
    ids=["deep", "key-not-cid", "huge-int", "bad-cid"],
)
def test_hostile_pin_files_are_one_declared_error(tmp_path, text):
    (tmp_path / "pins.json").write_text(text)
    with pytest.raises(PinFileError):
        BlockStore(tmp_path).pin_ls()
