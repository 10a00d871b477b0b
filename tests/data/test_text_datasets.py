"""``dataset add text:PATH`` and a table's ``--text`` column: a BPE tokenizer trained here on real
files, the tokenizer stored by CID and named in the manifest, windows of token ids read back through
IPFSDataset; bytes without a tokenizer; hostile tokenizer files refused with nothing stored."""

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from p2ptrain.data import IPFSDataset, build_dataset, load_source
from p2ptrain.data._tokens import MAX_TOKENIZER_BYTES, TokenizerError, tokenizer_by_cid
from p2ptrain.ipfs import EmbeddedStore
from p2ptrain.testing import EOS, STDLIB_FILES, text_corpus

CONTEXT = 16


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    """``(folder of text files, tokenizer.json trained on them)``: a few of Python's own modules."""
    return text_corpus(tmp_path_factory.mktemp("corpus"), STDLIB_FILES[:4])


def windows_of(ids: list[int], context: int = CONTEXT) -> Counter:
    count = len(ids) // (context + 1)
    return Counter(tuple(w) for w in np.asarray(ids[: count * (context + 1)]).reshape(count, context + 1).tolist())


def dataset_windows(cid: str, home: Path) -> Counter:
    """Every sample of every split, as the window it came from (features plus the last label)."""
    manifest = IPFSDataset(cid, home=home).manifest
    found = Counter()
    for split in manifest.splits:
        for x, y in IPFSDataset(cid, split=split, home=home):
            assert x[1:].tolist() == y[:-1].tolist()  # labels are the next token at every position
            found[tuple(x.tolist() + [int(y[-1])])] += 1
    return found


def test_text_files_with_a_trained_tokenizer_round_trip_and_decode_on_any_peer(tmp_path, corpus, dataset_cli):
    texts, tokenizer_path = corpus
    home = tmp_path / "home"
    code, cid, err = dataset_cli("add", f"text:{texts}", "--tokenizer", str(tokenizer_path), "--eos", EOS,
                                 "--context", str(CONTEXT), "--shards", "2", home=home)
    assert code == 0, err
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    ids: list[int] = []
    for path in sorted(texts.iterdir()):
        ids += tokenizer.encode(path.read_text(), add_special_tokens=False).ids + [tokenizer.token_to_id(EOS)]
    assert dataset_windows(cid, home) == windows_of(ids)

    dataset = IPFSDataset(cid, home=home)
    manifest = dataset.manifest
    assert manifest.tokens.vocab_size == 300 and manifest.features.dtype == "uint16"
    store = EmbeddedStore(home)
    assert store.cat(manifest.tokens.tokenizer) == tokenizer_path.read_bytes()  # stored by CID
    assert manifest.tokens.tokenizer in store.pin_ls()  # and pinned with the shards
    # Any peer decodes with the same file, fetched by the CID the manifest names.
    x, _ = next(iter(dataset))
    assert dataset.tokenizer().decode(x.tolist()) == tokenizer.decode(x.tolist())
    assert tokenizer.decode(x.tolist()) in "".join(p.read_text() for p in sorted(texts.iterdir()))


def test_text_files_as_bytes_record_a_vocabulary_of_256(tmp_path, corpus, dataset_cli):
    texts, _ = corpus
    home = tmp_path / "home"
    cid = dataset_cli("add", f"text:{texts}/*.txt", "--context", str(CONTEXT), "--shards", "2", home=home)[1]
    manifest = IPFSDataset(cid, home=home).manifest
    assert manifest.tokens.vocab_size == 256 and manifest.tokens.tokenizer is None
    assert manifest.features.dtype == "uint8" and manifest.name == "text-texts"
    data = b"".join(p.read_bytes() for p in sorted(texts.iterdir()))
    assert dataset_windows(cid, home) == windows_of(list(data))


def test_python_stdlib_without_options_keeps_its_manifest(tmp_path, dataset_cli):
    cid = dataset_cli("add", "text:python-stdlib", "--shards", "4", home=tmp_path / "a")[1]
    name, features, labels = load_source("text:python-stdlib")
    assert build_dataset(EmbeddedStore(tmp_path / "b"), name, features, labels, 4)[0] == cid
    assert IPFSDataset(cid, home=tmp_path / "a").manifest.tokens is None  # bytes, as before tokens existed


def test_python_stdlib_reads_the_librarys_own_files_in_path_order_and_none_installed(tmp_path):
    """``stdlib_documents`` walks the standard library's tree without entering what was installed in
    it: the same documents, in the same order, as reading every ``*.py`` below it and dropping those."""
    import sysconfig

    from p2ptrain.data._builtin import TEXT_MAX_BYTES, stdlib_documents

    root = Path(sysconfig.get_paths()["stdlib"])
    expected, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "dist-packages" in path.parts or not path.is_file():
            continue
        data = path.read_bytes()[: TEXT_MAX_BYTES - total]
        expected.append((str(path), data))
        total += len(data)
        if total >= TEXT_MAX_BYTES:
            break
    documents = stdlib_documents()
    assert [p for p, _ in documents] == [p for p, _ in expected] and len(documents) > 100
    assert documents == expected


