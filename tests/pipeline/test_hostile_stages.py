"""Hostile peers against the stage protocol, on real libp2p hosts (127.0.0.1), and stage files
crafted to pass a joiner's checks.

Each test plays one dishonest or careless peer against honest drivers and replicas; its docstring
says what the peer did before the fix. A weakness found and not fixed yet is reproduced here as
``xfail(strict=True)`` (the reason says what a fix must do; no ``raises=``: trio's test runner hands
an async test's error on inside an ExceptionGroup), which flips to a failure of the mark, and must
lose it, once the weakness is fixed.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
import trio

from p2ptrain.models._registry import build_model
from p2ptrain.net import ChannelClosed, open_channel
from p2ptrain.pipeline import Driver, partition, PROTOCOL, StageReplica, StageUnavailable, Wiring
from p2ptrain.protocol import read_tensors, RecordError, tensors_bytes
from p2ptrain.run._stage_trainer import StagedTrainer
from p2ptrain.task import load_task
from p2ptrain.testing import connected_hosts
from p2ptrain.wire.activations import decode_frame, encode_frame, Frame, Kind

from .conftest import LM_TASK

LM = {"vocab_size": 50, "context": 8, "width": 16, "depth": 2, "heads": 2}  # pieces: embed, 2 blocks, head
SEED = 5
DEADLINE_S = 60
TRAINER_TASK = load_task(LM_TASK.replace('name = "sgd"\nlr = 0.1', 'name = "adam"\nlr = 0.01') + "[pipeline]\nstages = 2\n")


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def stages(count: int):
    return partition(build_model("transformer_lm", LM, seed=SEED), count)


def tokens(size: int, length: int = LM["context"], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, LM["vocab_size"], (size, length + 1), generator=g)
    return t[:, :-1], t[:, 1:]


class MatrixHoldings(StageReplica):
    """Answers HOLDINGS with a rank-2 tensor of ids: well-formed bytes, the wrong shape."""

    def _compute(self, request, sender):
        if request.kind == Kind.HOLDINGS:
            return Frame(Kind.HELD, request.step, 0, request.stage, tensors=(torch.zeros((2, 2), dtype=torch.int64),)), None
        return super()._compute(request, sender)


class NoHoldings(StageReplica):
    """Answers every hop at once and never its holdings (the channel is reset)."""

    def _compute(self, request, sender):
        if request.kind == Kind.HOLDINGS:
            raise ValueError("holdings withheld")
        return super()._compute(request, sender)


class ClaimsEverything(StageReplica):
    """Refuses every hop, then claims to hold every microbatch id of the step (ids are predictable:
    the step's indices): so the honest replica served them all, and the claims are lies."""

    claimed: list[int] = []

    def _compute(self, request, sender):
        if request.kind == Kind.HOLDINGS:
            ids = torch.tensor(self.claimed, dtype=torch.int64)
            return Frame(Kind.HELD, request.step, 0, request.stage, tensors=(ids,)), None
        raise ValueError("refused")


class LongerOutputs(StageReplica):
    """Answers every FORWARD with one position more than it was sent: the batch size the driver
    checks is right, the stage after it cannot use the activation."""

    def _compute(self, request, sender):
        answer, grads = super()._compute(request, sender)
        if answer.kind == Kind.OUTPUT:
            out = answer.tensors[0]
            answer = Frame(answer.kind, answer.step, answer.microbatch, answer.stage,
                           tensors=(torch.cat([out, out[:, -1:]], dim=1),))
        return answer, grads


async def drive(driver: Driver, ids: list[int], micro: int = 2) -> None:
    x, y = tokens(micro * len(ids))
    weight = 1 / len(ids)
    async with trio.open_nursery() as nursery:
        for k, mb in enumerate(ids):
            nursery.start_soon(driver.microbatch, mb, x[k * micro : (k + 1) * micro], y[k * micro : (k + 1) * micro], weight)


async def test_holdings_of_the_wrong_rank_leave_the_replica_out_not_crash_the_driver():
    """A HELD of a rank-2 tensor made ``Driver.finish`` raise TypeError (a set of lists) out of its
    nursery: one replica's answer crashed the driver's step instead of being refused."""
    s0, s1 = stages(2)
    async with connected_hosts(3) as hosts:
        honest = StageReplica(hosts[1].host, s1, lm_loss, senders=[hosts[0].id])
        honest.serve()
        MatrixHoldings(hosts[2].host, stages(2)[1], lm_loss, senders=[hosts[0].id]).serve()
        driver = Driver(hosts[0].host, s0, lm_loss, Wiring({1: [hosts[1].id, hosts[2].id]}, random.Random(1)), cut=stages(2),
                        hop_timeout=10)
        ids = list(range(6))
        with trio.fail_after(DEADLINE_S):
            await drive(driver, ids)
            rings = await driver.finish()
        assert rings == {1: [hosts[1].id]}
        assert honest.held() == set(ids)  # what the liar held was redone on the honest replica


async def test_an_activation_longer_than_the_context_is_refused_before_it_is_computed():
    """A block stage rebuilt a t x t mask for whatever t a frame carried (up to the frame limits'
    4M values: t = 262144 at width 16, a 256 GiB mask): one FORWARD from any peer could take the
    replica's memory. A block now refuses an activation longer than the model's context."""
    stage = stages(2)[1]
    async with connected_hosts(2) as hosts:
        replica = StageReplica(hosts[1].host, stage, lm_loss, senders=[hosts[0].id])
        replica.serve()

        async def forward(length: int) -> Frame:
            request = Frame(Kind.FORWARD, 0, 1, 1, tensors=(torch.randn(1, length, LM["width"]),))
            async with await open_channel(hosts[0].host, hosts[1].id, PROTOCOL) as channel:
                await channel.send(encode_frame(request))
                return decode_frame(await channel.recv(1 << 24))

        with trio.fail_after(DEADLINE_S):
            assert (await forward(LM["context"])).kind == Kind.OUTPUT  # within the context: answered
            with pytest.raises(ChannelClosed):
                await forward(LM["context"] + 1)
        assert replica.refused["failed"] == 1


async def test_requests_the_stage_cannot_take_are_refused_and_counted():
    """Two requests escaped the replica's refusals as handler errors (logged with a traceback, not
    counted as refused): a rank-4 activation, on which torch's attention raises AssertionError, and
    targets that make the loss NaN, whose answer ``encode_frame`` refuses after the computation."""
    stage = stages(2)[1]  # the last block and the head
    async with connected_hosts(2) as hosts:
        replica = StageReplica(hosts[1].host, stage, lm_loss, senders=[hosts[0].id])
        guard = replica.serve()
        _, y = tokens(2)
        requests = [
            Frame(Kind.FORWARD, 0, 1, 1, tensors=(torch.randn(1, 2, 4, LM["width"]),)),
            Frame(Kind.LOSS, 0, 2, 1, 1.0, (torch.randn(2, LM["context"], LM["width"]), torch.full_like(y, -100))),
        ]
        with trio.fail_after(DEADLINE_S):
            for request in requests:
                async with await open_channel(hosts[0].host, hosts[1].id, PROTOCOL) as channel:
                    await channel.send(encode_frame(request))
                    with pytest.raises(ChannelClosed):
                        await channel.recv(1 << 24)
        assert replica.refused["failed"] == len(requests)
        assert guard.counters["handler_error"] == 0
        assert replica.held() == set()


async def test_a_replica_that_gives_no_holdings_gets_no_redo():
    """A replica that gave no HOLDINGS is out of the stage's ring, yet the redos of the microbatches
    it held were drawn among all usable replicas, by throughput: one that answers hops fast and
    never its holdings drew the redo, and the next round of ``finish``, and the next (the driver's
    finish has no deadline of its own). Now it is left out of the step when its holdings fail."""
    s0, s1 = stages(2)
    ids = list(range(4))
    async with connected_hosts(3) as hosts:
        honest = StageReplica(hosts[1].host, s1, lm_loss, senders=[hosts[0].id])
        honest.serve()
        liar = NoHoldings(hosts[2].host, stages(2)[1], lm_loss, senders=[hosts[0].id])
        liar.serve()
        driver = Driver(hosts[0].host, s0, lm_loss, Wiring({1: [hosts[1].id, hosts[2].id]}, random.Random(3)), cut=stages(2),
                        hop_timeout=10)
        with trio.fail_after(DEADLINE_S):
            await drive(driver, ids)
            served = liar.requests
            assert served > 0  # the fast liar took microbatches, which must be redone
            rings = await driver.finish()
        assert rings == {1: [hosts[1].id]}
        assert honest.held() == set(ids)
        # Its one HOLDINGS only: no redo went to it, and it was not asked again.
        assert liar.requests == served + 1


class HoldsNothing(StageReplica):
    """Answers every hop and says it holds nothing (it may have accumulated it or not)."""

    def _compute(self, request, sender):
        if request.kind == Kind.HOLDINGS:
            return Frame(Kind.HELD, request.step, 0, request.stage), None
        return super()._compute(request, sender)


async def test_a_replica_that_answers_a_redo_and_never_holds_it_does_not_hang_finish():
    """``finish`` redid a microbatch no replica held on a replica chosen by the wiring, and asked
    again, with no bound: a stage whose only replica answers every hop and lists nothing held kept
    the driver's finish going for ever (the other members' step summary gave up; this member hung).
    Now a replica that answered a redo and does not hold it is out of the step."""
    s0, s1 = stages(2)
    async with connected_hosts(2) as hosts:
        HoldsNothing(hosts[1].host, s1, lm_loss, senders=[hosts[0].id]).serve()
        driver = Driver(hosts[0].host, s0, lm_loss, Wiring({1: [hosts[1].id]}, random.Random(1)), cut=stages(2), hop_timeout=10)
        with trio.fail_after(20):
            await drive(driver, [0, 1])
            with pytest.raises(StageUnavailable):
                await driver.finish()


async def test_a_replica_claiming_microbatches_it_never_served_is_left_out():
    """One replica's HELD was believed as it was: claiming ids it was never sent made every step of
    its stage DoubleCounted (the run stalled; nobody blamed). The driver knows which replicas it sent
    each microbatch's hop to; one that claims any other is left out of the step."""
    s0, s1 = stages(2)
    ids = list(range(6))
    async with connected_hosts(3) as hosts:
        honest = StageReplica(hosts[1].host, s1, lm_loss, senders=[hosts[0].id])
        honest.serve()
        liar = ClaimsEverything(hosts[2].host, stages(2)[1], lm_loss, senders=[hosts[0].id])
        liar.claimed = ids
        liar.serve()
        driver = Driver(hosts[0].host, s0, lm_loss, Wiring({1: [hosts[1].id, hosts[2].id]}, random.Random(1)), cut=stages(2),
                        hop_timeout=10)
        with trio.fail_after(DEADLINE_S):
            await drive(driver, ids)
            rings = await driver.finish()
        assert rings == {1: [hosts[1].id]}
        assert honest.held() == set(ids)


def rogue_loss(mb: int, y: torch.Tensor) -> Frame:
    """A LOSS for ``mb`` with an activation and targets of the rogue's own."""
    a = torch.randn(2, LM["context"], LM["width"], generator=torch.Generator().manual_seed(9))
    return Frame(Kind.LOSS, 0, mb, 1, 1.0, (a, torch.zeros_like(y)))


def reference_grads(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    reference = build_model("transformer_lm", LM, seed=SEED)
    lm_loss(reference(x), y).backward()
    return {name: p.grad for name, p in reference.named_parameters()}


async def test_a_peer_outside_the_plan_is_refused_and_cannot_take_a_drivers_microbatch_id():
    """A replica took LOSS/BACKWARD from any peer and counted a microbatch id once, whoever sent it:
    a peer in no plan that sent an honest driver's (predictable) id first put its own gradient in
    the stage in place of the driver's, and the driver's finish saw the id held. A replica now
    answers only the senders its plan names (the drivers): the rogue is refused and counted."""
    s0, s1 = stages(2)
    x, y = tokens(2)
    mb = 7
    async with connected_hosts(3) as hosts:
        replica = StageReplica(hosts[1].host, s1, lm_loss, senders=[hosts[0].id])
        replica.serve()
        driver = Driver(hosts[0].host, s0, lm_loss, Wiring({1: [hosts[1].id]}, random.Random(1)), cut=stages(2),
                        hop_timeout=10)
        with trio.fail_after(DEADLINE_S):
            async with await open_channel(hosts[2].host, hosts[1].id, PROTOCOL) as channel:
                with pytest.raises(ChannelClosed):  # reset unread: the send may fail already
                    await channel.send(encode_frame(rogue_loss(mb, y)))
                    await channel.recv(1 << 24)
            await driver.microbatch(mb, x, y, 1.0)
            assert await driver.finish() == {1: [hosts[1].id]}
    assert replica.refused["outsider"] == 1
    expected = reference_grads(x, y)
    for name, p in s1.model_parameters():
        torch.testing.assert_close(p.grad, expected[name], msg=name)


async def test_a_driver_reusing_another_drivers_microbatch_id_adds_beside_it_not_in_its_place():
    """Another driver of the plan (a sender the replica answers) that uses an honest driver's id
    first: what a replica holds is keyed by (sender, id), so the rogue's gradient is added beside
    the honest driver's (its own share, whatever it is), never in its place, and each driver's
    HOLDINGS lists only its own ids."""
    s0, s1 = stages(2)
    x, y = tokens(2)
    mb = 7
    async with connected_hosts(3) as hosts:
        replica = StageReplica(hosts[1].host, s1, lm_loss, senders=[hosts[0].id, hosts[2].id])
        replica.serve()
        driver = Driver(hosts[0].host, s0, lm_loss, Wiring({1: [hosts[1].id]}, random.Random(1)), cut=stages(2),
                        hop_timeout=10)
        with trio.fail_after(DEADLINE_S):
            async with await open_channel(hosts[2].host, hosts[1].id, PROTOCOL) as channel:
                await channel.send(encode_frame(rogue_loss(mb, y)))
                assert decode_frame(await channel.recv(1 << 24)).kind == Kind.GRAD
            await driver.microbatch(mb, x, y, 1.0)
            assert await driver.finish() == {1: [hosts[1].id]}
    assert replica.held(hosts[0].id) == replica.held(hosts[2].id) == {mb}
    rogue = stages(2)[1]
    frame = rogue_loss(mb, y)
    lm_loss(rogue(frame.tensors[0]), frame.tensors[1]).backward()
    expected = reference_grads(x, y)
    for (name, p), (_, q) in zip(s1.model_parameters(), rogue.model_parameters(), strict=True):
        torch.testing.assert_close(p.grad, expected[name] + q.grad, msg=name)


async def test_a_replica_answering_an_unusable_activation_is_blamed_not_the_stage_after_it():
    """The driver checked only an OUTPUT's batch size: a stage-1 replica answering an activation of
    another length passed, the honest replicas of stage 2 failed on it and were the ones marked out,
    and the step failed as StageUnavailable(2) with the liar unnamed. The driver now checks each
    answer's shape against the stage's own (on the meta device) and blames the replica that answered."""
    s0, s1, s2 = stages(3)
    x, y = tokens(2, length=4)
    async with connected_hosts(4) as hosts:
        LongerOutputs(hosts[1].host, s1, lm_loss, senders=[hosts[0].id]).serve()
        for h in hosts[2:]:
            StageReplica(h.host, stages(3)[2], lm_loss, senders=[hosts[0].id]).serve()
        wiring = Wiring({1: [hosts[1].id], 2: [hosts[2].id, hosts[3].id]}, random.Random(1))
        driver = Driver(hosts[0].host, s0, lm_loss, wiring, cut=stages(3), hop_timeout=10)
        with trio.fail_after(DEADLINE_S), pytest.raises(StageUnavailable) as caught:
            await driver.microbatch(1, x, y, 1.0)
    assert caught.value.stage == 1
    assert wiring.usable(2) == [hosts[2].id, hosts[3].id]


async def test_a_replica_answering_an_unusable_activation_is_routed_around():
    """With an honest replica beside the liar, its microbatches are redone there and the step
    completes; the next stage's replicas stay usable and in its ring. (The liar stays in stage 1's
    ring: what it holds are the true gradients of the hops it answered before it was out.)"""
    s0, s1, s2 = stages(3)
    ids = list(range(6))
    async with connected_hosts(5) as hosts:
        liar = LongerOutputs(hosts[1].host, s1, lm_loss, senders=[hosts[0].id])
        liar.serve()
        StageReplica(hosts[2].host, stages(3)[1], lm_loss, senders=[hosts[0].id]).serve()
        for h in hosts[3:]:
            StageReplica(h.host, stages(3)[2], lm_loss, senders=[hosts[0].id]).serve()
        wiring = Wiring({1: [hosts[1].id, hosts[2].id], 2: [hosts[3].id, hosts[4].id]}, random.Random(1))
        driver = Driver(hosts[0].host, s0, lm_loss, wiring, cut=stages(3), hop_timeout=10)
        with trio.fail_after(DEADLINE_S):
            await drive(driver, ids)
            assert liar.requests > 0
            rings = await driver.finish()
        assert hosts[1].id not in wiring.usable(1)
        assert wiring.usable(2) == rings[2] == [hosts[3].id, hosts[4].id]
        assert hosts[2].id in rings[1]


def crafted_stage_files(edit) -> tuple[bytes, bytes]:
    """Stage 1's files after one Adam step, its optimizer file's tensors changed by ``edit``."""
    member = StagedTrainer(TRAINER_TASK, device="cpu")
    member.take_stage(1)
    for p in member.stages[1].parameters():
        p.grad = torch.ones_like(p)
    member.apply_stage(1, 0.0)
    model, optim = member.stage_files(1)
    tensors = read_tensors(optim)
    edit(tensors)
    return model, tensors_bytes(tensors)


def vector_step(tensors: dict) -> None:
    name = next(n for n in sorted(tensors) if n.endswith(".step"))
    tensors[name] = torch.zeros(3)


def no_second_moment(tensors: dict) -> None:
    del tensors[next(n for n in sorted(tensors) if n.endswith(".exp_avg_sq"))]


@pytest.mark.parametrize("edit", [vector_step, no_second_moment])
def test_a_stage_optimizer_file_the_optimizer_cannot_step_is_refused_at_load(edit):
    """A stage's optimizer CID is named by one member (the stage's first replica, or whoever sets
    that slot of the gather) and attested unchecked by every other stage: a file whose Adam state
    loads but cannot be stepped must be refused by load_stage, not crash the joiner's first step."""
    model, optim = crafted_stage_files(edit)
    joiner = StagedTrainer(TRAINER_TASK, device="cpu")
    with pytest.raises(RecordError):
        joiner.load_stage(1, model, optim, 1)
