"""Integrity of a pipelined step (docs/pipeline.md, "Integrity"): a replica sending altered activations
is outvoted by a third opinion, named (and only it), convicted by the drivers' summary, shown in
`task status` and left out of the next plan; with two replicas the disagreement stays the pair's and
nobody is left out. The checked microbatches are drawn from a key, not from the driver's generator.

Real libp2p hosts on 127.0.0.1 for the stage protocol and the step summary; the verdict's way into
the plans is the coordinator's pure book. Before this change a disagreement was only counted against
the pair (no third opinion, no verdict, nothing in the summary or the status), and the draw came
from a generator the driver seeded.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import trio

from p2ptrain.base import short_id
from p2ptrain.cli.task import render_status
from p2ptrain.collective import Collective, Misbehaved
from p2ptrain.control import TaskStatus
from p2ptrain.pipeline import Driver, is_checked, Outvoted, StageReplica, Wiring
from p2ptrain.protocol import check_key_message, convicted, Convictions, Hold
from p2ptrain.run._step_summary import convicted_failure
from p2ptrain.run._step_summary import gather_summary
from p2ptrain.task import load_task
from p2ptrain.testing import connected_hosts
from p2ptrain.wire import read_summary_entry, RoundPlan, summary_entry_bytes
from p2ptrain.wire.activations import Kind

from .conftest import CID, LM_TASK
from .test_hostile_stages import DEADLINE_S, drive, lm_loss, stages
from .test_plan_stages import _coordinator

PIPELINED = load_task(LM_TASK + "[pipeline]\nstages = 2\n")


class AlteringReplica(StageReplica):
    """A dishonest replica: what it answers (outputs, and the gradients of its input) is off by a
    small error, well-formed and plausible."""

    def _compute(self, request, sender):
        answer, grads = super()._compute(request, sender)
        if answer.kind in (Kind.OUTPUT, Kind.GRAD):
            answer = replace(answer, tensors=(answer.tensors[0] + 1e-3,))
        return answer, grads


class GradientAlteringReplica(StageReplica):
    """A subtler liar: honest outputs, but the gradient of its input (what every stage before it
    trains on) off by a small error. Before protocol 1.2.0 nothing compared it."""

    def _compute(self, request, sender):
        answer, grads = super()._compute(request, sender)
        if answer.kind == Kind.GRAD:
            answer = replace(answer, tensors=(answer.tensors[0] * 1.01,))
        return answer, grads


def plan_of(members: list[str], stages_of: tuple[int, ...]) -> RoundPlan:
    return RoundPlan(task_cid=CID, term=1, round=3, attempt=0, step=3, rounds=1, base_cid=CID, version=1,
                     members=tuple(members), stages=stages_of)


async def summaries(hosts, plan: RoundPlan, accused: dict[str, tuple[str, ...]]) -> list:
    """Every member's step summary (or its failure), each driver accusing what ``accused`` says."""
    cs = [Collective(h.host) for h in hosts]
    got: list = [None] * len(hosts)

    async def one(i: int) -> None:
        me = str(hosts[i].id)
        try:
            got[i] = await gather_summary(cs[i], plan, 0, me, 0.5 if plan.stages[i] == 0 else 0.0, False, timeout=10,
                                          start_timeout=20, accused=accused.get(me, ()))
        except Exception as error:  # each test asserts on what every member saw
            got[i] = error

    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            for i in range(len(hosts)):
                nursery.start_soon(one, i)
    return got


async def serve_stage_1(hosts, altering: int, liar: type[StageReplica] = AlteringReplica,
                        count: int = 2) -> list[StageReplica]:
    """Stage 1 of a model cut into ``count`` stages on every host but the first (the driver), host
    ``altering`` a ``liar``."""
    servers = []
    for i in range(1, len(hosts)):
        kind = liar if i == altering else StageReplica
        server = kind(hosts[i].host, stages(count)[1], lm_loss, senders=[hosts[0].id])
        server.serve()
        servers.append(server)
    return servers


