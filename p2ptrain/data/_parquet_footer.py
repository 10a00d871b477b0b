"""Read and check a Parquet file's footer ourselves, before pyarrow sees the file.

Why our own reader: the footer says how many rows the file holds, where each column's bytes are and
how large they decode, and a file may come from anywhere. pyarrow parses it too, but some of its
lies do not come back as exceptions: a fuzzed footer whose size statistics disagreed with the schema
made ``RowGroupMetaData.column(i)`` abort the whole process (a C++ exception escaping the binding,
pyarrow 26). So the footer is decoded here, bounded (bytes, nesting, element counts), and checked
against the file: row counts that add up and stay under the limit, every column chunk's byte range
(and its page index and bloom filter, when present) inside the file's data, no chunk in another file.
Only then does pyarrow open it.

The footer is Thrift's compact protocol (``FileMetaData`` of parquet.thrift): a generic decoder
turns it into nested dicts keyed by field id, and :func:`read_footer` picks the fields it checks.
Every failure is one :class:`FooterError`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

# Nesting of the footer's structs and lists: FileMetaData > row groups > chunk > metadata >
# statistics is six levels; 16 leaves room for optional fields and nothing for a bomb.
MAX_DEPTH = 16


class FooterError(ValueError):
    """A Parquet footer that is not compact Thrift within our bounds, or that lies about the file."""


@dataclass(frozen=True)
class Chunk:
    """One column chunk: its top-level column, the bytes it and its indexes span in the file, and
    its uncompressed size."""

    column: str
    start: int
    end: int
    uncompressed: int


@dataclass(frozen=True)
class Footer:
    num_rows: int
    row_groups: int
    schema_elements: int
    chunks: tuple[Chunk, ...]


class _Reader:
    """Compact-protocol values from ``data``; at most ``max_items`` values in all."""

    def __init__(self, data: bytes, max_items: int) -> None:
        self.data, self.pos, self.items_left = data, 0, max_items

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise FooterError("the footer ends in the middle of a value")
        self.pos += 1
        return self.data[self.pos - 1]

    def varint(self) -> int:
        value = shift = 0
        while True:
            b = self.byte()
            value |= (b & 0x7F) << shift
            if b < 0x80:
                return value
            shift += 7
            if shift > 63:
                raise FooterError("a varint longer than 64 bits")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def take(self, n: int) -> bytes:
        if n > len(self.data) - self.pos:
            raise FooterError(f"a value of {n} B runs past the footer")
        self.pos += n
        return self.data[self.pos - n:self.pos]

    def value(self, kind: int, depth: int) -> Any:
        self.items_left -= 1
        if self.items_left < 0:
            raise FooterError("the footer holds more values than the limit")
        if depth > MAX_DEPTH:
            raise FooterError(f"the footer nests deeper than {MAX_DEPTH} levels")
        if kind in (1, 2):  # bool in a field header (the type is the value)
            return kind == 1
        if kind == 3:
            return self.byte()
        if kind in (4, 5, 6):
            return self.zigzag()
        if kind == 7:
            return struct.unpack("<d", self.take(8))[0]
        if kind == 8:
            return self.take(self.varint())
        if kind in (9, 10):
            head = self.byte()
            size = head >> 4 if head >> 4 != 15 else self.varint()
            if size > len(self.data) - self.pos:  # every element takes at least a byte
                raise FooterError(f"a list of {size} elements is longer than the footer")
            element = head & 0x0F
            return [self.byte() == 1 if element in (1, 2) else self.value(element, depth + 1) for _ in range(size)]
        if kind == 11:
            size = self.varint()
            if size == 0:
                return {}
            if 2 * size > len(self.data) - self.pos:
                raise FooterError(f"a map of {size} entries is longer than the footer")
            types = self.byte()
            return {self._key(self.value(types >> 4, depth + 1)): self.value(types & 0x0F, depth + 1)
                    for _ in range(size)}
        if kind == 12:
            return self.struct(depth + 1)
        raise FooterError(f"unknown compact-protocol type {kind}")

    @staticmethod
    def _key(key: Any) -> Any:
        return key if isinstance(key, (int, bytes, bool, float)) else repr(key)

    def struct(self, depth: int) -> dict[int, Any]:
        fields: dict[int, Any] = {}
        last = 0
        while True:
            head = self.byte()
            if head == 0:
                return fields
            delta, kind = head >> 4, head & 0x0F
            last = last + delta if delta else self.zigzag()
            fields[last] = self.value(kind, depth)


def _int(fields: dict[int, Any], key: int, what: str, default: int | None = None) -> int:
    value = fields.get(key, default)
    if type(value) is not int:
        raise FooterError(f"the footer's {what} is missing or not an integer")
    return value


def _list(fields: dict[int, Any], key: int, what: str) -> list[Any]:
    value = fields.get(key, [])
    if type(value) is not list:
        raise FooterError(f"the footer's {what} is not a list")
    return value


def read_footer(data: bytes, max_items: int) -> Footer:
    """The fields of a ``FileMetaData`` that :func:`check_footer` needs."""
    reader = _Reader(data, max_items)
    meta = reader.struct(0)
    chunks: list[Chunk] = []
    rows_in_groups = 0
    groups = _list(meta, 4, "row groups")
    for group in groups:
        if type(group) is not dict:
            raise FooterError("a row group is not a struct")
        rows = _int(group, 3, "row group's row count")
        if rows < 0:
            raise FooterError(f"a row group claims {rows} rows")
        rows_in_groups += rows
        for chunk in _list(group, 1, "column chunks"):
            chunks.append(_chunk(chunk))
    num_rows = _int(meta, 3, "row count")
    if rows_in_groups != num_rows:
        raise FooterError(f"its row groups hold {rows_in_groups} rows, its footer says {num_rows}")
    return Footer(num_rows, len(groups), len(_list(meta, 2, "schema")), tuple(chunks))


def _chunk(chunk: Any) -> Chunk:
    if type(chunk) is not dict or type(chunk.get(3)) is not dict:
        raise FooterError("a column chunk has no metadata (encrypted or malformed)")
    if 1 in chunk:
        raise FooterError("a column chunk lives in another file (file_path): not supported")
    meta = chunk[3]
    path = _list(meta, 3, "column path")
    if not path or type(path[0]) is not bytes:
        raise FooterError("a column chunk has no column path")
    compressed = _int(meta, 7, "compressed size")
    starts = [_int(meta, 9, "data page offset")] + ([_int(meta, 11, "dictionary offset")] if 11 in meta else [])
    start = min(starts)
    ranges = [(start, start + compressed)]
    for offset, length in ((4, 5), (6, 7)):  # the offset index and the column index, when present
        if offset in chunk:
            at = _int(chunk, offset, "page index offset")
            ranges.append((at, at + _int(chunk, length, "page index length")))
    if 14 in meta:
        bloom = _int(meta, 14, "bloom filter offset")
        ranges.append((bloom, bloom + _int(meta, 15, "bloom filter length", 0)))
    low, high = min(a for a, _ in ranges), max(b for _, b in ranges)
    if compressed < 0 or any(b < a for a, b in ranges):
        raise FooterError("a column chunk has a negative size")
    return Chunk(path[0].decode("utf-8", "replace"), low, high, _int(meta, 6, "uncompressed size"))
