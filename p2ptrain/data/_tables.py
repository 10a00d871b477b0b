"""Tables as datasets: Parquet, Arrow IPC (Feather v2) and JSON Lines files, read column by column.

Only the columns a dataset uses are read: ``--features COL,...`` (numbers, or lists of numbers of one
length, flattened in order into float32 features; default: every other numeric column) with
``--label COL`` (integers >= 0, or strings: their sorted distinct values become the manifest's
``classes``), or ``--text COL`` (strings, tokenized by :mod:`p2ptrain.data._tokens`). Empty (null)
values and non-finite features are refused with the column's name.

A table file may come from anywhere, and its metadata says how much it holds, so that is checked
against the file before any data is read: a Parquet footer longer than the file or than
:data:`MAX_FOOTER_BYTES`, row counts that do not add up or exceed :data:`MAX_ROWS`, a column chunk
whose bytes lie outside the file, declared column sizes over :data:`MAX_TABLE_BYTES`, an Arrow footer
outside its file. Then the decoded columns are counted against :data:`MAX_TABLE_BYTES` batch by
batch (a dictionary-encoded string column by the length it will have, not the dictionary's), and
Arrow batches are fully validated (offsets inside their buffers) before use. JSON Lines are read one
bounded line at a time (:data:`MAX_LINE_BYTES`) with :mod:`p2ptrain.base.boundedjson`. Every refusal is
one line naming the file.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from itertools import count
from pathlib import Path
from typing import Any

import numpy as np

from p2ptrain.base import ArgumentError, UserError, boundedjson
from p2ptrain.data._parquet_footer import Footer, FooterError, read_footer
from p2ptrain.data._source import need

KINDS = {".parquet": "parquet", ".pq": "parquet", ".arrow": "arrow", ".feather": "arrow", ".ipc": "arrow",
         ".jsonl": "jsonl", ".ndjson": "jsonl"}
# Rows of one table: 268M; labels alone are then 2 GiB of int64.
MAX_ROWS = 1 << 28
# Decoded bytes of the columns a dataset uses: what `dataset add` holds in memory.
MAX_TABLE_BYTES = 4 << 30
# Parquet / Arrow footer (the schema and every row group's metadata): real files have KBs to MBs.
MAX_FOOTER_BYTES = 64 << 20
# Columns of a schema (Parquet: its elements) and its nesting depth; values in a footer (each column
# chunk is about 20).
MAX_COLUMNS = 10_000
MAX_SCHEMA_DEPTH = 16
MAX_FOOTER_ENTRIES = 1 << 22
# Row groups (Parquet) or record batches (Arrow) in one file.
MAX_GROUPS = 1 << 16
# One JSON Lines line, and its nesting (a row with a list of numbers is depth 2).
MAX_LINE_BYTES = 16 << 20
MAX_LINE_DEPTH = 8
# The largest class number a label column may hold (a class count any model's output layer could have).
MAX_LABEL = (1 << 31) - 1
# Rows per Parquet read: bounds the memory of one step of the budget.
BATCH_ROWS = 1 << 16

Column = np.ndarray | list[str]


class TableError(UserError, ValueError):
    """A table file that is over the bounds, not what it says it is, or not what the options ask."""


def table_kind(path: Path) -> str | None:
    """``parquet``, ``arrow`` or ``jsonl`` by the file's suffix; ``None`` for anything else."""
    return KINDS.get(path.suffix.lower()) if path.is_file() else None


def numeric_columns(path: Path) -> list[str]:
    """The columns that hold numbers (or lists of numbers), in file order: the default features.
    For JSON Lines, judged by the first row."""
    if table_kind(path) == "jsonl":
        first = next(_jsonl_rows(path), (0, 0, {}))[2]
        return [k for k, v in first.items() if _is_number(v) or (type(v) is list and v and all(map(_is_number, v)))]
    pa = need("pyarrow", "reading a Parquet or Arrow table")
    with _arrow_errors(pa, path):
        schema = _parquet(path).schema_arrow if table_kind(path) == "parquet" else _arrow(pa, path).schema
    return [f.name for f in schema
            if _numeric(pa, f.type) or (_is_list(pa, f.type) and _numeric(pa, f.type.value_type))]


def read_columns(path: Path, names: list[str]) -> dict[str, Column]:
    """The named columns of the table at ``path`` (the module docstring says what is checked)."""
    if table_kind(path) == "jsonl":
        return _read_jsonl(path, names)
    pa = need("pyarrow", "reading a Parquet or Arrow table")
    budget = _Budget(path)
    chunks: dict[str, list[Any]] = {name: [] for name in names}
    with _arrow_errors(pa, path):
        batches = _parquet_batches(path, names) if table_kind(path) == "parquet" else _arrow_batches(pa, path, names)
        for batch in batches:
            budget.add(batch.num_rows, sum(_decoded_bytes(pa, batch.column(name)) for name in names))
            for name in names:
                chunks[name].append(batch.column(name))
        return {name: _from_arrow(pa, f"{path}: column {name!r}", parts) for name, parts in chunks.items()}