async def test_a_replica_altering_its_outputs_is_outvoted_named_and_left_out_of_the_next_plan():
    """Three replicas of stage 1, one adding 1e-3 to its outputs: the third opinion names it and only
    it, and the step fails (the lie went into its gradients); the summary convicts it on every
    member; the status shows it; the next plan leaves it out."""
    async with connected_hosts(4) as hosts:
        await serve_stage_1(hosts, altering=2)
        liar = hosts[2].id
        driver = Driver(hosts[0].host, stages(2)[0], lm_loss, Wiring({1: [h.id for h in hosts[1:]]}, random.Random(3)),
                        cut=stages(2), check_fraction=1.0, check_key=b"k")
        with trio.fail_after(DEADLINE_S):
            await drive(driver, list(range(9)))
            with pytest.raises(Outvoted):
                await driver.finish()
        assert driver.gradients_checked == 9 and driver.checked == 0  # stage 1 is the last: its LOSS is checked
        assert driver.liars == {liar: 1}
        assert set(driver.outvoted) == {(1, liar)} and sum(driver.outvoted.values()) >= 1
        assert all(liar in pair[1:] for pair in driver.disagreements)  # every disagreement involved the liar

        # The driver's accusation goes into its entry of the step summary; every member convicts it.
        members = [str(h.id) for h in hosts]
        plan = plan_of(members, (0, 1, 1, 1))
        got = await summaries(hosts, plan, {members[0]: tuple(str(p) for p in driver.liars)})
        assert [s.convicted for s in got] == [(str(liar),)] * 4, got

    # The step fails naming it (the same path as a member a robust round proves wrong), task status names it.
    suspects: dict = {}
    convictions = Convictions()
    failure = convicted_failure(plan, 3, got[0].convicted, suspects, "test", convictions=convictions, now=1.0, me=members[0])
    assert convictions.out(1.0) == {str(liar): 11.0}  # the first time, the usual quarantine (protocol/_quarantine.py)
    assert isinstance(failure, Misbehaved) and failure.peer_id == liar and "stage 1" in failure.reason
    assert list(suspects) == [str(liar)] and suspects[str(liar)] == {"peer": str(liar), "stage": 1, "times": 1, "step": 3}
    status = TaskStatus(task_cid=CID, name="t", state="training", member=True, stage_suspects=tuple(suspects.values()))
    assert TaskStatus.from_json(status.to_json()).stage_suspects == status.stage_suspects
    text = render_status(status)
    assert (f"suspect    {short_id(str(liar))}, stage 1: sent altered activations or gradients (1 time, last at "
            "step 3)") in text, text
    out = TaskStatus(task_cid=CID, name="t", state="training", member=True,
                     stage_suspects=({**suspects[str(liar)], "out_s": 9.6},))  # still left out (run/_stage_status.py)
    assert "step 3); left out of plans for 10 s more" in render_status(TaskStatus.from_json(out.to_json()))

    # Every member's book takes the failure as run/_spans.py does: the coordinator's next plan leaves it out.
    election, book = _coordinator(PIPELINED)
    live = {election.me, *members[1:], str(hosts[0].id)}
    before = book.decide(0.0, election, 0, live, can_roll_back=False, span_running=False, rounds_running=False,
                         head_version=0)
    assert not isinstance(before, Hold) and str(liar) in before.members
    book = _coordinator(PIPELINED)[1]
    book.note_round_failed(1.0, failure.peer_id.to_base58(), failure.gone)
    after = book.decide(3.0, election, 0, live, can_roll_back=False, span_running=False, rounds_running=False,
                        head_version=0)
    assert not isinstance(after, Hold) and str(liar) not in after.members
    assert set(after.members) == live - {str(liar)}


async def test_with_two_replicas_the_pair_is_reported_and_nobody_is_left_out():
    async with connected_hosts(3) as hosts:
        await serve_stage_1(hosts, altering=2)
        driver = Driver(hosts[0].host, stages(2)[0], lm_loss, Wiring({1: [h.id for h in hosts[1:]]}, random.Random(3)),
                        cut=stages(2), check_fraction=1.0, check_key=b"k")
        with trio.fail_after(DEADLINE_S):
            await drive(driver, list(range(4)))
            await driver.finish()
        pair = {hosts[1].id, hosts[2].id}
        assert sum(driver.disagreements.values()) == 4
        assert all({a, b} == pair and stage == 1 for stage, a, b in driver.disagreements)
        assert driver.liars == {} and not driver.outvoted
        assert driver.undecided == driver.disagreements  # reported as the pair's
        (stage, a, b), times = next(iter(driver.undecided.items()))
        status = TaskStatus(task_cid=CID, name="t", state="training", member=True, stage_suspects=(),
                            stage_disagreements=({"stage": stage, "peers": [str(a), str(b)], "times": times},))
        text = render_status(TaskStatus.from_json(status.to_json()))
        plural = "" if times == 1 else "s"  # the pair's disagreements may be kept under both orders of the two
        assert f"disagree   stage 1: {short_id(str(a))} and {short_id(str(b))}, {times} time{plural}; no third replica" in text
        assert "suspect" not in text
        members = [str(h.id) for h in hosts]
        got = await summaries(hosts, plan_of(members, (0, 1, 1)), {members[0]: ()})
        assert [s.convicted for s in got] == [()] * 3, got


def test_a_replica_is_convicted_by_a_majority_of_the_drivers_only():
    drivers = ["d1", "d2", "d3"]
    assert convicted(drivers, {"d1": ["r1"]}) == ()  # one hostile driver of three evicts nobody
    assert convicted(drivers, {"d1": ["r1"], "d2": ["r1", "r2"]}) == ("r1",)
    assert convicted(drivers, {"d1": ["r1", "r1"], "x": ["r1"], "r2": ["r1"]}) == ()  # non-drivers do not vote
    assert convicted(drivers, {"d1": ["d2"], "d3": ["d2"]}) == ()  # a driver is nobody's to accuse
    assert convicted(["d1", "d2"], {"d1": ["r1"]}) == ()  # half is not more than half
    assert convicted(["d1"], {"d1": ["r2", "r1"]}) == ("r1", "r2")  # a lone driver is the run's trusted one


