"""4 stages x 2 replicas on 8 real libp2p hosts (127.0.0.1): a transformer_lm trains as it would in
one process, and a replica killed mid-step loses nothing."""

from __future__ import annotations

import collections
import random
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F
import trio

from p2ptrain.collective import Collective
from p2ptrain.models._registry import build_model
from p2ptrain.net import Channel, ChannelClosed, open_channel, serve_channels
from p2ptrain.pipeline import (
    Driver, partition, PipelineError, PROTOCOL, Stage, StageReplica, StageUnavailable, sum_stage_gradients, Wiring,
)
from p2ptrain.testing import connected_hosts, LocalHost
from p2ptrain.wire.activations import decode_frame, encode_frame, Frame, Kind

LM = {"vocab_size": 50, "context": 8, "width": 16, "depth": 6, "heads": 2}
STAGES, REPLICAS, SEED = 4, 2, 11
DEADLINE_S = 120


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Eight members share this process's (two) cores: one thread each keeps the test quick."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@dataclass
class Member:
    local: LocalHost
    stage: Stage
    collective: Collective
    optimizer: torch.optim.Optimizer
    server: StageReplica | None = None
    driver: Driver | None = None


async def answer_wrong_shapes(channel: Channel) -> None:
    """A dishonest replica: every answer well-formed, of the right kind, and of a useless shape."""
    request = decode_frame(await channel.recv(1 << 20))
    kind = {Kind.FORWARD: Kind.OUTPUT, Kind.HOLDINGS: Kind.HELD}.get(request.kind, Kind.GRAD)
    tensors = () if kind == Kind.HELD else (torch.zeros(1),)
    await channel.send(encode_frame(Frame(kind, request.step, request.microbatch, request.stage, tensors=tensors)))


class AlteringReplica(StageReplica):
    """A dishonest replica whose outputs are slightly off, well-formed and plausible."""

    def _compute(self, request, sender):
        answer, grads = super()._compute(request, sender)
        if answer.kind == Kind.OUTPUT:
            answer = replace(answer, tensors=(answer.tensors[0] + 1e-3,))
        return answer, grads


