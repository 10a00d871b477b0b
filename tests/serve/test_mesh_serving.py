"""Servers announced on the mesh: ``model serve`` beside a node announces its model CID through that
node; another peer's ``model predict CID`` (no --url) finds the server through its own node and gets
the answer. Real peers (local_peers), a real server, real HTTP; the directory's bounds checked on
the listening peer's own instance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import trio

from p2ptrain.cli.main import main
from p2ptrain.cli.serve import announce
from p2ptrain.services._served import MAX_MODELS_PER_PEER, SERVED_TTL_S
from p2ptrain.serve import Server
from p2ptrain.serve._server import load_served
from p2ptrain.testing import local_peers
from p2ptrain.models import build_model
from p2ptrain.protocol import model_bytes

CARD = {"name": "mlp", "kwargs": {"in_features": 64, "hidden": [16], "out_features": 10}}
# Peers start, the announcement crosses the mesh, the CLI call answers: each within this.
DEADLINE_S = 60.0


async def test_a_served_model_is_announced_and_model_predict_finds_its_server(tmp_path: Path,
                                                                             capsys: pytest.CaptureFixture[str]) -> None:
    async with local_peers(2, tmp_path) as peers:
        a, b = peers[0], peers[1]
        module = build_model(CARD["name"], CARD["kwargs"], 3)
        cid = a.content.store.add_bytes(model_bytes(module, CARD), cid_version=1)
        loaded = load_served(a.content.store, cid, torch.device("cpu"))
        server = Server(loaded, listen="127.0.0.1:0", announce=lambda model, url: announce(a.node.home, model, url))
        with trio.fail_after(DEADLINE_S):
            async with trio.open_nursery() as nursery:
                url = await nursery.start(server.run)
                await peers.wait_until(lambda: b.served.servers(cid), DEADLINE_S, what="b hears a's server")
                assert b.served.servers(cid) == [{"peer": a.node.peer_id.to_base58(), "url": url}]
                (tmp_path / "in.json").write_text(json.dumps([[0.25] * 64, [1.0] * 64]))
                argv = ["model", "predict", cid, str(tmp_path / "in.json"), "--home", str(b.node.home)]
                assert await trio.to_thread.run_sync(main, argv) == 0
                nursery.cancel_scope.cancel()
        answer = json.loads(capsys.readouterr().out)
        assert answer["model_cid"] == cid
        with torch.no_grad():
            assert torch.allclose(torch.tensor(answer["outputs"]), module(torch.tensor([[0.25] * 64, [1.0] * 64])), atol=1e-6)

        # The directory takes claims from anyone: bounded, checked, counted, and forgotten unless repeated.
        served = b.served
        assert not served.note("12D3KooWfake", cid, "file:///etc/passwd")
        assert not served.note("12D3KooWfake", "not-a-cid", "http://10.0.0.1:80")
        others = [a.content.store.add_bytes(b"model %d" % i, cid_version=1) for i in range(MAX_MODELS_PER_PEER + 1)]
        assert [served.note("12D3KooWfake", c, "http://10.0.0.1:80") for c in others].count(False) == 1
        assert served.rejected["bad"] == 2 and served.rejected["full"] == 1
        served._expire(trio.current_time() + SERVED_TTL_S + 1)
        assert served.servers(cid) == [] and served.table == {}
