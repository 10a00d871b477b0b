"""Our own Parquet footer reader: it reads what pyarrow wrote as pyarrow does, and refuses footers
that lie (row counts that do not add up, sizes, depth), each as one FooterError."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from p2ptrain.data._parquet_footer import FooterError, read_footer


def footer_bytes(path) -> bytes:
    data = path.read_bytes()
    length = int.from_bytes(data[-8:-4], "little")
    return data[-8 - length:-8]


def test_it_reads_what_pyarrow_wrote_as_pyarrow_reads_it(tmp_path):
    table = pa.table({"x": np.arange(1000, dtype=np.float64), "s": [str(i % 7) for i in range(1000)],
                      "v": pa.array([[1.0, 2.0]] * 1000, pa.list_(pa.float32(), 2))})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=300, write_page_index=True)
    footer = read_footer(footer_bytes(tmp_path / "t.parquet"), 1 << 20)
    meta = pq.ParquetFile(tmp_path / "t.parquet").metadata
    assert footer.num_rows == meta.num_rows == 1000 and footer.row_groups == meta.num_row_groups == 4
    assert len(footer.chunks) == 4 * 3 and {c.column for c in footer.chunks} == {"x", "s", "v"}
    for i, chunk in enumerate(footer.chunks):
        column = meta.row_group(i // 3).column(i % 3)
        first = min(o for o in (column.dictionary_page_offset, column.data_page_offset) if o is not None)
        assert chunk.start == first and chunk.uncompressed == column.total_uncompressed_size
        assert chunk.end >= first + column.total_compressed_size  # the page index lies after the data


# A compact-protocol encoder, just enough to write footers that lie.
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _i64(value: int) -> bytes:
    return _varint((value << 1) ^ (value >> 63))


def _struct(*fields: tuple[int, int, bytes]) -> bytes:
    """Fields ``(id, type, encoded value)`` in increasing id order, then STOP."""
    out, last = bytearray(), 0
    for field, kind, value in fields:
        out.append(((field - last) << 4) | kind)
        out += value
        last = field
    return bytes(out) + b"\0"


def _list(kind: int, items: list[bytes]) -> bytes:
    head = bytes([(len(items) << 4) | kind]) if len(items) < 15 else bytes([0xF0 | kind]) + _varint(len(items))
    return head + b"".join(items)


def _chunk(offset: int = 4, size: int = 10) -> bytes:
    meta = _struct((3, 9, _list(8, [_varint(1) + b"x"])), (6, 6, _i64(size)), (7, 6, _i64(size)), (9, 6, _i64(offset)))
    return _struct((2, 6, _i64(offset)), (3, 12, meta))


def _footer(rows: int, group_rows: list[int], chunk: bytes | None = None) -> bytes:
    groups = [_struct((1, 9, _list(12, [chunk or _chunk()])), (2, 6, _i64(10)), (3, 6, _i64(n))) for n in group_rows]
    return _struct((1, 5, _i64(1)), (2, 9, _list(12, [_struct((4, 8, _varint(1) + b"x"))])), (3, 6, _i64(rows)),
                   (4, 9, _list(12, groups)))


def test_a_hand_written_footer_reads_back():
    footer = read_footer(_footer(30, [10, 20]), 1000)
    assert footer.num_rows == 30 and footer.row_groups == 2 and footer.chunks[0].column == "x"


@pytest.mark.parametrize("data,why", [
    (_footer(10**12, [10, 20]), "its row groups hold 30 rows, its footer says 1000000000000"),
    (_footer(-5, [-5]), "claims -5 rows"),
    (_footer(10, [10], chunk=_struct((1, 8, _varint(5) + b"other"), (3, 12, b"\0"))), "another file"),
    (_footer(10, [10], chunk=_struct((2, 6, _i64(4)))), "no metadata"),
    (_footer(10, [10], chunk=_chunk(size=-1)), "negative"),
    (_footer(30, [10, 20])[:-3], "ends in the middle"),
    (b"\x19" + b"\x1c" * 40 + b"\0" * 41, "deeper than"),
    (bytes([0x19, 0xF9]) + _varint(10**6), "longer than the footer"),
    (b"\x16" + b"\xff" * 11, "longer than 64 bits"),
    (b"\x1d", "unknown compact-protocol type 13"),
])
def test_a_lying_or_malformed_footer_is_one_error(data, why):
    with pytest.raises(FooterError, match=why):
        read_footer(data, 1000)


def test_the_value_count_is_bounded():
    with pytest.raises(FooterError, match="more values than the limit"):
        read_footer(_footer(30, [10, 20]), 5)
