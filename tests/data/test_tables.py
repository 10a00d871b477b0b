"""``dataset add`` of Parquet, Arrow IPC and JSON Lines tables: real files written here with pyarrow
and json, read back by CID through IPFSDataset; lying footers, bombs and huge lines refused with
nothing stored."""

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
from sklearn.datasets import load_digits

from p2ptrain.data import IPFSDataset
from p2ptrain.data._tables import MAX_LINE_BYTES, MAX_TABLE_BYTES

NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def digits_table() -> pa.Table:
    digits = load_digits()
    return pa.table({
        "pixels": pa.array(list(digits.data.astype(np.float32)), type=pa.list_(pa.float32(), 64)),
        "ink": digits.data.sum(axis=1),
        "name": [NAMES[d] for d in digits.target],
        "id": np.arange(len(digits.target)),
    })


def write(folder: Path, kind: str, table: pa.Table) -> Path:
    """``table`` as ``folder/digits.<kind>``: the same name in every format (the manifest's name)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"digits.{kind}"
    if kind == "parquet":
        pq.write_table(table, path, row_group_size=500)
    elif kind == "arrow":
        feather.write_feather(table, path, chunksize=500)
    else:
        with open(path, "w") as f:
            for row in table.to_pylist():
                f.write(json.dumps(row) + "\n")
    return path


def samples(cid: str, home: Path) -> Counter:
    """(feature bytes, label name) of every sample in every split, as IPFSDataset yields them."""
    manifest = IPFSDataset(cid, home=home).manifest
    return Counter((x.numpy().tobytes(), manifest.classes[int(y)])
                   for split in manifest.splits for x, y in IPFSDataset(cid, split=split, home=home))


@pytest.mark.parametrize("kind", ["parquet", "arrow", "jsonl"])
def test_a_table_round_trips_by_cid_and_every_format_gives_the_same_dataset(tmp_path, dataset_cli, kind):
    table = digits_table()
    path = write(tmp_path / kind, kind, table)
    home = tmp_path / "home"
    code, cid, err = dataset_cli("add", str(path), "--features", "pixels,ink", "--label", "name", "--shards", "4",
                                 home=home)
    assert code == 0, err
    expected = Counter(
        (np.concatenate([np.asarray(p, np.float32), [np.float32(i)]]).tobytes(), n)
        for p, i, n in zip(table["pixels"].to_pylist(), table["ink"].to_pylist(), table["name"].to_pylist()))
    assert samples(cid, home) == expected
    manifest = IPFSDataset(cid, home=home).manifest
    assert manifest.classes == tuple(sorted(NAMES)) and manifest.features.shape == (65,)
    # The same table in another format is the same dataset: the same manifest CID.
    other = write(tmp_path / "other", "parquet" if kind != "parquet" else "jsonl", table)
    assert dataset_cli("add", str(other), "--features", "pixels,ink", "--label", "name", "--shards", "4",
                       home=home)[1] == cid


def test_default_features_are_the_other_numeric_columns_and_integer_labels_stay(tmp_path, dataset_cli):
    path = write(tmp_path, "parquet", pa.table({"a": [1.0, 2.0, 3.0, 4.0], "t": ["x", "y", "z", "w"],
                                                "b": [10, 20, 30, 40], "y": [0, 1, 1, 0]}))
    cid = dataset_cli("add", str(path), "--label", "y", "--shards", "1", "--test-fraction", "0", home=tmp_path / "h")[1]
    got = sorted((tuple(x.tolist()), int(y)) for x, y in IPFSDataset(cid, home=tmp_path / "h"))
    assert got == [((1.0, 10.0), 0), ((2.0, 20.0), 1), ((3.0, 30.0), 1), ((4.0, 40.0), 0)]
    assert IPFSDataset(cid, home=tmp_path / "h").manifest.classes is None


@pytest.mark.parametrize("table,args,message", [
    (pa.table({"x": [1.0, None], "y": [0, 1]}), ["--label", "y"], "1 empty (null) values"),
    (pa.table({"x": [1.0, 2.0], "y": [0.5, 1.0]}), ["--label", "y"], "holds fractions"),
    (pa.table({"x": [1.0, 2.0], "y": [-1, 1]}), ["--label", "y"], "outside 0 to 2147483647"),
    (pa.table({"x": [1.0, 2.0], "y": [1e300, 1.0]}), ["--label", "y"], "outside 0 to 2147483647"),
    (pa.table({"x": ["a", "b"], "y": [0, 1]}), ["--label", "y", "--features", "x"], "holds text"),
    (pa.table({"x": [1.0, float("nan")], "y": [0, 1]}), ["--label", "y"], "not a finite number in row 1"),
    (pa.table({"x": [1.0, 2.0], "y": [0, 1]}), ["--label", "nope"], "no column 'nope' (it has x, y)"),
    (pa.table({"x": [[1.0], [1.0, 2.0]], "y": [0, 1]}), ["--label", "y"], "one length"),
    (pa.table({"x": [1.0, 2.0], "y": [0, 1]}), [], "needs --label COL"),
    (pa.table({"x": [1.0, 2.0], "y": [0, 1]}), ["--label", "y", "--image-size", "8"], "--image-size does not apply"),
])
def test_what_a_table_cannot_be_is_one_line(tmp_path, dataset_cli, home_files, table, args, message):
    path = write(tmp_path, "parquet", table)
    code, out, err = dataset_cli("add", str(path), *args, "--shards", "1", home=tmp_path / "h")
    assert code == 1 and out == "" and message in err and err.count("\n") == 1, err
    assert home_files(tmp_path / "h") == {}


# --- hostile files -----------------------------------------------------------------------------

def _parquet_bytes(rows: int) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"x": np.arange(rows, dtype=np.float64), "y": np.arange(rows) % 3}), sink)
    return sink.getvalue().to_pybytes()


def footer_claims_more_than_the_file() -> bytes:
    data = _parquet_bytes(100)
    return data[:-8] + (2**31 - 1).to_bytes(4, "little") + b"PAR1"


def footer_of_another_file() -> bytes:
    """The data of a 100-row file under the footer of a 100,000-row one: rows and byte ranges lie."""
    small, big = _parquet_bytes(100), _parquet_bytes(100_000)
    footer = int.from_bytes(big[-8:-4], "little")
    return small[: -8 - int.from_bytes(small[-8:-4], "little")] + big[-8 - footer:]


def strings_bomb() -> bytes:
    """A few KB of Parquet whose one string column decodes to ~5 GB: a 10 KB string named by
    500,000 rows through the dictionary."""
    words = pa.DictionaryArray.from_arrays(np.zeros(500_000, np.int32), pa.array(["w" * 10_000]))
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"text": words, "y": np.zeros(500_000, np.int64)}), sink)
    return sink.getvalue().to_pybytes()


def arrow_footer_lies() -> bytes:
    sink = pa.BufferOutputStream()
    feather.write_feather(pa.table({"x": [1.0, 2.0], "y": [0, 1]}), sink)
    data = sink.getvalue().to_pybytes()
    return data[:-10] + (2**30).to_bytes(4, "little") + b"ARROW1"


def arrow_offsets_point_outside() -> bytes:
    """A valid Arrow file whose string column's last offset was rewritten to point far past its data."""
    sink = pa.BufferOutputStream()
    feather.write_feather(pa.table({"t": ["ab", "cd"], "y": [0, 1]}), sink, compression="uncompressed")
    data = bytearray(sink.getvalue().to_pybytes())
    offsets = np.array([0, 2, 4], np.int32).tobytes()
    at = bytes(data).index(offsets)
    data[at + 8: at + 12] = (1 << 30).to_bytes(4, "little")
    return bytes(data)