@asynccontextmanager
async def pipeline_run(encoding: str = "fp32", liar: int | None = None, altering: int | None = None, **driving):
    """Hosts 2s and 2s+1 serve stage s; the two of stage 0 drive. Every member builds the model from
    the same seed and keeps its stage (as a member loads its stage by CID). Host ``liar`` answers
    wrong shapes instead, host ``altering`` alters its outputs; ``driving``: the drivers' options."""
    async with connected_hosts(STAGES * REPLICAS) as hosts:
        replicas = {s: [hosts[REPLICAS * s + r].id for r in range(REPLICAS)] for s in range(1, STAGES)}
        drivers = [hosts[r].id for r in range(REPLICAS)]
        members = []
        for i, local in enumerate(hosts):
            cut = partition(build_model("transformer_lm", LM, seed=SEED), STAGES)
            stage = cut[i // REPLICAS]
            member = Member(local, stage, Collective(local.host), torch.optim.SGD(stage.parameters(), lr=0.5))
            if stage.index == 0:
                member.driver = Driver(local.host, stage, lm_loss, Wiring(replicas, random.Random(i)), cut=cut,
                                       encoding=encoding, **driving)
            elif i == liar:
                serve_channels(local.host, PROTOCOL, answer_wrong_shapes)
            else:
                kind = AlteringReplica if i == altering else StageReplica
                member.server = kind(local.host, stage, lm_loss, senders=drivers, encoding=encoding)
                member.server.serve()
            members.append(member)
        yield members


def batch(step: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, LM["vocab_size"], (size, LM["context"] + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


async def pipeline_step(
    members: list[Member], step: int, x, y, micro: int, during=None, first_leaves_out=(),
) -> tuple[float, dict]:
    """One step: microbatches of ``micro`` sequences dealt to the drivers in turn, all in flight at
    once; then every driver's finish (the first driver's first with ``first_leaves_out``, as if it
    could not reach them). Returns the step's loss and each stage's ring."""
    drivers = [m.driver for m in members if m.driver]
    for m in members:
        if m.driver or m.server:
            (m.driver or m.server).new_step(step)
    losses: list[float] = []
    weight = micro / x.shape[0]

    async def one(driver: Driver, i: int) -> None:
        s = slice(i * micro, (i + 1) * micro)
        losses.append(weight * await driver.microbatch((step << 20) | i, x[s], y[s], weight))

    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            for i in range(x.shape[0] // micro):
                nursery.start_soon(one, drivers[i % len(drivers)], i)
            if during is not None:
                nursery.start_soon(during)
        if first_leaves_out:
            await drivers[0].finish(first_leaves_out)
        rings = await agreed_rings(drivers)
    return sum(losses), rings


async def agreed_rings(drivers: list[Driver]) -> dict:
    """What the runtime's exchange between the drivers will do: finish again with every replica
    any driver left out, until all drivers name the same rings."""
    left_out: set = set()
    while True:
        rings = [await d.finish(left_out) for d in drivers]
        if all(r == rings[0] for r in rings):
            return rings[0]
        for r in rings:
            for stage, ring in r.items():
                left_out |= set(drivers[0].wiring.replicas(stage)) - set(ring)


async def apply_step(members: list[Member], step: int, rings: dict) -> None:
    """Each stage's live replicas sum their gradients over the ring and step their optimizers."""
    rings = {0: [m.local.id for m in members if m.driver], **rings}
    live = [m for m in members if m.local.id in rings[m.stage.index]]
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            for m in live:
                ring = rings[m.stage.index]
                nursery.start_soon(sum_stage_gradients, m.collective, m.stage, ring, step * STAGES + m.stage.index)
    for m in live:
        m.optimizer.step()


def reference_step(model, optimizer, x, y) -> tuple[float, dict[str, torch.Tensor]]:
    optimizer.zero_grad()
    loss = lm_loss(model(x), y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    optimizer.step()
    return float(loss.detach()), grads


def stage_grads(members: list[Member], ring: list, stage: int) -> dict[str, torch.Tensor]:
    """The sum over ``ring``'s replicas of ``stage`` of their gradients (before averaging)."""
    total: dict[str, torch.Tensor] = {}
    for m in members:
        if m.stage.index == stage and m.local.id in ring:
            for name, p in m.stage.model_parameters():
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                total[name] = total[name] + g if name in total else g.clone()
    return total


def assert_grads_match(members, rings, expected) -> None:
    rings = {0: [m.local.id for m in members if m.driver], **rings}
    seen = set()
    for stage in range(STAGES):
        for name, g in stage_grads(members, rings[stage], stage).items():
            torch.testing.assert_close(g, expected[name], rtol=1e-4, atol=1e-6, msg=f"stage {stage}: {name}")
            seen.add(name)
    assert seen == set(expected)


async def test_four_stages_of_two_replicas_train_as_one_process():
    reference = build_model("transformer_lm", LM, seed=SEED)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    async with pipeline_run() as members:
        for step in range(1, 4):
            x, y = batch(step)
            loss, rings = await pipeline_step(members, step, x, y, micro=2)
            ref_loss, ref_grads = reference_step(reference, ref_opt, x, y)
            assert loss == pytest.approx(ref_loss, rel=1e-5), step
            assert rings == {s: [members[REPLICAS * s + r].local.id for r in range(REPLICAS)] for s in range(1, STAGES)}
            assert_grads_match(members, rings, ref_grads)
            await apply_step(members, step, rings)
            # The replicas of each stage hold the same bits, and the weights are the single process's.
            for s in range(STAGES):
                a, b = members[REPLICAS * s].stage, members[REPLICAS * s + 1].stage
                for (name, p), (_, q) in zip(a.model_parameters(), b.model_parameters(), strict=True):
                    assert torch.equal(p, q), (step, name)
                    torch.testing.assert_close(p, dict(reference.named_parameters())[name], rtol=1e-4, atol=1e-6)
        # Every stage's two replicas both served: the wiring spreads the hops.
        assert all(m.server.requests > 0 for m in members if m.server)
        assert sum(m.driver.reroutes for m in members if m.driver) == 0


async def test_a_replica_killed_mid_step_loses_no_microbatch():
    reference = build_model("transformer_lm", LM, seed=SEED)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    async with pipeline_run() as members:
        victim = members[REPLICAS * 2]  # stage 2, replica 0

        async def kill_once_it_holds_a_microbatch() -> None:
            await victim.server.held_at_least(1)
            victim.local.kill()

        x, y = batch(1, size=12)
        loss, rings = await pipeline_step(members, 1, x, y, micro=1, during=kill_once_it_holds_a_microbatch)
        ref_loss, ref_grads = reference_step(reference, ref_opt, x, y)
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert rings[2] == [members[REPLICAS * 2 + 1].local.id]
        # What the victim held died with it and was computed again on the survivor: every
        # microbatch is in each stage's gradient exactly once.
        assert sum(m.driver.redone for m in members if m.driver) >= 1
        assert_grads_match(members, rings, ref_grads)
        await apply_step(members, 1, rings)
        # The next step runs on the survivor.
        x, y = batch(2)
        loss, rings = await pipeline_step(members, 2, x, y, micro=2)
        ref_loss, ref_grads = reference_step(reference, ref_opt, x, y)
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert_grads_match(members, rings, ref_grads)


async def test_drivers_agree_to_leave_out_a_replica_only_one_of_them_could_reach():
    reference = build_model("transformer_lm", LM, seed=SEED)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    async with pipeline_run() as members:
        unreachable, other = members[REPLICAS * 2].local.id, members[REPLICAS * 2 + 1].local.id
        x, y = batch(1, size=12)
        loss, rings = await pipeline_step(members, 1, x, y, micro=1, first_leaves_out={unreachable})
        ref_loss, ref_grads = reference_step(reference, ref_opt, x, y)
        assert rings[2] == [other]
        # Each driver redid its own microbatches that only the unreachable replica held.
        assert sum(m.driver.redone for m in members if m.driver) >= 1
        assert_grads_match(members, rings, ref_grads)


async def test_a_replica_answering_wrong_shapes_is_routed_around():
    reference = build_model("transformer_lm", LM, seed=SEED)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    async with pipeline_run(liar=REPLICAS * 2) as members:
        x, y = batch(1)
        loss, rings = await pipeline_step(members, 1, x, y, micro=2)
        ref_loss, ref_grads = reference_step(reference, ref_opt, x, y)
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert_grads_match(members, rings, ref_grads)
        # The liar's answers were refused (hops sent to it before its first answer came back each
        # failed too), and it is out of the step for every driver that tried it.
        drivers = [m.driver for m in members if m.driver]
        assert sum(d.reroutes for d in drivers) >= 1
        liar = members[REPLICAS * 2].local.id
        assert all(liar not in d.wiring.usable(2) for d in drivers if d.reroutes)


async def test_a_replica_refuses_and_counts_requests_it_cannot_take():
    async with pipeline_run() as members:
        driver, replica = members[0], members[REPLICAS * 1]
        replica.server.new_step(1)

        async def refused(data: bytes) -> None:
            with trio.fail_after(DEADLINE_S):
                async with await open_channel(driver.local.host, replica.local.id, PROTOCOL) as channel:
                    await channel.send(data)
                    with pytest.raises(ChannelClosed):
                        await channel.recv(1 << 20)

        good = torch.zeros(2, LM["context"], LM["width"])
        await refused(b"PP garbage")
        await refused(encode_frame(Frame(Kind.FORWARD, 1, 1, stage=2, tensors=(good,))))  # another stage
        await refused(encode_frame(Frame(Kind.FORWARD, 7, 1, stage=1, tensors=(good,))))  # another step
        await refused(encode_frame(Frame(Kind.LOSS, 1, 1, stage=1, value=0.5, tensors=(good, good))))  # not last
        await refused(encode_frame(Frame(Kind.CHECK_LOSS, 1, 1, stage=1, value=0.5, tensors=(good, good))))  # not last
        await refused(encode_frame(Frame(Kind.CHECK_BACKWARD, 1, 1, stage=1, tensors=(good,))))  # one tensor
        assert replica.server.refused == {"malformed": 6}
        await refused(encode_frame(Frame(Kind.FORWARD, 1, 1, stage=1, tensors=(torch.zeros(2, 8, 5),))))  # width 5
        assert replica.server.refused == {"malformed": 6, "failed": 1}
        assert replica.server.held() == set()


async def test_a_replica_altering_its_outputs_is_caught_by_a_second_opinion():
    async with pipeline_run(altering=REPLICAS * 2, check_fraction=1.0) as members:
        x, y = batch(1)
        await pipeline_step(members, 1, x, y, micro=2)
        drivers = [m.driver for m in members if m.driver]
        # Every microbatch: a second FORWARD at every middle stage, and a second LOSS or BACKWARD at
        # every later stage (the last stage's is its LOSS: loss and input gradient, no FORWARD).
        assert sum(d.checked for d in drivers) == 4 * (STAGES - 2)
        assert sum(d.gradients_checked for d in drivers) == 4 * (STAGES - 1)
        found = collections.Counter()
        for d in drivers:
            found.update(d.disagreements)
        altering, honest = members[REPLICAS * 2].local.id, members[REPLICAS * 2 + 1].local.id
        # Only stage 2 disagrees, always its two replicas, once per microbatch; the honest pairs of
        # stages 1 and 3 agree bit for bit.
        assert set(found) <= {(2, altering, honest), (2, honest, altering)}
        assert sum(found.values()) == 4


@pytest.mark.parametrize(("encoding", "tolerance"), [("fp16", 2e-3), ("int8", 3e-2)])
async def test_compressed_activations_train_close_to_one_process(encoding, tolerance):
    reference = build_model("transformer_lm", LM, seed=SEED)
    async with pipeline_run(encoding) as members:
        x, y = batch(1)
        loss, _ = await pipeline_step(members, 1, x, y, micro=4)
    with torch.no_grad():
        expected = float(lm_loss(reference(x), y))
    assert loss == pytest.approx(expected, rel=tolerance)


async def test_a_stage_with_no_replica_left_fails_the_step_clearly():
    async with pipeline_run(hop_timeout=5.0) as members:
        for m in members[REPLICAS * 3:]:
            m.local.kill()
        driver = members[0].driver
        for m in members:
            if m.driver or m.server:
                (m.driver or m.server).new_step(1)
        x, y = batch(1, size=2)
        with trio.fail_after(DEADLINE_S), pytest.raises(StageUnavailable, match="no replica of stage 3"):
            await driver.microbatch(1 << 20, x, y, 1.0)
        assert driver.reroutes == REPLICAS
        # Half a microbatch cannot be summed: the step's end says so instead of summing it.
        with trio.fail_after(DEADLINE_S), pytest.raises(PipelineError, match="did not complete"):
            await driver.finish()


@pytest.mark.parametrize("encoding", ["int8", "fp16"])
async def test_honest_replicas_agree_bit_for_bit_on_compressed_answers_and_gradients(encoding):
    """Second opinions compare decoded int8/fp16 answers, gradients included (CHECK_LOSS,
    CHECK_BACKWARD): honest replicas must never disagree, or an honest one could be accused."""
    async with pipeline_run(encoding, check_fraction=1.0) as members:
        x, y = batch(1)
        await pipeline_step(members, 1, x, y, micro=2)
        drivers = [m.driver for m in members if m.driver]
        assert sum(d.gradients_checked for d in drivers) == 4 * (STAGES - 1)
        assert not any(d.disagreements for d in drivers), [d.disagreements for d in drivers]
