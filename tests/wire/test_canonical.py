"""Canonical JSON byte for byte: these bytes are hashed into CIDs and signed, so a change to how any
of them is encoded orphans every published task, manifest and model record.

Pinned before the six canonical-JSON encoders became one (:func:`p2ptrain.base.boundedjson.canonical`);
non-ASCII text and floats in exponent form are where encoder options would show.
"""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain.base.boundedjson import canonical
from p2ptrain.data import Manifest, _manifest as manifest_module
from p2ptrain.data._manifest import ShardRef, TensorSpec
from p2ptrain.ipfs import EmbeddedStore
from p2ptrain.protocol._lineage import entry_bytes
from p2ptrain.protocol import attest, model_bytes, sign_record
from p2ptrain.protocol._records import record_id
from p2ptrain.task import TaskError, load_task, task_bytes
from p2ptrain.wire import ConfirmedRecord, ModelRecord, encode

KEY = create_new_key_pair(b"\x02" * 32)
CID = "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o"
TASK = f"""
name = "mnist-\u00e9t\u00e9 \U0001f680"
[model]
name = "mlp"
kwargs = {{ hidden = [32, 16] }}
[dataset]
manifest = "{CID}"
[optimizer]
name = "sgd"
lr = 0.1
weight_decay = 1e-7
[training]
batch_size = 16
total_steps = 10
"""
RECORD = ModelRecord(
    task_cid=CID, version=3, parent=CID, round=12, step=40, members=("b", "a"),
    metrics={"loss": 0.1, "acc": 1e-7, "n\u00e9": 2.5}, model_cid=CID, optimizer_cid=CID, term=2, coordinator="x",
)
RECORD_SIGNATURE = (
    "60948d5bd58ca8852666b572cd6dfe5d5e1c68e401da87a71bf118bc015ecd3e06403dfc1946e9bad98f60cd982220a3eb66fed8247934b2ea5af980eac0a008"
)


def test_task_bytes_and_cid(tmp_path) -> None:
    data = task_bytes(load_task(TASK))
    assert data == (
        b'{"compression":{"density":0.01,"error_feedback":true,"fp16_values":false,"robust":"none"},'
        b'"dataset":{"manifest":"QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o","test_split":"test",'
        b'"train_split":"train"},"model":{"kwargs":{"hidden":[32,16]},"name":"mlp"},'
        b'"name":"mnist-\\u00e9t\\u00e9 \\ud83d\\ude80","optimizer":{"lr":0.1,"momentum":0.0,"name":"sgd",'
        b'"weight_decay":1e-07},"peers":{"max":64,"min":1},"requirements":{"device":"cpu","min_memory_mb":0},'
        b'"schedule":{"min_lr_ratio":0.0,"name":"constant","warmup_steps":0},"seed":0,'
        b'"training":{"batch_size":16,"checkpoint_interval":10,"eval_batch_size":256,"sync_interval":1,'
        b'"total_steps":10}}\n'
    )
    assert EmbeddedStore(tmp_path).add_bytes(data, only_hash=True) == "QmWNCWKHbHBXeVosdw5dw4QFT3FckfWCe9VB1BQxVD5KDy"


def test_manifest_bytes_and_cid(tmp_path) -> None:
    manifest = Manifest(
        "donnees-v1.2_x", TensorSpec("float32", (2, 3)), TensorSpec("int64", ()),
        {"train": (ShardRef(CID, 10),), "test": (ShardRef(CID, 3),)},
    )
    data = manifest.to_json()
    assert data == (
        b'{"features":{"dtype":"float32","shape":[2,3]},"labels":{"dtype":"int64","shape":[]},'
        b'"name":"donnees-v1.2_x","schema":"p2ptrain.dataset","splits":{"test":[{"cid":'
        b'"QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o","num_samples":3}],"train":[{"cid":'
        b'"QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o","num_samples":10}]},"version":1}'
    )
    assert manifest.save(EmbeddedStore(tmp_path)) == "bafkreibbncr2ts22tgfpleo677uqw7o4v4rotl2qmdthbyniwnvhcbboyu"