def test_an_entry_accusing_a_driver_or_twice_is_refused():
    plan = plan_of(["a", "b", "c", "d"], (0, 1, 0, 1))
    assert read_summary_entry(summary_entry_bytes(0.25, False, (1, 3)), plan) == (0.25, False, (1, 3), ())
    assert read_summary_entry(summary_entry_bytes(0.25, False), plan) == (0.25, False, (), ())
    for accused in [(2,), (1, 1), (4,)]:  # a driver, twice, not a member
        with pytest.raises(ValueError, match="not distinct replicas"):
            read_summary_entry(summary_entry_bytes(0.25, False, accused), plan)
    with pytest.raises(ValueError):
        read_summary_entry(summary_entry_bytes(0.25, False, (1,)) + b"\x00", plan)


def test_the_checked_microbatches_are_drawn_from_the_key_not_a_generator():
    draws = [is_checked(b"key", 7, mb, 0.1) for mb in range(20000)]
    assert 0.09 < sum(draws) / len(draws) < 0.11
    assert draws == [is_checked(b"key", 7, mb, 0.1) for mb in range(20000)]  # the same on every machine
    assert draws != [is_checked(b"other", 7, mb, 0.1) for mb in range(20000)]
    assert draws != [is_checked(b"key", 8, mb, 0.1) for mb in range(20000)]
    assert not any(is_checked(b"key", 7, mb, 0.0) for mb in range(1000))
    assert all(is_checked(b"key", 7, mb, 1.0) for mb in range(1000))
    # The key a runtime driver uses: its signature of the plan's base, which no replica can make.
    plan = plan_of(["a", "b"], (0, 1))
    assert check_key_message(plan) == check_key_message(replace(plan, term=9, attempt=2))  # no replanning redraws
    assert check_key_message(plan) != check_key_message(replace(plan, round=4))


async def test_a_driver_checks_exactly_the_drawn_microbatches_whatever_its_wiring_seed():
    ids = list(range(12))
    key = b"drawn"
    expected = sum(is_checked(key, 0, mb, 0.3) for mb in ids)
    assert 0 < expected < len(ids)
    async with connected_hosts(3) as hosts:
        servers = await serve_stage_1(hosts, altering=-1)
        for seed in (1, 2):
            for server in servers:
                server.new_step(0)  # the same step again: nothing held from the first driver's
            driver = Driver(hosts[0].host, stages(2)[0], lm_loss,
                            Wiring({1: [h.id for h in hosts[1:]]}, random.Random(seed)), cut=stages(2),
                            check_fraction=0.3, check_key=key)
            with trio.fail_after(DEADLINE_S):
                await drive(driver, ids)
                assert driver.gradients_checked == 0  # none during the step: every microbatch alike
                await driver.finish()
                await driver.aclose()  # its idle channels would count against the replicas' stream cap
            assert driver.gradients_checked == expected and not driver.disagreements


@pytest.mark.parametrize("count", [2, 3])
async def test_a_replica_altering_only_the_gradient_of_its_input_is_outvoted_and_named(count):
    """Honest outputs, altered input gradients: at the last stage (its LOSS, ``count`` = 2) and at a
    middle stage (its BACKWARD, ``count`` = 3, with one replica of the last stage, which nobody can
    check). The second opinion on the gradient disagrees, a third names the liar, and only it; the
    step fails."""
    async with connected_hosts(4 if count == 2 else 5) as hosts:
        await serve_stage_1(hosts[:4], altering=2, liar=GradientAlteringReplica, count=count)
        later = []
        if count == 3:  # one honest replica of the last stage
            last = StageReplica(hosts[4].host, stages(3)[2], lm_loss, senders=[hosts[0].id])
            last.serve()
            later = [hosts[4].id]
        wiring = {1: [h.id for h in hosts[1:4]], **({2: later} if later else {})}
        driver = Driver(hosts[0].host, stages(count)[0], lm_loss, Wiring(wiring, random.Random(5)),
                        cut=stages(count), check_fraction=1.0, check_key=b"k")
        with trio.fail_after(DEADLINE_S):
            await drive(driver, list(range(4)))
            with pytest.raises(Outvoted):
                await driver.finish()
        liar = hosts[2].id
        assert driver.liars == {liar: 1}
        assert set(driver.outvoted) == {(1, liar)}
        assert driver.gradients_checked == 4  # stage 1's; a lone replica has no second opinion
        assert all(liar in pair[1:] for pair in driver.disagreements)
