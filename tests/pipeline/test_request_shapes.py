"""A replica takes only requests of the task's shapes (pipeline/_request_shapes.py): a hostile
driver's FORWARD of more samples than the task's microbatch is refused and counted before the stage
computes it, where it was computed whatever its size within the frame limits (4 Mi values) and
loaded the replica until the other drivers judged it a straggler (docs/security.md). Honest
requests pass, an EVAL of the task's larger eval batch too."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import trio

from p2ptrain.models import meta_model
from p2ptrain.net import ChannelClosed, open_channel
from p2ptrain.pipeline import PROTOCOL, request_shapes, RequestShapes, StageReplica
from p2ptrain.testing import connected_hosts
from p2ptrain.wire.activations import decode_frame, encode_frame, Frame, Kind, Limits

from p2ptrain.run._stage_trainer import StagedTrainer

from .test_hostile_stages import LM, lm_loss, stages, TRAINER_TASK

MICRO, EVAL = 2, 8
C, W, V = LM["context"], LM["width"], LM["vocab_size"]


def shapes(count: int) -> list[RequestShapes]:
    return request_shapes(meta_model("transformer_lm", LM), count, torch.empty(C, dtype=torch.int64), (C,),
                          microbatch=MICRO, evaluation=EVAL)


def test_each_stage_s_requests_are_traced_from_the_task_on_the_meta_device():
    first, middle, last = shapes(3)  # embed | a block | a block and the head
    assert first == RequestShapes(MICRO, EVAL, (C,), (C, W), (C,), float_inputs=False)  # token ids
    assert middle == RequestShapes(MICRO, EVAL, (C, W), (C, W), (C,))
    assert last == RequestShapes(MICRO, EVAL, (C, W), None, (C,))  # its output's gradient is no request's
    # The frame limits are the largest request's: an eval batch of activations here; never over the default.
    assert last.limits() == middle.limits() == Limits(max_rank=3, max_elements=EVAL * C * W)
    assert first.limits() == Limits(max_rank=3, max_elements=EVAL * C * W)  # the gradient of its output
    huge = RequestShapes(MICRO, 256, (1024, 768), (1024, 768), (1024,))  # a GPT-2's eval batch: 201M values
    assert huge.limits().max_elements == Limits().max_elements


@pytest.mark.parametrize(("kind", "tensors", "refused"), [
    (Kind.FORWARD, ((MICRO, C, W),), None),
    (Kind.FORWARD, ((1, C, W),), None),  # an epoch's short last batch
    (Kind.FORWARD, ((MICRO + 1, C, W),), "3 samples"),
    (Kind.FORWARD, ((MICRO, C + 1, W),), "input"),
    (Kind.BACKWARD, ((MICRO, C, W), (MICRO, C, W)), None),
    (Kind.BACKWARD, ((MICRO, C, W), (MICRO + 1, C, W)), "second tensor"),
    (Kind.EVAL, ((EVAL, C, W),), None),
    (Kind.EVAL, ((EVAL + 1, C, W),), "9 samples"),
    (Kind.HOLDINGS, (), None),
])
def test_a_request_of_other_shapes_is_named(kind: Kind, tensors: tuple, refused: str | None):
    request = Frame(kind, 0, 1, 1, tensors=tuple(torch.zeros(s) for s in tensors))
    problem = shapes(3)[1].problem(request)
    assert problem is None if refused is None else refused in problem, problem


async def test_an_oversized_forward_is_refused_and_counted_before_it_is_computed():
    stage = stages(3)[1]  # a middle block: it keeps a FORWARD's graph for its BACKWARD
    computed: list[int] = []
    stage.register_forward_hook(lambda _module, inputs, _out: computed.append(inputs[0].shape[0]))
    async with connected_hosts(2) as hosts:
        # hosts[0]: a driver that is the plan's coordinator too (it evaluates the checkpoints).
        replica = StageReplica(hosts[1].host, stage, lm_loss, senders=[hosts[0].id], evaluators=[hosts[0].id],
                               shapes=shapes(3)[1])
        replica.serve()

        async def ask(kind: Kind, samples: int) -> Frame:
            request = Frame(kind, 0, samples, 1, tensors=(torch.randn(samples, C, W),))
            async with await open_channel(hosts[0].host, hosts[1].id, PROTOCOL) as channel:
                await channel.send(encode_frame(request))
                return decode_frame(await channel.recv(replica.limits.max_frame_bytes()), replica.limits)

        with trio.fail_after(30):
            assert (await ask(Kind.FORWARD, MICRO)).kind == Kind.OUTPUT
            with pytest.raises(ChannelClosed):
                await ask(Kind.FORWARD, MICRO + 1)
            assert (await ask(Kind.EVAL, EVAL)).kind == Kind.OUTPUT  # the coordinator's evaluation batch
    assert replica.refused == {"shape": 1}
    assert computed == [MICRO, EVAL]  # the oversized FORWARD never reached the stage
    assert replica.limits.max_elements < Limits().max_elements


async def test_a_driver_s_eval_is_refused_before_it_is_computed():
    """The red team's EVAL-for-FORWARD: a driver that is not the plan's coordinator sent EVALs, which a
    replica answered from any sender, of up to the task's eval batch (32x its microbatch in a task of
    the defaults): the request shapes' bound on a FORWARD, and the EVAL admission, were both
    side-stepped. Now a replica answers an EVAL from its evaluators only; on main this driver's EVAL
    of EVAL samples was computed."""
    stage = stages(3)[1]
    computed: list[int] = []
    stage.register_forward_hook(lambda _module, inputs, _out: computed.append(inputs[0].shape[0]))
    async with connected_hosts(3) as hosts:
        driver, coordinator = hosts[0], hosts[2]
        replica = StageReplica(hosts[1].host, stage, lm_loss, senders=[driver.id], evaluators=[coordinator.id],
                               shapes=shapes(3)[1])
        replica.serve()

        async def ask(sender, kind: Kind, samples: int) -> Frame:  # type: ignore[no-untyped-def]
            request = Frame(kind, 0, samples, 1, tensors=(torch.randn(samples, C, W),))
            async with await open_channel(sender.host, hosts[1].id, PROTOCOL) as channel:
                await channel.send(encode_frame(request))
                return decode_frame(await channel.recv(replica.limits.max_frame_bytes()), replica.limits)

        with trio.fail_after(30):
            for samples in (EVAL, MICRO):
                with pytest.raises(ChannelClosed):
                    await ask(driver, Kind.EVAL, samples)
            assert (await ask(driver, Kind.FORWARD, MICRO)).kind == Kind.OUTPUT  # its own requests still answered
            assert (await ask(coordinator, Kind.EVAL, EVAL)).kind == Kind.OUTPUT
            with pytest.raises(ChannelClosed):
                await ask(coordinator, Kind.FORWARD, MICRO)  # and an evaluator's EVALs only, as before
    # The driver's EVAL of the eval batch is longer than any request of a driver's: refused from its
    # announced length, unread (test_sender_budget.py); the others as not theirs to send.
    assert replica.refused == {"oversized": 1, "outsider": 2}
    assert computed == [MICRO, EVAL] and replica.evaluations == 1


def test_a_run_s_shapes_come_from_its_data_set_and_a_model_the_meta_device_cannot_trace_keeps_the_default(
        caplog: pytest.LogCaptureFixture):
    trainer = StagedTrainer(TRAINER_TASK, total_steps=1)  # transformer_lm in 2 stages, microbatch = batch = 8
    context = TRAINER_TASK.model.arguments["context"]
    text = SimpleNamespace(features=SimpleNamespace(shape=(context,)), labels=SimpleNamespace(shape=(context,)),
                           tokens=SimpleNamespace(vocab_size=61))
    first, second = trainer.request_shapes(text)  # type: ignore[arg-type]
    assert first.inputs == (context,) and (second.microbatch, second.evaluation, second.inputs) == (8, 256, (context, 16))
    # Samples the model refuses on the meta device (longer than its context): no shapes, the replicas
    # keep the default limits, and the run is not stopped by the check.
    longer = SimpleNamespace(**{**vars(text), "features": SimpleNamespace(shape=(2 * context,))})
    assert trainer.request_shapes(longer) == []  # type: ignore[arg-type]
    assert "cannot be traced" in caplog.text
