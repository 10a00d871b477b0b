"""What one peer may make a stage's replica buffer is bounded per peer (pipeline/_replica.py,
``StageReplica.reserve``), on real libp2p hosts.

Before: every peer's requests were read within the same frame limits, the task's largest request's
(an EVAL of the eval batch), and each of a sender's channels (8 at once) held a whole frame, read
and decoded, until the stage's lock came: a driver made a replica buffer 8 eval-batch frames, and
every other driver as many. Now a request is read only once its announced length fits the longest
frame its peer may send (a driver's at its microbatch, the coordinator's at the eval batch:
``RequestShapes.frame_bytes``), and while that peer's requests read and not yet answered stay within
``IN_FLIGHT_PER_PEER`` such frames (an honest driver's microbatches in flight); past either, it is
refused before its body is read, counted (``oversized``, ``over_budget``) and logged, and the other
drivers' requests, each within its own budget, are answered as before. Both tests fail on main."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import trio

from p2ptrain.net import Channel, ChannelClosed, open_channel
from p2ptrain.pipeline import MAX_STREAMS_PER_PEER, PROTOCOL, StageReplica
from p2ptrain.pipeline._replica import IN_FLIGHT_PER_PEER
from p2ptrain.testing import connected_hosts
from p2ptrain.wire.activations import decode_frame, encode_frame, Frame, Kind

from .test_hostile_stages import lm_loss, stages
from .test_request_shapes import C, EVAL, MICRO, shapes, W

DEADLINE_S = 30.0


def test_a_peer_s_frames_are_its_own_requests_longest():
    first, middle, last = shapes(3)
    backward = Frame(Kind.BACKWARD, 0, 1, 1, tensors=(torch.zeros(MICRO, C, W), torch.zeros(MICRO, C, W)))
    loss = Frame(Kind.LOSS, 0, 1, 2, 0.5, tensors=(torch.zeros(MICRO, C, W), torch.zeros(MICRO, C, dtype=torch.int64)))
    evaluation = Frame(Kind.EVAL, 0, 1, 2, tensors=(torch.zeros(EVAL, C, W), torch.zeros(EVAL, C, dtype=torch.int64)))
    # A driver's longest request, in fp32 (the widest float encoding), is exactly its bound.
    assert middle.frame_bytes(sender=True, evaluator=False) == len(encode_frame(backward, "fp32"))
    assert last.frame_bytes(sender=True, evaluator=False) == len(encode_frame(loss, "fp32"))
    assert last.frame_bytes(sender=False, evaluator=True) == len(encode_frame(evaluation, "fp32"))
    # The coordinator's EVAL batch (EVAL samples) is over twice a driver's longest request (two
    # tensors of MICRO samples); a peer of both roles may send either; stage 0 takes token ids (i64).
    assert middle.frame_bytes(sender=True, evaluator=True) == middle.frame_bytes(sender=False, evaluator=True) \
        > 2 * middle.frame_bytes(sender=True, evaluator=False)
    tokens = Frame(Kind.EVAL, 0, 1, 0, tensors=(torch.zeros(EVAL, C, dtype=torch.int64),))
    assert not first.float_inputs and len(encode_frame(tokens)) <= first.frame_bytes(sender=False, evaluator=True)
    # Every frame stays within the limits the replica decodes with.
    assert middle.frame_bytes(sender=True, evaluator=True) <= middle.limits().max_frame_bytes()


async def _ask(channel: Channel, request: Frame, replica: StageReplica) -> Frame:
    await channel.send(encode_frame(request))
    return decode_frame(await channel.recv(replica.limits.max_frame_bytes()), replica.limits)


async def test_one_driver_buffers_at_most_its_budget_while_another_is_answered():
    stage = stages(3)[1]  # a middle block
    async with connected_hosts(4) as hosts:
        hostile, honest, coordinator, host = hosts
        replica = StageReplica(host.host, stage, lm_loss, senders=[hostile.id, honest.id],
                               evaluators=[coordinator.id], shapes=shapes(3)[1])
        replica.serve()
        backward = Frame(Kind.BACKWARD, 0, 0, 1, tensors=(torch.randn(MICRO, C, W), torch.randn(MICRO, C, W)))

        async def open_to(peer: Any) -> Channel:
            return await open_channel(peer.host, host.id, PROTOCOL)

        with trio.fail_after(DEADLINE_S):
            # A driver's FORWARD of the coordinator's eval batch: over any frame a driver sends,
            # refused before it is read (on main it was read and decoded, then refused for its shape).
            async with await open_to(hostile) as channel:
                with pytest.raises(ChannelClosed):
                    await _ask(channel, Frame(Kind.FORWARD, 0, 0, 1, tensors=(torch.randn(EVAL, C, W),)), replica)
            assert replica.refused == {"oversized": 1}
            async with await open_to(coordinator) as channel:  # the coordinator's eval batch still is
                assert (await _ask(channel, Frame(Kind.EVAL, 0, 0, 1, tensors=(torch.randn(EVAL, C, W),)),
                                   replica)).kind == Kind.OUTPUT

            # The stage busy (its lock held): the hostile driver sends its longest request on every
            # channel it may open at once, and only its budget's worth is read; the rest is refused.
            answers: list[Frame | None] = []
            refused = trio.Semaphore(0)

            async def flood(i: int) -> None:
                async with await open_to(hostile) as channel:
                    try:
                        answers.append(await _ask(channel, Frame(Kind.BACKWARD, 0, 100 + i, 1, tensors=backward.tensors),
                                                  replica))
                    except ChannelClosed:
                        answers.append(None)
                        refused.release()

            async with await open_to(honest) as channel, trio.open_nursery() as nursery:
                await replica._lock.acquire()
                try:
                    for i in range(MAX_STREAMS_PER_PEER):
                        nursery.start_soon(flood, i)
                    for _ in range(MAX_STREAMS_PER_PEER - IN_FLIGHT_PER_PEER):  # on main: none, ever
                        await refused.acquire()
                    assert replica.refused["over_budget"] == MAX_STREAMS_PER_PEER - IN_FLIGHT_PER_PEER
                    assert replica._in_flight[hostile.id] == IN_FLIGHT_PER_PEER * replica.frame_bound(hostile.id)
                    assert len(encode_frame(backward)) == replica.frame_bound(hostile.id)
                    # Another driver is within its own budget: its request is read while the flood's wait.
                    await channel.send(encode_frame(Frame(Kind.FORWARD, 0, 7, 1, tensors=(torch.randn(MICRO, C, W),))))
                    while honest.id not in replica._in_flight:  # read and held, waiting for the stage
                        await trio.sleep(0.01)
                finally:
                    replica._lock.release()  # the stage frees up: every request read is answered
                answer = decode_frame(await channel.recv(replica.limits.max_frame_bytes()), replica.limits)
                assert answer.kind == Kind.OUTPUT
            # The flood's requests that were read were answered, and nothing is in flight any more.
            assert sorted(a.kind for a in answers if a is not None) == [Kind.GRAD] * IN_FLIGHT_PER_PEER
            assert not replica._in_flight
            assert replica.refused == {"oversized": 1, "over_budget": MAX_STREAMS_PER_PEER - IN_FLIGHT_PER_PEER}
            # Within its budget again, the hostile driver's next request is answered as any.
            async with await open_to(hostile) as channel:
                assert (await _ask(channel, backward, replica)).kind == Kind.GRAD


async def test_the_coordinator_buffers_one_eval_batch_beside_its_driver_s_budget():
    """An evaluator asks one EVAL of a stage at a time (pipeline/_evaluation.py), so a replica holds
    one of its eval batches, not IN_FLIGHT_PER_PEER of them (32x a driver's frame each with the
    defaults): on main a hostile coordinator had 4 read on a busy replica, and a coordinator that
    also drives 4 of its eval batches and no more. Now the evaluator's 2nd EVAL is refused unread
    (``over_budget``) while a peer of both roles still has its 4 hops and its EVAL read. Fails on main."""
    stage = stages(3)[1]  # a middle block
    async with connected_hosts(3) as hosts:
        coordinator, both, host = hosts
        replica = StageReplica(host.host, stage, lm_loss, senders=[both.id],
                               evaluators=[coordinator.id, both.id], shapes=shapes(3)[1])
        replica.serve()
        evaluation = Frame(Kind.EVAL, 0, 0, 1, tensors=(torch.randn(EVAL, C, W),))
        backward = Frame(Kind.BACKWARD, 0, 0, 1, tensors=(torch.randn(MICRO, C, W), torch.randn(MICRO, C, W)))
        answers: list[Kind | None] = []

        async def send(peer: Any, request: Frame) -> None:
            async with await open_channel(peer.host, host.id, PROTOCOL) as channel:
                try:
                    answers.append((await _ask(channel, request, replica)).kind)
                except ChannelClosed:
                    answers.append(None)

        with trio.fail_after(DEADLINE_S):
            async with trio.open_nursery() as nursery:
                await replica._lock.acquire()
                try:
                    for _ in range(3):  # a hostile coordinator's flood of eval batches on a busy stage
                        nursery.start_soon(send, coordinator, evaluation)
                    eval_bytes = len(encode_frame(evaluation))
                    while replica._in_flight[coordinator.id] // eval_bytes + replica.refused["over_budget"] < 3:
                        await trio.sleep(0.01)  # each of the 3 read and held, or refused unread
                    assert replica.refused["over_budget"] == 2
                    assert replica._in_flight[coordinator.id] == len(encode_frame(evaluation))
                    # A peer of both roles, honest at its worst: 4 hops and an EVAL, all read.
                    for i in range(IN_FLIGHT_PER_PEER):
                        nursery.start_soon(send, both, Frame(Kind.BACKWARD, 0, 10 + i, 1, tensors=backward.tensors))
                    nursery.start_soon(send, both, evaluation)
                    budget = IN_FLIGHT_PER_PEER * len(encode_frame(backward)) + len(encode_frame(evaluation))
                    while replica._in_flight[both.id] < budget:
                        await trio.sleep(0.01)
                    assert replica.refused["over_budget"] == 2
                finally:
                    replica._lock.release()
            assert sorted(a for a in answers if a is not None) == sorted([Kind.OUTPUT] * 2 + [Kind.GRAD] * IN_FLIGHT_PER_PEER)
            assert answers.count(None) == 2 and not replica._in_flight
