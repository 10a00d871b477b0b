"""``model serve --latest TASK --bootstrap ADDR`` with no node running for the home: one temporary
node for the server's life, not one per lookup. A real holder peer answers head requests from the
chain on its disk; the server (in this process, built as ``model serve`` builds it) follows the
task from v1 to v2 through its temporary node, and that node started once."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import trio

from p2ptrain.base import short_id
from p2ptrain.serve import TemporaryFollower, open_model, predict
from p2ptrain.testing import attestations_for, local_peers, proven_record, rules_task
from p2ptrain.models import build_model
from p2ptrain.protocol import Chain, model_bytes
from p2ptrain.wire import ModelRecord

CARD = {"name": "mlp", "kwargs": {"in_features": 64, "hidden": [32], "out_features": 10}}
# The holder starts, the server's node connects, two heads are found and verified, two models
# fetched: seconds alone; room for a loaded box.
DEADLINE_S = 90.0
# A lookup listens this long for a newer head (LOOKUP_S, 5 s, in a server): short, so that several
# lookups fit in the test.
LOOKUP_S = 0.5
LOOKUPS = 4


async def test_latest_through_bootstrap_keeps_one_temporary_node_for_the_servers_life(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="p2ptrain.node")
    with trio.fail_after(DEADLINE_S):
        async with local_peers(1, tmp_path / "holder") as peers:
            holder = peers[0]
            store = holder.content.store
            task_cid, rules = rules_task(store)
            models = [store.add_bytes(model_bytes(build_model(CARD["name"], CARD["kwargs"], seed), CARD), cid_version=1)
                      for seed in (1, 2)]
            chain = Chain(task_cid, models[0], rules)
            chain_file = holder.node.home / "tasks" / task_cid / "chain.jsonl"
            chain_file.parent.mkdir(parents=True)

            def confirm(model: str) -> None:  # what a member keeps of a run: its chain on disk
                record = ModelRecord(task_cid=task_cid, version=chain.version + 1, parent=chain.head_cid,
                                     round=chain.version, step=chain.version + 1, members=(),
                                     metrics={"accuracy": 0.5}, model_cid=model, optimizer_cid=model, term=1,
                                     coordinator="")
                signed = proven_record(record, holder.node.key_pair, [holder.node.key_pair])
                chain.append(signed, attestations_for(signed.record, [holder.node.key_pair]))
                chain_file.write_bytes(chain.to_bytes())

            confirm(models[0])
            home = tmp_path / "server"
            async with trio.open_nursery() as nursery:
                follower = TemporaryFollower(home, holder.node.addrs[:1], task_cid, lookup_s=LOOKUP_S)
                await nursery.start(follower.run)
                server = await trio.to_thread.run_sync(lambda: open_model(
                    latest=task_cid, resolve=follower.latest_blocking, home=home, device="cpu",
                    listen="127.0.0.1:0", follow_every_s=0.01))
                assert server.batcher.current.cid == models[0]
                url = await nursery.start(server.run)
                confirm(models[1])  # the run's next checkpoint: the server follows it
                while server.batcher.current.cid != models[1] or follower.lookups < LOOKUPS:
                    await trio.sleep(0.05)
                answer = await trio.to_thread.run_sync(predict, url, torch.zeros(1, 64).tolist())
                assert answer["model_cid"] == models[1] and server.follow_failures == 0
                nursery.cancel_scope.cancel()
    started = [r for r in caplog.records
               if r.getMessage().startswith(f"node {short_id(follower.node.peer_id)} listening on")]
    assert len(started) == 1, f"{len(started)} node starts for {follower.lookups} lookups"
