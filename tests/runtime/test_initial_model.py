"""A task's ``initial_model`` is fetched and read within what a model of the task's architecture
takes (issue 27): an honest one, held by another peer, starts the run from its weights; one over
the bound is refused with the bound named, and what was fetched of it is not kept."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import pytest
import trio

from p2ptrain.ipfs import CHUNK_SIZE, dag_bytes_limit, parse_cid, walk_dag
from p2ptrain.testing import local_peers, publish_digits_task
from p2ptrain.models import build_model, model_file_limit
from p2ptrain.protocol import model_bytes

pytestmark = pytest.mark.usefixtures("quick_timers")  # tests/conftest.py: the protocol's idle waits shortened

KWARGS = {"in_features": 64, "hidden": [16], "out_features": 10}  # testing.DIGITS_TASK's model


async def test_an_honest_initial_model_starts_the_run_and_one_over_the_bound_is_refused(tmp_path: Path) -> None:
    module = build_model("mlp", KWARGS, seed=7)
    with torch.no_grad():
        module[1].bias.fill_(0.25)  # not what the task's seed gives: the run must start from these
    honest = model_bytes(module, {"name": "mlp", "kwargs": KWARGS})
    limit = model_file_limit("mlp", KWARGS)
    assert len(honest) <= limit < len(honest) + 70_000  # the header allowance, not a multiple
    big = os.urandom(limit + CHUNK_SIZE)  # two chunks: a root and leaves to (not) fetch
    async with local_peers(2, tmp_path) as peers:
        owner, joiner = peers[0], peers[1]
        honest_cid = await trio.to_thread.run_sync(owner.content.store.add_bytes, honest)
        big_cid = await trio.to_thread.run_sync(owner.content.store.add_bytes, big)
        good = await publish_digits_task(owner, name="honest", total_steps=1000, initial_model=honest_cid)
        bad = await publish_digits_task(owner, name="too-big", total_steps=1000, initial_model=big_cid)
        with trio.fail_after(60):
            good_run = await joiner.tasks.join(good)
            bad_run = await joiner.tasks.join(bad)

            def settled() -> bool | None:
                return (good_run.shared.initial_cid is not None or good_run.shared.phase == "failed") \
                    and bad_run.shared.phase == "failed" or None

            await peers.wait_until(settled, 60, what="the honest run started and the other failed")
        assert good_run.shared.error is None
        assert good_run.shared.initial_cid == honest_cid  # the weights it loaded, serialized again
        assert f"over the {dag_bytes_limit(limit)} byte limit" in bad_run.shared.error, bad_run.shared.error
        its_blocks = list(walk_dag(parse_cid(big_cid), owner.content.store.blocks.get))
        assert len(its_blocks) == 3
        assert not any(joiner.content.store.blocks.has(cid) for cid in its_blocks)


async def test_a_members_own_module_reads_the_initial_model_within_what_it_takes(tmp_path: Path) -> None:
    """p2ptrain.Optimizer's members load the run's initial weights into their own module
    (api.rendezvous.load_initial): within what a file of that module's tensors takes. Before: any
    size was fetched and read whole."""
    import pytest

    from p2ptrain.api._rendezvous import load_initial
    from p2ptrain.ipfs import ContentUnavailable
    from p2ptrain.models import file_bytes_bound
    from p2ptrain.task import task_from_bytes

    first = build_model("mlp", KWARGS, seed=7)
    honest = model_bytes(first, {"name": "mlp", "kwargs": KWARGS})
    limit = file_bytes_bound(first.state_dict().values())
    big = os.urandom(limit + CHUNK_SIZE)
    async with local_peers(2, tmp_path) as peers:
        owner, member = peers[0], peers[1]
        honest_cid = await trio.to_thread.run_sync(owner.content.store.add_bytes, honest)
        big_cid = await trio.to_thread.run_sync(owner.content.store.add_bytes, big)
        good = await publish_digits_task(owner, name="honest", initial_model=honest_cid)
        bad = await publish_digits_task(owner, name="too-big", initial_model=big_cid)
        good_task, bad_task = (task_from_bytes(owner.content.store.cat(cid)) for cid in (good, bad))
        mine = build_model("mlp", KWARGS, seed=8)
        with trio.fail_after(60):
            await load_initial(member, good_task, mine)
            assert all(torch.equal(a, b) for a, b in zip(mine.state_dict().values(), first.state_dict().values()))
            with pytest.raises(ContentUnavailable, match=f"over the {dag_bytes_limit(limit)} byte limit"):
                await load_initial(member, bad_task, build_model("mlp", KWARGS, seed=8))
        its_blocks = list(walk_dag(parse_cid(big_cid), owner.content.store.blocks.get))
        assert not any(member.content.store.blocks.has(cid) for cid in its_blocks)
