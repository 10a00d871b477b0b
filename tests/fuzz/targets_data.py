"""Fuzz targets of ``dataset add``'s decoders: a JSON Lines row, Parquet and Arrow IPC files, a
tokenizer.json (also fetched by CID from the network), and PNG/JPEG files of an image folder.

These decoders read files, so each case is written to a file in a scratch folder first, then read
through the same function ``dataset add`` calls. A JSON seed (a JSON Lines row, a tokenizer) gets
the fuzzer's JSON attacks (deep nesting, huge numbers, non-finite values); binary seeds get bit
flips, cuts and splices, which reach pyarrow's and Pillow's own decoders behind our checks.
"""

from __future__ import annotations

import io
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
from _p2ptrain_fuzzing import FuzzTarget
from PIL import Image
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

from p2ptrain.data._images import ImageError, read_image_folder
from p2ptrain.data._tables import TableError, table_arrays
from p2ptrain.data._tokens import TokenizerError, parse_tokenizer

_SCRATCH = tempfile.TemporaryDirectory(prefix="p2ptrain-fuzz-data-")
_ROOT = Path(_SCRATCH.name)


def _file(name: str, data: bytes) -> Path:
    path = _ROOT / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


# --- tables -------------------------------------------------------------------------------------

_ROWS = [b'{"x":[0.5,1.5],"y":1}', b'{"x":[3,4],"y":2,"note":"a row"}', b'{"x":[-1e3,2.25],"y":0,"z":[1,[2]]}']


def _jsonl_row(data: bytes) -> object:
    """One fuzzed row after a valid one, read as features ``x`` and label ``y``."""
    return table_arrays(_file("t.jsonl", _ROWS[0] + b"\n" + data + b"\n"), ["x"], "y")


def _table_bytes(write, table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    write(table, sink)
    return sink.getvalue().to_pybytes()


_TABLE = pa.table({"x": pa.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], pa.list_(pa.float32(), 2)),
                   "s": pa.array(["a", "b", "a"]).dictionary_encode(), "y": [0, 1, 2]})
_PARQUET = [_table_bytes(pq.write_table, _TABLE),
            _table_bytes(lambda t, s: pq.write_table(t, s, row_group_size=1, compression="zstd"), _TABLE)]
_ARROW = [_table_bytes(lambda t, s: feather.write_feather(t, s, compression="uncompressed"), _TABLE),
          _table_bytes(lambda t, s: feather.write_feather(t, s, compression="lz4", chunksize=1), _TABLE)]


def _parquet(data: bytes) -> object:
    return table_arrays(_file("t.parquet", data), None, "y")


def _arrow(data: bytes) -> object:
    return table_arrays(_file("t.arrow", data), None, "s")


# --- tokenizers -----------------------------------------------------------------------------------

def _tokenizer_json(with_normalizer: bool) -> bytes:
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    if with_normalizer:
        tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    trainer = trainers.BpeTrainer(vocab_size=40, special_tokens=["[UNK]", "</s>"], show_progress=False)
    tokenizer.train_from_iterator(["hello world, the fuzzer says hello"] * 4, trainer)
    return tokenizer.to_str().encode()


_TOKENIZERS = [_tokenizer_json(False), _tokenizer_json(True)]


# --- images -------------------------------------------------------------------------------------

def _image_bytes(mode: str, kind: str) -> bytes:
    shape = (8, 8, 3) if mode == "RGB" else (8, 8)
    pixels = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, mode).save(out, kind)
    return out.getvalue()


_IMAGES = [_image_bytes("L", "PNG"), _image_bytes("RGB", "PNG"), _image_bytes("L", "JPEG"), _image_bytes("RGB", "JPEG")]


def _image(data: bytes) -> object:
    """A folder of one class holding the fuzzed file (as .png; Pillow goes by the bytes, not the name)."""
    _file("images/c/x.png", data)
    return read_image_folder(_ROOT / "images", size=(8, 8))


TARGETS = [
    FuzzTarget("data.jsonl_row", _jsonl_row, (TableError,), _ROWS),
    FuzzTarget("data.parquet", _parquet, (TableError,), _PARQUET),
    FuzzTarget("data.arrow", _arrow, (TableError,), _ARROW),
    FuzzTarget("data.tokenizer", parse_tokenizer, (TokenizerError,), _TOKENIZERS),
    FuzzTarget("data.image", _image, (ImageError,), _IMAGES),
]
