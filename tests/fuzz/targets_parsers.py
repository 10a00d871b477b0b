"""Fuzz targets of the parsers of files and records from the network or disk, and of control lines.

Where a format wraps JSON in binary (a safetensors header, the model card inside one), the target
takes the JSON and wraps it as a peer would, so the fuzzer's JSON attacks (deep nesting, huge
integers, non-finite numbers) reach the JSON parser and the checks behind it.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import torch
from _p2ptrain_fuzzing import FuzzTarget, LazySeeds
from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain.data import Manifest, ManifestError, Pixels, TensorFileError, read_header
from p2ptrain.data._manifest import ShardRef, Standardize, TensorSpec, Tokens
from p2ptrain.data._shards import ShardError, decode_shard, encode_shard
from p2ptrain.ipfs import make_cid
from p2ptrain.control._socket import ControlRequestError, parse_request
from p2ptrain.training import manifest_bytes, ManifestError as StageManifestError, model_from_bytes, read_manifest, StageFile
from p2ptrain.models import build_model
from p2ptrain.testing import attestations_for, proven_record
from p2ptrain.protocol._lineage import entry_bytes
from p2ptrain.protocol import (RecordError, entry_from_bytes, model_bytes, read_statement, sign_statement, statement_bytes,
                               StatementError, tensors_bytes)
from p2ptrain.task import TaskError, load_task, task_bytes, task_from_bytes
from p2ptrain.wire import ConfirmedRecord, ModelRecord

CID = "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o"
SHARD_CID = make_cid(b"shard").encode("base32")

# --- manifests --------------------------------------------------------------------------------

MANIFESTS = [
    Manifest("toy", TensorSpec("float32", (2, 3)), TensorSpec("int64", ()),
             {"train": (ShardRef(SHARD_CID, 10),)}).to_json(),
    Manifest("digits", TensorSpec("float32", (64,)), TensorSpec("int64", ()),
             {"train": (ShardRef(SHARD_CID, 100), ShardRef(CID, 90)), "test": (ShardRef(SHARD_CID, 5),)}).to_json(),
    Manifest("toy-std", TensorSpec("float32", (3,)), TensorSpec("int64", ()), {"train": (ShardRef(SHARD_CID, 10),)},
             Standardize((0.5, -1e-05, 3.0), (1.25, 0.0, 4254.0))).to_json(),
    Manifest("images", TensorSpec("uint8", (3, 8, 8)), TensorSpec("int64", ()), {"train": (ShardRef(SHARD_CID, 10),)},
             classes=("cat", "dog"), pixels=Pixels((0.5, 0.4, 0.3), (0.25, 0.2, 0.2))).to_json(),
    Manifest("text", TensorSpec("uint16", (16,)), TensorSpec("uint16", (16,)), {"train": (ShardRef(SHARD_CID, 10),)},
             tokens=Tokens(50_257, SHARD_CID)).to_json(),
]

# --- tasks --------------------------------------------------------------------------------------

TASK_TOML = f"""
name = "t"
seed = 3
[model]
name = "mlp"
[model.kwargs]
hidden = [8, 8]
[dataset]
manifest = "{CID}"
[optimizer]
name = "adam"
lr = 0.001
[schedule]
name = "warmup"
warmup_steps = 2
[training]
batch_size = 16
total_steps = 10
[compression]
density = 0.5
[peers]
min = 2
""".encode()
TASK_TOML_SGD = TASK_TOML.replace(b'name = "adam"\nlr = 0.001', b'name = "sgd"\nlr = 0.1\nmomentum = 0.9')
# An hf model's config: a table the fuzzer's JSON attacks reach (models._hf checks it).
TASK_TOML_HF = TASK_TOML.replace(b'name = "mlp"\n[model.kwargs]\nhidden = [8, 8]',
                                 b'name = "hf"\nconfig = { model_type = "gpt2", n_layer = 1, n_embd = 8, n_head = 2, '
                                 b'vocab_size = 16, n_positions = 4, bos_token_id = 1, layer_norm_epsilon = 1e-06 }')
# A pipelined task: the cut is checked on the meta device at parse (models._pieces).
TASK_TOML_PIPELINE = TASK_TOML + b'[pipeline]\nstages = 2\nmicrobatch_size = 4\nactivations = "int8"\n'
TASK_BYTES = LazySeeds(lambda: [task_bytes(load_task(t)) for t in (TASK_TOML, TASK_TOML_SGD, TASK_TOML_HF, TASK_TOML_PIPELINE)])

# --- records ------------------------------------------------------------------------------------

KEYS = [create_new_key_pair() for _ in range(2)]


def _chain_line(version: int) -> bytes:
    """A chain line: a signed record with its certificate and both members' attestations."""
    signed = proven_record(ModelRecord(
        task_cid=CID, version=version, parent=CID, round=3 * version, step=3 * version, members=(),
        metrics={"loss": 0.5, "accuracy": 0.9}, model_cid=CID, optimizer_cid=CID, term=1, coordinator=""),
        KEYS[0], KEYS)
    return entry_bytes(ConfirmedRecord(signed=signed, attestations=attestations_for(signed.record, KEYS)))


