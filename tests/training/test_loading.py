"""p2ptrain.load_model: a model CID (or file) alone gives back a ready module, never code from the file."""

import pytest
import torch
import trio

import p2ptrain
from p2ptrain.base import UserError
from p2ptrain.ipfs import ContentUnavailable, EmbeddedStore, open_store
from p2ptrain.models import build_model
from p2ptrain.protocol import RecordError, model_bytes
from p2ptrain.testing import local_peers

DEADLINE_S = 60.0  # one peer starts and a temporary node fetches a small model from it on loopback
CARD = {"name": "mlp", "kwargs": {"in_features": 64, "hidden": [32], "out_features": 10}}


def test_load_by_cid_and_by_path_rebuilds_the_same_function(tmp_path):
    module = build_model(CARD["name"], CARD["kwargs"], seed=7)
    data = model_bytes(module, CARD)
    store = EmbeddedStore(tmp_path / "home")
    cid = store.add_bytes(data)
    x = torch.randn(5, 64)
    by_cid = p2ptrain.load_model(cid, store=store)
    path = tmp_path / "m.safetensors"
    path.write_bytes(data)
    by_path = p2ptrain.load_model(path)
    with torch.no_grad():
        assert torch.equal(by_cid(x), module.eval()(x))
        assert torch.equal(by_path(x), module(x))
    assert not by_cid.training


def test_refuses_files_without_a_card_or_with_an_unknown_architecture(tmp_path):
    module = build_model(CARD["name"], CARD["kwargs"], seed=0)
    bare = tmp_path / "bare.safetensors"
    bare.write_bytes(model_bytes(module))
    with pytest.raises(RecordError, match="names no architecture"):
        p2ptrain.load_model(bare)
    evil = tmp_path / "evil.safetensors"
    evil.write_bytes(model_bytes(module, {"name": "os.system", "kwargs": {}}))
    with pytest.raises(RecordError, match="unknown model .os.system."):
        p2ptrain.load_model(evil)
    wrong = tmp_path / "wrong.safetensors"
    wrong.write_bytes(model_bytes(module, {"name": "mlp", "kwargs": {**CARD["kwargs"], "hidden": [16]}}))
    with pytest.raises(RecordError, match="does not fit|architecture needs"):
        p2ptrain.load_model(wrong)


def test_a_cid_the_store_lacks_is_a_clear_error(tmp_path):
    store = EmbeddedStore(tmp_path / "home")
    missing = EmbeddedStore(tmp_path / "other").add_bytes(b"not here")
    with pytest.raises(ContentUnavailable, match="p2ptrain model fetch"):
        p2ptrain.load_model(missing, store=store)
    with pytest.raises(FileNotFoundError):
        p2ptrain.load_model(tmp_path / "no-such-file", store=store)


async def test_bootstrap_fetches_a_cid_from_a_peer_into_a_fresh_home(tmp_path):
    """A fresh machine (a home with no store and no node) loads a model by CID from a peer of the
    mesh, as ``load_state(..., bootstrap=)`` does: a temporary node fetches it, verified, into the
    home's store. Red before: ``load_model`` took no ``bootstrap`` (TypeError), so a user had to
    start a node first."""
    module = build_model(CARD["name"], CARD["kwargs"], seed=3)
    x = torch.randn(4, 64)
    fresh = tmp_path / "fresh"
    with trio.fail_after(DEADLINE_S):
        async with local_peers(1, tmp_path) as (holder,):
            cid = holder.content.store.add_bytes(model_bytes(module, CARD))
            loaded = await trio.to_thread.run_sync(
                lambda: p2ptrain.load_model(cid, home=fresh, bootstrap=holder.node.addrs[:1]))
    with torch.no_grad():
        assert torch.equal(loaded(x), module.eval()(x))
    assert open_store(fresh).has(cid)  # kept: the next load needs no peer
    assert torch.equal(p2ptrain.load_model(cid, home=fresh)(x), loaded(x))
    with pytest.raises(UserError, match="pass home=, not store="):
        p2ptrain.load_model(EmbeddedStore(tmp_path / "o").add_bytes(b"x"), store=EmbeddedStore(tmp_path / "s"),
                            bootstrap=["/ip4/127.0.0.1/tcp/1"])