def table_arrays(
    path: Path, features: list[str] | None, label: str
) -> tuple[np.ndarray, np.ndarray, tuple[str, ...] | None]:
    """``(features float32 (N, F), labels int64 (N,), classes or None)`` of a table."""
    if features is None:
        features = [name for name in numeric_columns(path) if name != label]
        if not features:
            raise ArgumentError("{path}: no numeric column besides {label!r}: choose {features:COL,...}", path=path,
                                label=label)
    if label in features:
        raise TableError(f"{path}: {label!r} is the label; it cannot be a feature too")
    columns = read_columns(path, [*features, label])
    parts = []
    for name in features:
        column = columns[name]
        if isinstance(column, list):
            raise ArgumentError("{path}: column {name!r} holds text, not numbers: choose other {features} (or {text})",
                                path=path, name=name)
        with np.errstate(over="ignore"):  # a number beyond float32 becomes inf, refused just below
            part = column.astype(np.float32).reshape(len(column), -1)
        if not np.isfinite(part).all():
            row = int(np.nonzero(~np.isfinite(part).all(axis=1))[0][0])
            raise TableError(f"{path}: column {name!r} is not a finite number in row {row}")
        parts.append(part)
    labels, classes = _labels(path, label, columns[label])
    return np.concatenate(parts, axis=1), labels, classes


def table_documents(path: Path, column: str) -> list[tuple[str, str]]:
    """The strings of a text column, each named ``path row N`` for errors."""
    values = read_columns(path, [column])[column]
    if not isinstance(values, list):
        raise TableError(f"{path}: column {column!r} holds numbers, not text")
    return [(f"{path} row {i}", text) for i, text in enumerate(values)]


def _labels(path: Path, name: str, column: Column) -> tuple[np.ndarray, tuple[str, ...] | None]:
    if isinstance(column, list):
        classes = tuple(sorted(set(column)))
        index = {c: i for i, c in enumerate(classes)}
        return np.fromiter((index[v] for v in column), dtype=np.int64, count=len(column)), classes
    if column.ndim != 1:
        raise TableError(f"{path}: label column {name!r} holds lists; a label is one number or string")
    if column.dtype.kind == "f" and not (np.isfinite(column).all() and (column == np.round(column)).all()):
        raise TableError(f"{path}: label column {name!r} holds fractions; labels are class numbers (or strings)")
    if len(column) and not (column.min() >= 0 and column.max() <= MAX_LABEL):
        raise TableError(f"{path}: label column {name!r} holds numbers outside 0 to {MAX_LABEL}; classes count from 0")
    return column.astype(np.int64), None


class _Budget:
    """Rows and decoded bytes read so far, against :data:`MAX_ROWS` and :data:`MAX_TABLE_BYTES`."""

    def __init__(self, path: Path) -> None:
        self.path, self.rows, self.bytes = path, 0, 0

    def add(self, rows: int, size: int) -> None:
        self.rows += rows
        self.bytes += size
        if self.rows > MAX_ROWS:
            raise TableError(f"{self.path}: over {MAX_ROWS} rows")
        if self.bytes > MAX_TABLE_BYTES:
            raise TableError(f"{self.path}: the chosen columns decode to over {MAX_TABLE_BYTES} B")


# --- Parquet ----------------------------------------------------------------------------------------

def _parquet(path: Path, names: list[str] | None = None) -> Any:
    """The opened file, after its footer was read and checked against the file by
    :mod:`p2ptrain.data._parquet_footer` (and, given ``names``, their declared sizes against the
    budget); string columns among ``names`` are read as dictionaries, as stored, so their decoded
    size is counted before they are decoded."""
    pq = need("pyarrow.parquet", "reading a Parquet table")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(4)
        f.seek(max(size - 8, 0))
        tail = f.read(8)
        if tail[4:] == b"PARE":
            raise TableError(f"{path}: an encrypted Parquet file (not supported)")
        if size < 12 or head != b"PAR1" or tail[4:] != b"PAR1":
            raise TableError(f"{path}: not a Parquet file (no PAR1 at its start and end)")
        length = int.from_bytes(tail[:4], "little")
        if length > size - 12:
            raise TableError(f"{path}: its footer claims {length} B, more than the file's {size} B hold")
        if length > MAX_FOOTER_BYTES:
            raise TableError(f"{path}: a footer of {length} B, over the {MAX_FOOTER_BYTES} B limit")
        data_end = size - 8 - length
        f.seek(data_end)
        raw = f.read(length)
    try:
        footer = read_footer(raw, MAX_FOOTER_ENTRIES)
    except FooterError as exc:
        raise TableError(f"{path}: {exc}") from None
    _check_footer(path, footer, data_end, names or [])
    parquet = pq.ParquetFile(path, pre_buffer=False, thrift_string_size_limit=MAX_FOOTER_BYTES,
                             thrift_container_size_limit=MAX_FOOTER_ENTRIES, schema_depth_limit=MAX_SCHEMA_DEPTH)
    strings = [f.name for f in parquet.schema_arrow if names and f.name in names and _is_text(f.type)]
    if not strings:
        return parquet
    return pq.ParquetFile(path, read_dictionary=strings, pre_buffer=False, thrift_string_size_limit=MAX_FOOTER_BYTES,
                          thrift_container_size_limit=MAX_FOOTER_ENTRIES, schema_depth_limit=MAX_SCHEMA_DEPTH)


