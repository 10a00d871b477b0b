"""A member that starts its script after the first member already took its run (that one waits for
``min_peers``, so its run has no head with members yet) joins that run, whatever the CIDs: before,
it took the lowest CID among the candidates it heard, its own about half the time, and the two
members waited apart for each other for ever (seen in an in-process run of two members)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import trio
from torch import nn

import p2ptrain
from p2ptrain.api._background import BackgroundPeer
from p2ptrain.api._rendezvous import Chosen, choose_run
from p2ptrain.ipfs import open_store
from p2ptrain.node import NodeConfig, free_port
from p2ptrain.task import task_bytes, task_from_bytes

DEADLINE_S = 60.0


def test_a_later_member_joins_the_run_a_waiting_member_took_even_when_its_own_cid_sorts_first(
        tmp_path: Path) -> None:
    model = nn.Linear(4, 2)
    with p2ptrain.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, run="meet", home=tmp_path / "a",
                            min_peers=2, listen=[f"/ip4/127.0.0.1/tcp/{free_port()}"], join_window_s=0.5,
                            total_steps=100) as first:
        theirs = task_from_bytes(open_store(tmp_path / "a").cat(first.run_cid))
        later = BackgroundPeer(tmp_path / "b", NodeConfig(listen=[f"/ip4/127.0.0.1/tcp/{free_port()}"],
                                                          bootstrap=first.addresses))
        try:
            async def choose() -> tuple[str, Chosen]:
                peer = later.peer
                assert peer is not None
                # This member's own candidate: the same run but for its publisher, one whose CID
                # sorts before the first member's (the lowest-CID rule alone would take it).
                for i in range(200):
                    own_cid = str(peer.content.store.add_bytes(task_bytes(replace(theirs, publisher=f"p{i}"))))
                    if own_cid < first.run_cid:
                        break
                with trio.fail_after(DEADLINE_S):
                    return own_cid, await choose_run(peer, "meet", own_cid, first._card, 3.0, expect_peers=True)

            own_cid, chosen = later.call(choose)
        finally:
            later.close()
        assert own_cid < first.run_cid
        assert chosen.task_cid == first.run_cid and not chosen.own


def test_a_model_on_a_gpu_makes_a_task_that_needs_cuda() -> None:
    """Members attest each other's bits and a GPU's steps round differently from a CPU's: the same
    script on a GPU and on a CPU must meet in two runs (tests/gpu/test_cuda_api.py checks the GPU side)."""
    from p2ptrain.api._optimizer import _task

    options = {"density": 0.1, "robust": "none", "quantize": None, "total_steps": 10, "checkpoint_every": 5,
               "min_peers": 2, "max_peers": 8, "mode": "sync"}
    args = ("meet", "Qm" + "a" * 44, "Qm" + "b" * 44, options, None, None)
    on_cpu, on_gpu = _task(*args), _task(*args, device="cuda")
    assert on_cpu.requirements.device == "cpu" and on_gpu.requirements.device == "cuda"
    assert task_bytes(on_cpu) != task_bytes(on_gpu)