RECORDS = [_chain_line(v) for v in (1, 2)]

# --- safetensors: headers, model files and their cards, shards --------------------------------

_BODY = bytes(range(32))


def _wrap(header: bytes, body: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header + body


def _header_of(data: bytes) -> bytes:
    n = int.from_bytes(data[:8], "little")
    return data[8 : 8 + n]


def _decode_header(header: bytes) -> object:
    return read_header(_wrap(header, _BODY))


HEADERS = [
    _header_of(tensors_bytes({"a": torch.zeros(4), "b": torch.zeros(2, dtype=torch.int64)})),
    _header_of(tensors_bytes({"w": torch.zeros(2, 2, dtype=torch.float64)}, metadata={"k": "v"})),
]

_MODEL = build_model("mlp", {"in_features": 4, "hidden": [4], "out_features": 2}, 0)
_CARD = {"name": "mlp", "kwargs": {"in_features": 4, "hidden": [4], "out_features": 2}}
_HF_CARD = {"name": "hf", "kwargs": {"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2, "vocab_size": 16,
                                     "n_positions": 4}}
MODEL_FILES = LazySeeds(lambda: [model_bytes(_MODEL, _CARD), model_bytes(build_model("hf", _HF_CARD["kwargs"], 0), _HF_CARD)])
CARDS = [json.dumps(_CARD, sort_keys=True, separators=(",", ":")).encode()]


def _decode_card(card: bytes) -> object:
    """A model file whose card is ``card`` (as text, when it is UTF-8): what a peer could publish."""
    try:
        text = card.decode()
    except UnicodeDecodeError:
        text = card.decode("latin-1")
    return model_from_bytes(tensors_bytes(_MODEL.state_dict(), metadata={"p2ptrain.model": text}))


_FEATURES, _LABELS = TensorSpec("float32", (2,)), TensorSpec("int64", ())
SHARDS = [encode_shard(np.arange(8, dtype=np.float32).reshape(4, 2), np.arange(4))]
_SHARD_BODY_LEN = len(SHARDS[0]) - 8 - int.from_bytes(SHARDS[0][:8], "little")


def _decode_shard(data: bytes) -> object:
    return decode_shard(data, _FEATURES, _LABELS, 4)


def _decode_shard_header(header: bytes) -> object:
    return decode_shard(_wrap(header, bytes(_SHARD_BODY_LEN)), _FEATURES, _LABELS, 4)


# --- control lines ------------------------------------------------------------------------------

CONTROL_LINES = [
    b'{"op":"status"}',
    b'{"op":"ipfs.fetch","cid":"' + CID.encode() + b'","timeout":300.0}',
    b'{"op":"task.publish","text":"name = \\"t\\"\\n","join":true}',
]

_PEERS = [str(i) * 52 for i in range(3)]
# A pipelined run's model manifest: its stages, their replicas and signatures (one stage unsigned).
STAGE_MANIFESTS = [manifest_bytes([
    StageFile(0, 1, CID, CID, 1000, tuple(_PEERS[:2]), tuple((p, "ab" * 64) for p in _PEERS[:2])),
    StageFile(2, 3, CID, CID, 50, (_PEERS[2],), ()),
])]

# A member's part of a pipelined checkpoint's gather: its signed stage statement.
STAGE_STATEMENTS = [statement_bytes(sign_statement(CID, 30, 1, (CID, SHARD_CID), create_new_key_pair(b"s" * 32)))]

TARGETS = [
    FuzzTarget("parsers.stage_manifest", read_manifest, (StageManifestError,), STAGE_MANIFESTS),
    FuzzTarget("parsers.stage_statement", read_statement, (StatementError,), STAGE_STATEMENTS),
    FuzzTarget("parsers.manifest", Manifest.from_json, (ManifestError,), MANIFESTS),
    FuzzTarget("parsers.task_bytes", task_from_bytes, (TaskError,), TASK_BYTES),
    FuzzTarget("parsers.task_toml", load_task, (TaskError,), [TASK_TOML, TASK_TOML_SGD, TASK_TOML_HF, TASK_TOML_PIPELINE]),
    FuzzTarget("parsers.chain_line", entry_from_bytes, (RecordError,), RECORDS),
    FuzzTarget("parsers.safetensors_header", _decode_header, (TensorFileError,), HEADERS),
    FuzzTarget("parsers.model_file", model_from_bytes, (RecordError,), MODEL_FILES),
    FuzzTarget("parsers.model_card", _decode_card, (RecordError,), CARDS),
    FuzzTarget("parsers.shard", _decode_shard, (ShardError,), SHARDS),
    FuzzTarget("parsers.shard_header", _decode_shard_header, (ShardError,), [_header_of(s) for s in SHARDS]),
    FuzzTarget("parsers.control_line", parse_request, (ControlRequestError,), CONTROL_LINES),
]