def test_signed_record_attestation_and_their_ids() -> None:
    signed = sign_record(RECORD, KEY)
    assert signed.signature == RECORD_SIGNATURE  # Ed25519 is deterministic: same bytes, same signature
    # As a chain keeps it. Changed once, on purpose, in issue 27: a record names the attempt of its
    # span's plan (so its signature and id changed), carries the votes that elected its signer, and a
    # chain line keeps the attestations that confirmed it.
    assert entry_bytes(ConfirmedRecord(signed=signed, attestations=())) == (
        b'{"attestations":[],"signed":{"record":{"attempt":0,"coordinator":"12D3KooWJWoaqZhDaoEFshF7Rh1bpY9ohihFhzcW6d69Lr2NASuq","members":["b","a"],'
        b'"metrics":{"acc":1e-07,"loss":0.1,"n\\u00e9":2.5},"model_cid":"QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o",'
        b'"optimizer_cid":"QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o","parent":"QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o",'
        b'"round":12,"step":40,"task_cid":"QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o","term":2,"version":3},'
        b'"signature":"' + RECORD_SIGNATURE.encode() + b'","votes":[]}}'
    )
    assert record_id(signed.record) == "6e7324dcacc7adf09678dd228b65e943dd16c7dcb93b219e0930171344281933"
    assert attest(signed.record, CID, CID, KEY).signature == (
        "52ae6070935337ae604e1c62bc536a0b96421fd09974f0b0dce9903d97988d6a839337dfb1d07a636beafc67e0ee53705ecc35dc7e05feaa00375f9d4bb64707"
    )


def test_model_file_with_its_card() -> None:
    module = torch.nn.Linear(2, 1)
    with torch.no_grad():
        module.weight.copy_(torch.tensor([[1.0, 2.0]]))
        module.bias.copy_(torch.tensor([0.5]))
    data = model_bytes(module, {"name": "mlp", "kwargs": {"hidden": [32, 16], "p": 0.1, "s": "\u00e9"}})
    assert hashlib.sha256(data).hexdigest() == "3598e5ac2549be87e6f6fe1ee9f599266533be1cad0687f66f97a41c30d6e8c8"


def test_signed_wire_message() -> None:
    data = encode(sign_record(RECORD, KEY), KEY, seq=5, ts=1700000000.25)
    # Changed once, on purpose, in issue 27 (see above).
    assert hashlib.sha256(data).hexdigest() == "6caa08d3e09e26b75890c299df20ad36eb8ee535e4810b17bcb3f2f1ea877bbe"


# --- the options the old encoders differed in ------------------------------------------------------
# codec, signing and task bytes used exactly canonical()'s options. The model card and the stored
# record allowed NaN, the manifest wrote non-ASCII text raw: below, the values those callers can
# produce are shown to encode the same either way.

_FINITE_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(_FINITE_JSON)
def test_allowing_nan_changes_no_finite_value(value) -> None:
    """Records and model cards: their old encoder allowed NaN; for every finite value the bytes agree."""
    assert canonical(value) == json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def test_no_record_or_card_can_hold_nan() -> None:
    """A record is signed (always NaN-free) before it is stored; a card's kwargs come from a task, whose
    values are finite, and a card with NaN was unreadable anyway (the reader refuses NaN)."""
    with pytest.raises(ValueError):
        sign_record(ModelRecord(**{**RECORD.__dict__, "metrics": {"loss": math.nan}}), KEY)
    with pytest.raises(TaskError, match="model.kwargs.p"):
        load_task(TASK.replace("hidden = [32, 16]", "hidden = [32, 16], p = nan"))
    with pytest.raises(ValueError):
        canonical({"kwargs": {"p": math.inf}})


_NAMES = st.from_regex(manifest_module._NAME, fullmatch=True)
_SPECS = st.builds(TensorSpec, st.sampled_from(sorted(manifest_module.DTYPES)),
                   st.lists(st.integers(1, 64), max_size=3).map(tuple))
_SHARDS = st.lists(st.builds(ShardRef, st.just(CID), st.integers(1, 1000)), min_size=1, max_size=3).map(tuple)


@settings(max_examples=200, deadline=None)
@given(st.builds(Manifest, _NAMES, _SPECS, _SPECS, st.dictionaries(_NAMES, _SHARDS, min_size=1, max_size=3)))
def test_every_valid_manifest_is_ascii_so_escaping_changes_nothing(manifest: Manifest) -> None:
    """The manifest's old encoder wrote non-ASCII raw (``ensure_ascii=False``); but every string a
    manifest may hold (names, splits, dtypes, CIDs) is ASCII, so its bytes are the same."""
    raw = manifest.to_dict()
    data = manifest.to_json()
    assert data == json.dumps(raw, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    assert Manifest.from_json(data) == manifest