def _check_footer(path: Path, footer: Footer, data_end: int, names: list[str]) -> None:
    if not 0 <= footer.num_rows <= MAX_ROWS:
        raise TableError(f"{path}: its footer claims {footer.num_rows} rows, outside 0 to {MAX_ROWS}")
    if footer.row_groups > MAX_GROUPS or footer.schema_elements > MAX_COLUMNS:
        raise TableError(f"{path}: {footer.row_groups} row groups of {footer.schema_elements} schema elements, "
                         f"over {MAX_GROUPS} or {MAX_COLUMNS}")
    declared = 0
    for chunk in footer.chunks:
        if chunk.start < 4 or chunk.end > data_end:
            raise TableError(f"{path}: its footer puts column {chunk.column!r} at bytes {chunk.start}-{chunk.end}, "
                             f"outside the file's data (4-{data_end}): the footer does not describe this file")
        if chunk.uncompressed < 0:
            raise TableError(f"{path}: its footer gives column {chunk.column!r} a negative size")
        declared += chunk.uncompressed if chunk.column in names else 0
    if declared > MAX_TABLE_BYTES:
        raise TableError(f"{path}: the chosen columns are {declared} B uncompressed, over {MAX_TABLE_BYTES}")


def _parquet_batches(path: Path, names: list[str]) -> Iterator[Any]:
    parquet = _parquet(path, names)
    _has_columns(path, parquet.schema_arrow.names, names)
    yield from parquet.iter_batches(batch_size=BATCH_ROWS, columns=names)


# --- Arrow IPC -------------------------------------------------------------------------------------

def _arrow(pa: Any, path: Path) -> Any:
    """The opened IPC file (memory-mapped: batches are views of it), its footer checked first."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(6)
        f.seek(max(size - 10, 0))
        tail = f.read(10)
    if size < 18 or head != b"ARROW1" or tail[4:] != b"ARROW1":
        raise TableError(f"{path}: not an Arrow IPC file (no ARROW1 at its start and end)")
    footer = int.from_bytes(tail[:4], "little", signed=True)
    if not 0 < footer <= min(size - 18, MAX_FOOTER_BYTES):
        raise TableError(f"{path}: its footer claims {footer} B, outside the file's {size} B or the "
                        f"{MAX_FOOTER_BYTES} B limit")
    reader = pa.ipc.open_file(pa.memory_map(str(path)))
    if len(reader.schema.names) > MAX_COLUMNS or reader.num_record_batches > MAX_GROUPS:
        raise TableError(f"{path}: {len(reader.schema.names)} columns in {reader.num_record_batches} batches, "
                        f"over {MAX_COLUMNS} or {MAX_GROUPS}")
    return reader


def _arrow_batches(pa: Any, path: Path, names: list[str]) -> Iterator[Any]:
    reader = _arrow(pa, path)
    _has_columns(path, reader.schema.names, names)
    for i in range(reader.num_record_batches):
        batch = reader.get_batch(i).select(names)
        batch.validate(full=True)  # offsets and lengths inside the buffers, before anything reads them
        yield batch


# --- Arrow arrays to columns -----------------------------------------------------------------------

@contextmanager
def _arrow_errors(pa: Any, path: Path) -> Iterator[None]:
    """pyarrow's errors (bad bytes, a schema it cannot read, an allocation refused) as one line."""
    try:
        yield
    except TableError:
        raise
    except (pa.ArrowException, OSError, ValueError, MemoryError) as exc:
        raise TableError(f"{path}: cannot be read as a table: {str(exc).splitlines()[0][:300]}") from None


