"""Trainers averaging through the real collective: libp2p hosts on 127.0.0.1, the sparse ring
all-reduce with error feedback, real digits shards. Members must end with identical bytes."""

import pytest
import torch
import trio

from p2ptrain.collective import Collective, CollectiveError, PeerFailed
from p2ptrain.data import IPFSDataset
from p2ptrain.testing import connected_hosts
from p2ptrain.training import PlanAverager, RoundTimings, Trainer, batched, batches_forever, run_round
from p2ptrain.protocol import round_id
from p2ptrain.task import TaskError
from p2ptrain.wire import RoundPlan

# Hosts start and stop inside this bound too: a stuck shutdown fails the test instead of hanging it.
WHOLE_TEST_S = 150
pytestmark = pytest.mark.timeout(WHOLE_TEST_S + 30)


def plan_for(task_cid, members, round_index, step, rounds, attempt=0):
    return RoundPlan(task_cid=task_cid, term=1, round=round_index, attempt=attempt, step=step, rounds=rounds,
                     members=tuple(sorted(members)), base_cid=task_cid, version=0)


@pytest.mark.parametrize(
    "error_feedback, steps, min_accuracy, robust",
    [("true", 120, 0.9, "none"), ("false", 30, 0.0, "none"), ("true", 120, 0.9, "clip"), ("false", 30, 0.0, "clip")],
)
async def test_members_stay_identical_over_the_sparse_ring(digits, digits_task, error_feedback, steps, min_accuracy, robust):
    store, cid = digits
    task = digits_task(cid, steps=steps, **{"compression.density": "0.1",
                                           "compression.error_feedback": error_feedback,
                                           "compression.robust": f'"{robust}"'})
    assert task.compression.robust == robust
    with trio.fail_after(WHOLE_TEST_S):
        async with connected_hosts(3) as peers:
            hosts = [p.host for p in peers]
            ids = [h.get_id().to_base58() for h in hosts]
            plan = plan_for(cid, ids, 0, 0, steps)
            members = []
            for host in hosts:
                me = host.get_id().to_base58()
                rank, world = plan.members.index(me), len(plan.members)
                shard = IPFSDataset(cid, "train", rank=rank, world_size=world, store=store, seed=rank)
                data = batches_forever(shard, 32)
                members.append((Trainer(task, device="cpu"), PlanAverager(task, Collective(host)).for_plan(plan), data))

            async def run(trainer, average, data):
                for i in range(plan.rounds):
                    await run_round(trainer, data, average, round_id(plan, i), RoundTimings())

            with trio.fail_after(120):
                async with trio.open_nursery() as runs:
                    for m in members:
                        runs.start_soon(run, *m)
    trainers = [m[0] for m in members]
    assert len({t.model_bytes() for t in trainers}) == 1
    assert len({t.optimizer_bytes() for t in trainers}) == 1
    test = IPFSDataset(cid, "test", store=store, shuffle=False)
    accuracy = trainers[0].evaluate(batched(test, 256)).accuracy
    assert accuracy >= min_accuracy, accuracy


async def test_dead_member_round_is_retried_without_it(digits, digits_task):
    store, cid = digits
    task = digits_task(cid, steps=20, **{"compression.density": "0.1"})
    with trio.fail_after(WHOLE_TEST_S):
        async with connected_hosts(3) as peers:
            hosts = [p.host for p in peers]
            ids = [h.get_id().to_base58() for h in hosts]
            trainers = [Trainer(task, device="cpu") for _ in hosts]
            averagers = [PlanAverager(task, Collective(h), timeout=2.0) for h in hosts]
            data = [batches_forever(IPFSDataset(cid, "train", store=store, seed=i), 32) for i in range(3)]

            async def span(plan, who, fail_at=None):
                """Each listed member runs the plan's rounds; returns {index: exception or None}."""
                outcome = {}

                async def run(i):
                    average = averagers[i].for_plan(plan)
                    try:
                        for r in range(plan.rounds):
                            if fail_at == (i, r):
                                peers[i].kill()  # the host dies: connections close like a killed process
                                return
                            await run_round(trainers[i], data[i], average, round_id(plan, r), RoundTimings())
                        outcome[i] = None
                    except PeerFailed as exc:
                        outcome[i] = exc

                with trio.fail_after(60):
                    async with trio.open_nursery() as runs:
                        for i in who:
                            runs.start_soon(run, i)
                return outcome

            first = plan_for(cid, ids, 0, 0, 6)
            outcome = await span(first, [0, 1, 2], fail_at=(2, 3))
            assert all(isinstance(outcome[i], PeerFailed) for i in (0, 1))
            assert {trainers[0].step, trainers[1].step} <= {3, 4}
            retry = plan_for(cid, ids[:2], 3, 3, 3, attempt=1)
            for t in trainers[:2]:
                t.align(3)
            outcome = await span(retry, [0, 1])
            assert outcome == {0: None, 1: None}
    assert trainers[0].step == trainers[1].step == 6
    assert trainers[0].model_bytes() == trainers[1].model_bytes()
    assert trainers[0].optimizer_bytes() == trainers[1].optimizer_bytes()


