"""The embedded store: add/cat/get/pin, and the fetch hook for blocks it lacks (verified, then kept)."""

import os

import pytest

from p2ptrain.ipfs import ContentStore, ContentUnavailable, EmbeddedStore, cid_str, open_store, parse_cid

DATA = os.urandom(5 * 256 * 1024 + 123)


def test_open_store_gives_an_embedded_content_store(tmp_path):
    store = open_store(tmp_path)
    assert isinstance(store, EmbeddedStore) and isinstance(store, ContentStore)


@pytest.mark.parametrize("version", [0, 1])
def test_add_cat_get(tmp_path, version):
    store = EmbeddedStore(tmp_path)
    cid = store.add_bytes(DATA, cid_version=version)
    assert cid.startswith("Qm" if version == 0 else "bafy")
    assert store.cat(cid) == DATA
    assert store.has(cid)
    out = tmp_path / "out.bin"
    seen = []
    store.get(cid, out, progress=seen.append)
    assert out.read_bytes() == DATA and sum(seen) == len(DATA)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


def test_add_file_and_only_hash(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(DATA)
    store = EmbeddedStore(tmp_path / "home")
    cid = store.add_file(src, only_hash=True)
    assert store.blocks.size_bytes() == 0 and not store.has(cid)
    assert store.add_file(src) == cid
    assert store.cat(cid) == DATA


def test_missing_block_without_fetcher_names_the_cid(tmp_path):
    cid = EmbeddedStore(tmp_path / "a").add_bytes(DATA)
    with pytest.raises(ContentUnavailable, match=cid) as info:
        EmbeddedStore(tmp_path / "b").cat(cid)
    assert "no network fetcher" in info.value.reason


def test_get_of_missing_content_leaves_no_file(tmp_path):
    source = EmbeddedStore(tmp_path / "a")
    cid = source.add_bytes(DATA)
    partial = EmbeddedStore(tmp_path / "b")
    root = parse_cid(cid)
    partial.blocks.put(root, source.blocks.get(root))  # root only: the leaves are missing
    with pytest.raises(ContentUnavailable):
        partial.get(cid, tmp_path / "out.bin")
    assert not (tmp_path / "out.bin").exists()
    assert [p for p in tmp_path.iterdir() if p.is_file()] == []


def test_fetcher_fills_the_store_once(tmp_path):
    source = EmbeddedStore(tmp_path / "a")
    cid = source.add_bytes(DATA, cid_version=1)
    asked = []

    def fetch(c):
        asked.append(cid_str(c))
        return source.blocks.get(c)

    sink = EmbeddedStore(tmp_path / "b", fetch_block=fetch)
    assert not sink.has(cid)
    assert sink.cat(cid) == DATA
    assert len(asked) == len(set(asked)) == 7  # root + 6 leaves
    assert sink.cat(cid) == DATA and len(asked) == 7  # second read is local
    assert sink.has(cid)


def test_fetched_block_with_wrong_bytes_is_rejected(tmp_path):
    cid = EmbeddedStore(tmp_path / "a").add_bytes(b"the real thing")
    sink = EmbeddedStore(tmp_path / "b", fetch_block=lambda c: b"an impostor")
    with pytest.raises(ContentUnavailable, match="rejected"):
        sink.cat(cid)
    assert sink.blocks.size_bytes() == 0


def test_fetcher_failure_is_reported_with_the_cid(tmp_path):
    def fetch(c):
        raise TimeoutError("no provider answered in 30 s")

    cid = EmbeddedStore(tmp_path / "a").add_bytes(b"x")
    with pytest.raises(ContentUnavailable, match="no provider answered"):
        EmbeddedStore(tmp_path / "b", fetch_block=fetch).cat(cid)


def test_corrupt_block_is_fetched_again(tmp_path):
    source = EmbeddedStore(tmp_path / "a")
    cid = source.add_bytes(DATA, cid_version=1)
    sink = EmbeddedStore(tmp_path / "b", fetch_block=source.blocks.get)
    sink.pin_add(cid)
    victim = sorted((tmp_path / "b" / "blocks").rglob("*.data"))[0]
    victim.write_bytes(b"rot" + victim.read_bytes()[3:])
    assert sink.cat(cid) == DATA
    assert (tmp_path / "b" / "blocks" / "quarantine" / victim.name).exists()


def test_pins(tmp_path):
    source = EmbeddedStore(tmp_path / "a")
    cid = source.add_bytes(DATA)
    sink = EmbeddedStore(tmp_path / "b", fetch_block=source.blocks.get)
    sink.pin_add(cid)  # recursive: the whole DAG becomes local
    assert EmbeddedStore(tmp_path / "b").has(cid)
    assert EmbeddedStore(tmp_path / "b").pin_ls() == {cid: "recursive"}
    sink.pin_rm(cid)
    assert sink.pin_ls() == {}
    with pytest.raises(ContentUnavailable, match="not pinned"):
        sink.pin_rm(cid)
