"""A local-SGD run (DiLoCo outer steps, 2-bit sparse pseudo-gradients) on real loopback peers.

One run checked several ways (the suite's time budget): four members train digits in outer steps,
every checkpoint is confirmed by attestations (so every member computed the same bits), a member
stopped in the middle of its inner loop (seen there by `task status`: its inner step) does not stop
the run, a late joiner catches up from the outer state by CID, and the run ends at >= 90% test
accuracy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import pytest
import trio

from p2ptrain.cli.task import render_status
from p2ptrain.control import TaskStatus
from p2ptrain.testing import LocalPeers, local_peers
from p2ptrain.training import LocalSGDTrainer
from p2ptrain.protocol import Chain, read_chain

pytestmark = pytest.mark.usefixtures("quick_timers", "no_missed_plan")  # tests/conftest.py: the protocol's idle waits shortened

# The whole run, alone about 15 s; room for a loaded 2-core box.
DEADLINE_S = 150.0
# One condition (a checkpoint, a member in its inner loop, the end): the run's own deadlines are a
# few seconds (start timeout 15 s, attestation 20 s).
STEP_S = 60.0
OUTER_STEPS, CHECKPOINT, INNER = 20, 4, 20

TASK = """\
name = "digits-local-sgd"
seed = 0
[model]
name = "mlp"
kwargs = {{ in_features = 64, hidden = [32], out_features = 10 }}
[dataset]
manifest = "{manifest}"
[optimizer]
name = "adam"
lr = 0.005
[training]
batch_size = 16
mode = "local_sgd"
inner_steps = {inner}
total_steps = {steps}
checkpoint_interval = {checkpoint}
[outer]
optimizer = "average"  # with sparse values the error feedback is the momentum (SparseLoCo)
[compression]
density = 0.1
values = "2bit"
[peers]
min = 3
max = 8
"""


async def _publish(peers: LocalPeers) -> str:
    from p2ptrain.data import build_dataset, load_source
    from p2ptrain.task import load_task, task_bytes

    store = peers[0].content.store

    def build() -> str:
        name, features, labels = load_source("sklearn:digits")
        manifest, _ = build_dataset(store, name, (features / 16.0).astype(np.float32), labels, 4, test_fraction=0.2)
        text = TASK.format(manifest=manifest, inner=INNER, steps=OUTER_STEPS, checkpoint=CHECKPOINT)
        cid = store.add_bytes(task_bytes(load_task(text)))
        store.pin_add(cid)
        return cid

    return await trio.to_thread.run_sync(build)


def _chain(peer: Any, task_cid: str) -> Chain:
    data = (peer.node.home / "tasks" / task_cid / "chain.jsonl").read_bytes()
    return read_chain(task_cid, data)


def _trainer(peers: LocalPeers, index: int, task_cid: str) -> LocalSGDTrainer | None:
    run = peers[index].tasks.runs.get(task_cid)
    trainer = run.shared.trainer if run is not None else None
    assert trainer is None or isinstance(trainer, LocalSGDTrainer)
    return trainer


async def test_a_local_sgd_run_survives_a_member_stopped_mid_inner_loop_takes_a_late_joiner_and_learns(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with local_peers(4, tmp_path) as peers:
            task_cid = await _publish(peers)
            late = await peers.add_peer()  # started now, joins the task after its first checkpoint
            async with trio.open_nursery() as nursery:
                for peer in list(peers)[:4]:
                    nursery.start_soon(peer.tasks.join, task_cid)

            def statuses(indexes: list[int]) -> list[dict[str, Any]]:
                out = [peers.status(i, task_cid) for i in indexes]
                for s in out:
                    assert s.get("state") != "failed", s.get("error")
                return out

            await peers.wait_until(lambda: all(s.get("version", 0) >= 1 for s in statuses([0, 1, 2, 3])), STEP_S,
                                   what="every member at model v1")
            first = _chain(peers[0], task_cid).records[0].record
            assert first.step == CHECKPOINT and len(first.members) == 4  # a span counts outer steps
            assert {_chain(peers[i], task_cid).records[0].record.model_cid for i in range(4)} == {first.model_cid}

            # Stop a member that is not the coordinator while it is in its inner loop.
            leader = statuses([0])[0]["coordinator"]
            victim = next(i for i in range(4) if peers[i].node.peer_id.to_base58() != leader)
            gone = peers[victim].node.peer_id.to_base58()

            def mid_inner_loop() -> dict[str, Any] | None:
                s = peers.status(victim, task_cid)  # what `task status --json` says
                return s if (s.get("inner_step") or 0) >= 2 else None  # 1-based: one inner step done

            seen = await peers.wait_until(mid_inner_loop, STEP_S, what="the victim inside its inner loop")
            assert seen["inner_steps"] == INNER and seen["inner_step"] <= INNER
            assert f"; inner step {seen['inner_step']}/{INNER}" in render_status(TaskStatus.from_json(seen))
            await peers.stop_peer(victim)
            await late.tasks.join(task_cid)
            rest = [i for i in range(4) if i != victim]

            def finished() -> list[dict[str, Any]] | None:
                out = statuses(rest)
                return out if all(s.get("state") == "done" for s in out) else None

            final = await peers.wait_until(finished, STEP_S, what="the run done on every member left")
            assert len({(s["latest_model_cid"], s["step"]) for s in final}) == 1, final
            chain = _chain(peers[rest[0]], task_cid)
            last = chain.records[-1].record
            assert last.step == OUTER_STEPS and gone not in last.members
            assert last.metrics["accuracy"] >= 0.90, last.metrics
            # The late joiner loaded a confirmed checkpoint by CID (weights and outer state), and
            # trained on from it when a plan admitted it before the end: it holds a confirmed state.
            def joined() -> LocalSGDTrainer | None:
                trainer = _trainer(peers, 4, task_cid)
                synced = trainer is not None and peers.status(4, task_cid).get("synced")
                return trainer if synced and trainer.step >= CHECKPOINT else None

            joiner = await peers.wait_until(joined, STEP_S, what="the late joiner synced")
            record = next(r.record for r in chain.records if r.record.step == joiner.step)
            ours = peers[4].content.store
            assert ours.add_bytes(joiner.model_bytes(), only_hash=True) == record.model_cid
            assert ours.add_bytes(joiner.optimizer_bytes(), only_hash=True) == record.optimizer_cid


# -- a slower member: the outer round waits for it up to outer.wait_s, then goes on without it ---------


async def test_the_outer_round_waits_for_a_slower_member_up_to_outer_wait_s_then_names_it() -> None:
    """The slow-peer rule is a deadline: members that finished their inner loops wait for the others
    up to ``outer.wait_s`` (a member that is merely slower is waited for); past it the round fails
    naming the late member, not as gone, and the coordinator's retry leaves it out."""
    from p2ptrain.collective import Collective, PeerFailed
    from p2ptrain.run._spans import START_TIMEOUT_S, round_start_timeout
    from p2ptrain.testing import connected_hosts
    from p2ptrain.training import PlanAverager
    from p2ptrain.task import load_task
    from p2ptrain.wire import RoundPlan

    text = TASK.format(manifest="bafkreigh2akiscaildcqabsyg3dfr6chu3fgpregiymsck7e7aqa4s52zy", inner=5, steps=4,
                       checkpoint=2).replace('[outer]\n', '[outer]\nwait_s = 1.5\n')
    task = load_task(text)
    assert round_start_timeout(task) == 1.5
    assert round_start_timeout(load_task(text.replace('mode = "local_sgd"\ninner_steps = 5\n', "")
                                         .replace('[outer]\nwait_s = 1.5\noptimizer = "average"', ""))) == START_TIMEOUT_S
    with trio.fail_after(DEADLINE_S):
        async with connected_hosts(3) as hosts:
            members = tuple(h.id.to_base58() for h in hosts)
            plan = RoundPlan(task_cid=task.dataset.manifest, term=1, round=0, attempt=0, step=0, rounds=1,
                             members=members, base_cid=task.dataset.manifest, version=0)
            averages = [PlanAverager(task, Collective(h.host), start_timeout=round_start_timeout(task)).for_plan(plan)
                        for h in hosts]
            results: list[Any] = [None] * 3
            late = trio.Event()

            async def member(i: int, round_id: int, delay: trio.Event | None = None) -> None:
                if delay is not None:
                    await delay.wait()
                try:
                    results[i] = await averages[i](torch.full((1000,), float(i)), round_id)
                except PeerFailed as exc:
                    results[i] = exc

            # Slower, within the deadline: the third member joins once the other two are waiting.
            async with trio.open_nursery() as nursery:
                nursery.start_soon(member, 0, 1)
                nursery.start_soon(member, 1, 1)
                nursery.start_soon(member, 2, 1, late)
                await trio.sleep(0.5)  # the third member's inner loop takes 0.5 s longer
                late.set()
            assert all(isinstance(r, torch.Tensor) for r in results), results
            # Later than the deadline (here: never): the round fails for the others, naming it.
            async with trio.open_nursery() as nursery:
                nursery.start_soon(member, 0, 2)
                nursery.start_soon(member, 1, 2)
            for r in results[:2]:
                assert isinstance(r, PeerFailed) and r.peer_id == hosts[2].id and not r.gone, r