def test_the_robust_rule_is_one_of_the_known_ones(digits_task):
    with pytest.raises(TaskError, match="compression.robust: must be one of none, clip"):
        digits_task("bafkreigh2akiscaildcqabsyg3dfr6chu3fgpregiymsck7e7aqa4s52zy", **{"compression.robust": '"median"'})
    assert digits_task("bafkreigh2akiscaildcqabsyg3dfr6chu3fgpregiymsck7e7aqa4s52zy").compression.robust == "none"


@pytest.mark.parametrize("error_feedback", ["true", "false"])
async def test_the_robust_option_reaches_the_round(digits, digits_task, error_feedback):
    """A member whose task says clip and one whose task does not disagree on the round's digest:
    the option goes all the way to the wire, on both averaging paths."""
    store, cid = digits
    tasks = [digits_task(cid, steps=1, **{"compression.robust": f'"{rule}"', "compression.error_feedback": error_feedback})
             for rule in ("clip", "none")]
    failures = []
    with trio.fail_after(WHOLE_TEST_S):
        async with connected_hosts(2) as peers:
            hosts = [p.host for p in peers]
            plan = plan_for(cid, [h.get_id().to_base58() for h in hosts], 0, 0, 1)

            async def run(task, host):
                average = PlanAverager(task, Collective(host), timeout=10).for_plan(plan)
                try:
                    await average(torch.ones(100), round_id(plan, 0))
                except PeerFailed as failure:
                    failures.append(str(failure))

            async with trio.open_nursery() as runs:
                for task, host in zip(tasks, hosts):
                    runs.start_soon(run, task, host)
    assert len(failures) == 2 and all("disagrees" in f for f in failures), failures


async def test_a_failed_round_keeps_its_gradient_and_its_compute_time(digits, digits_task):
    """run_round computes only when no gradient is pending: the retry of a failed round averages the
    gradient the failed one computed (the data is not consumed twice), and the compute time of the
    failed round is counted, its sync time not."""
    store, cid = digits
    trainer = Trainer(digits_task(cid, steps=4), device="cpu")
    data = batches_forever(IPFSDataset(cid, "train", store=store, seed=0), 32)
    seen = []

    async def failing(flat, rid):
        seen.append(flat)
        raise CollectiveError("the ring broke")

    async def identity(flat, rid):
        seen.append(flat)
        return flat.clone()

    timings = RoundTimings()
    with trio.fail_after(WHOLE_TEST_S):
        with pytest.raises(CollectiveError):
            await run_round(trainer, data, failing, 1, timings)
        assert trainer.pending is not None and trainer.step == 0
        assert timings.compute_s > 0 and timings.sync_s == 0 and timings.apply_s == 0
        computed = timings.compute_s
        result = await run_round(trainer, data, identity, 1, timings)
    assert seen[0] is seen[1]  # the same gradient, not a new one
    assert timings.compute_s == computed and timings.last_compute_s == 0
    assert result.step == 0 and trainer.step == 1 and trainer.pending is None
    assert timings.sync_s > 0 and timings.apply_s > 0