def _has_columns(path: Path, have: list[str], names: list[str]) -> None:
    twice = sorted({n for n in names if have.count(n) > 1})
    if twice:
        raise TableError(f"{path}: more than one column is named {twice[0]!r}")
    missing = [n for n in names if n not in have]
    if missing:
        raise TableError(f"{path}: no column {missing[0]!r} (it has {', '.join(have[:20])})")


def _numeric(pa: Any, kind: Any) -> bool:
    return bool(pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind))


def _is_list(pa: Any, kind: Any) -> bool:
    return bool(pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind))


def _is_text(kind: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind)
                or pa.types.is_large_binary(kind))


def _decoded_bytes(pa: Any, array: Any) -> int:
    """What ``array`` will take once decoded: a dictionary-encoded column counts each value's length
    at every row that refers to it (a 1 MB string named by a million rows is a TB of text)."""
    if not pa.types.is_dictionary(array.type):
        return int(array.nbytes)
    compute = need("pyarrow.compute", "reading a Parquet or Arrow table")
    if not _is_text(array.type.value_type):
        return int(array.nbytes)
    lengths = compute.binary_length(array.dictionary).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    indices = array.indices.fill_null(0).to_numpy(zero_copy_only=False)
    if len(indices) and (indices.min() < 0 or indices.max() >= len(lengths)):
        raise ValueError("a dictionary index points outside its dictionary")
    return int(lengths[indices].sum()) + 8 * len(array) if len(lengths) else 0


def _from_arrow(pa: Any, where: str, chunks: list[Any]) -> Column:
    if not chunks or sum(len(c) for c in chunks) == 0:
        raise TableError(f"{where}: the table has no rows")
    array = pa.chunked_array(chunks)
    if pa.types.is_dictionary(array.type):
        array = array.cast(array.type.value_type)  # its decoded size was counted in the budget
    if array.null_count:
        raise TableError(f"{where}: {array.null_count} empty (null) values")
    kind = array.type
    column: Column
    if _numeric(pa, kind):
        column = array.to_numpy()
        return column
    if _is_list(pa, kind) and _numeric(pa, kind.value_type):
        compute = need("pyarrow.compute", "reading a Parquet or Arrow table")
        lengths = compute.list_value_length(array).to_numpy()
        flat = compute.list_flatten(array)
        if len(set(lengths.tolist())) != 1 or lengths[0] == 0 or flat.null_count:
            raise TableError(f"{where}: lists of numbers must all have one length (> 0) and no empty values")
        column = flat.to_numpy().reshape(len(array), int(lengths[0]))
        return column
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        column = array.to_pylist()
        return column
    raise TableError(f"{where}: a column of {str(kind)[:80]}; a dataset reads numbers, lists of numbers or strings")


# --- JSON Lines ------------------------------------------------------------------------------------

def _jsonl_rows(path: Path) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """``(line number, bytes, row)`` of each non-blank line; a line is read with a bound, so a
    1 GB line costs :data:`MAX_LINE_BYTES` of memory before it is refused."""
    with open(path, "rb") as f:
        for number in count(1):
            line = f.readline(MAX_LINE_BYTES + 1)
            if not line:
                return
            if len(line) > MAX_LINE_BYTES:
                raise TableError(f"{path}, line {number}: over the {MAX_LINE_BYTES} B limit of a JSON Lines row")
            if not line.strip():
                continue
            try:
                row = boundedjson.loads(line, max_depth=MAX_LINE_DEPTH, what=f"{path}, line {number}")
            except boundedjson.JSONBoundsError as exc:
                raise TableError(str(exc)) from None
            if type(row) is not dict:
                raise TableError(f"{path}, line {number}: not a JSON object")
            yield number, len(line), row


def _read_jsonl(path: Path, names: list[str]) -> dict[str, Column]:
    budget = _Budget(path)
    values: dict[str, list[Any]] = {name: [] for name in names}
    for number, size, row in _jsonl_rows(path):
        budget.add(1, size)
        for name in names:
            value = row.get(name)
            if value is None:
                raise TableError(f"{path}, line {number}: no value for {name!r}")
            values[name].append(value)
    return {name: _from_values(f"{path}: column {name!r}", column) for name, column in values.items()}


def _is_number(value: Any) -> bool:
    return type(value) in (int, float, bool)


def _from_values(where: str, values: list[Any]) -> Column:
    if not values:
        raise TableError(f"{where}: the table has no rows")
    if all(map(_is_number, values)):
        return np.asarray(values)
    if all(type(v) is str for v in values):
        return values
    if all(type(v) is list for v in values):
        width = len(values[0])
        if width and all(len(v) == width and all(map(_is_number, v)) for v in values):
            return np.asarray(values, dtype=np.float64)
        raise TableError(f"{where}: lists must all hold numbers and have one length (> 0)")
    raise TableError(f"{where}: values must all be numbers, all strings, or all lists of numbers")