def test_a_table_text_column_is_tokenized_row_by_row(tmp_path, corpus, dataset_cli):
    _, tokenizer_path = corpus
    rows = [f"row {i}: the quick brown fox jumps over the lazy dog" for i in range(40)]
    pq.write_table(pa.table({"text": rows, "n": range(40)}), tmp_path / "rows.parquet")
    code, cid, err = dataset_cli("add", str(tmp_path / "rows.parquet"), "--text", "text", "--tokenizer",
                                 str(tokenizer_path), "--eos", EOS, "--context", str(CONTEXT), "--shards", "2",
                                 home=tmp_path / "h")
    assert code == 0, err
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    eos = tokenizer.token_to_id(EOS)
    ids = [i for row in rows for i in tokenizer.encode(row, add_special_tokens=False).ids + [eos]]
    assert dataset_windows(cid, tmp_path / "h") == windows_of(ids)


def _deep_tokenizer(path: Path) -> bytes:
    raw = json.loads(path.read_text())
    nested: object = raw["normalizer"]
    for _ in range(200):
        nested = {"type": "Sequence", "normalizers": [nested]}
    raw["normalizer"] = nested
    return json.dumps(raw).encode()


def _with_token(path: Path, token: str, token_id: int) -> bytes:
    raw = json.loads(path.read_text())
    raw["model"]["vocab"][token] = token_id
    return json.dumps(raw).encode()


HOSTILE = [
    ("deep.json", _deep_tokenizer, "nested"),
    ("notatokenizer.json", lambda _: b'{"vocab": {"a": 1}}', "not a tokenizer.json"),
    ("broken.json", lambda p: p.read_bytes().replace(b'"model"', b'"model": {"type": "Nope"}, "x"', 1), "refuses it"),
    ("huge-id.json", lambda p: _with_token(p, "zz", 99_999_999), "a vocabulary of 100000000 ids"),
]


@pytest.mark.parametrize("name,content,message", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_hostile_tokenizer_is_refused_in_one_line_and_nothing_is_written(
        tmp_path, corpus, dataset_cli, home_files, name, content, message):
    texts, tokenizer_path = corpus
    bad = tmp_path / name
    bad.write_bytes(content(tokenizer_path))
    code, out, err = dataset_cli("add", f"text:{texts}", "--tokenizer", str(bad), "--shards", "1", home=tmp_path / "h")
    assert code == 1 and out == "" and message in err and err.count("\n") == 1, err
    assert home_files(tmp_path / "h") == {}


def test_a_two_gigabyte_tokenizer_file_is_refused_before_it_is_read(tmp_path, corpus, dataset_cli, home_files):
    texts, _ = corpus
    big = tmp_path / "tokenizer.json"
    with open(big, "wb") as f:  # sparse: 2 GB that are never written (nor read)
        f.seek(2_000_000_000)
        f.write(b"}")
    code, _, err = dataset_cli("add", f"text:{texts}", "--tokenizer", str(big), "--shards", "1", home=tmp_path / "h")
    assert code == 1 and f"2000000001 B is over the {MAX_TOKENIZER_BYTES} B limit of a tokenizer file" in err, err
    assert home_files(tmp_path / "h") == {}


def test_a_tokenizer_by_cid_is_bounded_like_a_file(tmp_path):
    store = EmbeddedStore(tmp_path)
    cid = store.add_bytes(b" " * (MAX_TOKENIZER_BYTES + 1), cid_version=1)
    with pytest.raises(TokenizerError, match="over the"):
        tokenizer_by_cid(store, cid)


@pytest.mark.parametrize("args,message", [
    (["--eos", "<|nope|>"], "--eos '<|nope|>' is not a token of the tokenizer"),
    (["--context", "100000"], "fewer than 2 windows"),
    (["--label", "y"], "--label does not apply to text"),
])
def test_text_options_that_cannot_work_are_one_line(tmp_path, corpus, dataset_cli, home_files, args, message):
    texts, tokenizer_path = corpus
    code, _, err = dataset_cli("add", f"text:{texts}", "--tokenizer", str(tokenizer_path), *args, "--shards", "1",
                               home=tmp_path / "h")
    assert code == 1 and message in err, err
    assert home_files(tmp_path / "h") == {}


def test_a_file_that_is_not_utf8_is_named(tmp_path, corpus, dataset_cli):
    texts, tokenizer_path = corpus
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_bytes(b"fine text\n" * 50)
    (tmp_path / "t" / "b.txt").write_bytes(b"\xff\xfe latin-1 \xe9\n")
    code, _, err = dataset_cli("add", f"text:{tmp_path / 't'}", "--tokenizer", str(tokenizer_path), "--shards", "1",
                               home=tmp_path / "h")
    assert code == 1 and "b.txt: not UTF-8 text (byte 0)" in err, err