HOSTILE = [
    ("lying.parquet", footer_claims_more_than_the_file, ["--label", "y"], "its footer claims 2147483647 B"),
    ("spliced.parquet", footer_of_another_file, ["--label", "y"], "the footer does not describe this file"),
    ("bomb.parquet", strings_bomb, ["--text", "text"], f"decode to over {MAX_TABLE_BYTES} B"),
    ("lying.arrow", arrow_footer_lies, ["--label", "y"], "its footer claims 1073741824 B"),
    ("offsets.arrow", arrow_offsets_point_outside, ["--text", "t"], "cannot be read as a table"),
    ("deep.jsonl", lambda: b'{"x": 1, "y": ' + b"[" * 5000 + b"]" * 5000 + b"}\n", ["--label", "y"], "nested"),
    ("huge.jsonl", lambda: b'{"x": 1, "y": 99999999999999999999999}\n', ["--label", "y"], "out of range"),
    ("text.jsonl", lambda: b'{"x": 1, "y": 0}\n[1, 2]\n', ["--label", "y"], "line 2: not a JSON object"),
]


@pytest.mark.parametrize("name,content,args,message", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_hostile_table_is_refused_in_one_line_and_nothing_is_written(
        tmp_path, dataset_cli, home_files, name, content, args, message):
    path = tmp_path / name
    path.write_bytes(content())
    code, out, err = dataset_cli("add", str(path), *args, "--shards", "1", home=tmp_path / "h")
    assert code == 1 and out == "" and message in err and str(path) in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert home_files(tmp_path / "h") == {}


def test_a_one_gigabyte_line_is_refused_after_reading_only_the_line_limit(tmp_path, dataset_cli, home_files):
    path = tmp_path / "big.jsonl"
    with open(path, "wb") as f:  # sparse: 1 GiB of zeros, then a newline, without writing them
        f.write(b'{"x": 1, "y": 0}\n')
        f.seek(1 << 30)
        f.write(b"\n")
    code, _, err = dataset_cli("add", str(path), "--label", "y", "--shards", "1", home=tmp_path / "h")
    assert code == 1 and f"line 2: over the {MAX_LINE_BYTES} B limit" in err, err
    assert home_files(tmp_path / "h") == {}


def test_without_pyarrow_the_error_names_the_extra(tmp_path, dataset_cli, monkeypatch):
    import sys

    path = write(tmp_path, "parquet", pa.table({"x": [1.0, 2.0], "y": [0, 1]}))
    for module in [m for m in sys.modules if m == "pyarrow" or m.startswith("pyarrow.")]:
        monkeypatch.setitem(sys.modules, module, None)
    code, _, err = dataset_cli("add", str(path), "--label", "y", "--shards", "1", home=tmp_path / "h")
    assert code == 1 and "needs pyarrow: pip install 'p2ptrain[data]'" in err, err
