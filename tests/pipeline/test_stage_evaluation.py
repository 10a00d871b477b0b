"""A checkpoint's test metrics through the stages (EVAL, protocol 1.3.0) on real libp2p hosts: the
same loss and accuracy as one process evaluating the assembled model, with nothing kept or
accumulated at the replicas, around a replica that fails, and bounded."""

from __future__ import annotations

from contextlib import asynccontextmanager

import pytest
import torch
import torch.nn.functional as F
import trio

from p2ptrain.models._registry import build_model
from p2ptrain.net import Channel, ChannelError, open_channel, serve_channels
from p2ptrain.pipeline import evaluate_stages, EvaluationFailed, partition, PROTOCOL, StageReplica
from p2ptrain.testing import connected_hosts
from p2ptrain.training import evaluate_batches
from p2ptrain.wire.activations import encode_frame, Frame, Kind

LM = {"vocab_size": 50, "context": 8, "width": 16, "depth": 6, "heads": 2}
STAGES, SEED = 4, 11
DEADLINE_S = 60


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1).long())


def split_batches(batches: int = 3, size: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(batches):
        tokens = torch.randint(0, LM["vocab_size"], (size, LM["context"] + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


async def answer_garbage(channel: Channel) -> None:
    """A dishonest replica: a well-formed OUTPUT of a useless shape to any request."""
    await channel.recv(1 << 20)
    await channel.send(encode_frame(Frame(Kind.OUTPUT, 0, 0, 1, tensors=(torch.zeros(1),))))


@asynccontextmanager
async def stage_hosts(garbage: int | None = None):
    """Host 0 evaluates and holds stage 2 itself; hosts 1.. serve stages 0, 1, 1, 3 (host ``garbage``
    answers garbage instead), answering host 0's EVALs only (their senders: nobody)."""
    async with connected_hosts(5) as hosts:
        cut = partition(build_model("transformer_lm", LM, seed=SEED), STAGES)
        for stage in cut:
            stage.train()  # as a member's stage is: an EVAL computes in eval mode and puts it back
        served = {1: 0, 2: 1, 3: 1, 4: 3}
        servers = []
        for i, s in served.items():
            if i == garbage:
                serve_channels(hosts[i].host, PROTOCOL, answer_garbage)
                continue
            replica = StageReplica(hosts[i].host, cut[s], lm_loss, senders=[], evaluators=[hosts[0].id])
            replica.serve()
            servers.append(replica)
        replicas = {s: [hosts[i].id for i, t in served.items() if t == s] for s in range(STAGES)}
        yield hosts, cut, replicas, servers


def assembled(cut) -> torch.nn.Module:
    return torch.nn.Sequential(*cut)


async def test_evaluation_through_the_stages_is_one_process_evaluation():
    batches = split_batches()
    async with stage_hosts() as (hosts, cut, replicas, servers):
        with trio.fail_after(DEADLINE_S):
            got = await evaluate_stages(hosts[0].host, replicas, cut, lm_loss, batches, step=0, local=2)
        expected = evaluate_batches(assembled(cut), batches)
        for stage in cut:
            stage.train()
        assert got.loss == pytest.approx(expected.loss, rel=1e-6, abs=1e-6)
        assert got.accuracy == expected.accuracy
        assert (got.samples, got.predictions) == (15, expected.samples)
        # Nothing kept, nothing accumulated, and the stages back in training mode.
        # The first replica of each stage answered (host 3, stage 1's second, was not needed).
        assert [r.evaluations for r in servers] == [len(batches), len(batches), 0, len(batches)]
        for replica in servers:
            assert replica.held() == set() and not replica._graphs
            assert all(p.grad is None for p in replica.stage.parameters()) and replica.stage.training
        assert cut[2].training


async def test_a_replica_answering_garbage_is_passed_over():
    batches = split_batches()
    async with stage_hosts(garbage=2) as (hosts, cut, replicas, servers):
        with trio.fail_after(DEADLINE_S):
            got = await evaluate_stages(hosts[0].host, replicas, cut, lm_loss, batches, step=0, local=2)
        expected = evaluate_batches(assembled(cut), batches)
        assert got.loss == pytest.approx(expected.loss, rel=1e-6, abs=1e-6)
        assert servers[1].evaluations == len(batches)  # host 3, the other replica of stage 1


async def test_the_evaluation_is_bounded():
    batches = split_batches()
    async with stage_hosts() as (hosts, cut, replicas, servers):
        with trio.fail_after(DEADLINE_S):
            part = await evaluate_stages(hosts[0].host, replicas, cut, lm_loss, batches, step=0, local=2, max_samples=7)
            assert part.samples == 7
            assert part.loss == pytest.approx(evaluate_batches(assembled(cut), [(batches[0][0], batches[0][1]),
                                                                                 (batches[1][0][:2], batches[1][1][:2])]).loss,
                                              rel=1e-6, abs=1e-6)
            with pytest.raises(EvaluationFailed, match="took over"):
                await evaluate_stages(hosts[0].host, replicas, cut, lm_loss, batches, step=0, local=2, deadline_s=0.0)
            # A step the replicas do not serve is refused by both replicas of stage 0: no metrics.
            with pytest.raises(EvaluationFailed, match="no replica of stage 0"):
                await evaluate_stages(hosts[0].host, replicas, cut, lm_loss, batches, step=5, local=2, hop_timeout=2.0)


async def test_an_evaluator_is_answered_eval_only():
    """The coordinator is admitted for EVAL: a FORWARD or a LOSS of its (which would keep a graph or
    accumulate a gradient) is refused as an outsider's."""
    async with stage_hosts() as (hosts, cut, replicas, servers):
        last = servers[-1]
        x, y = split_batches(1)[0]
        hidden = torch.zeros(x.shape[0], LM["context"], LM["width"])
        with trio.fail_after(DEADLINE_S):
            for frame in (Frame(Kind.LOSS, 0, 1, 3, 1.0, (hidden, y)), Frame(Kind.FORWARD, 0, 1, 3, tensors=(hidden,))):
                async with await open_channel(hosts[0].host, hosts[4].id, PROTOCOL) as channel:
                    await channel.send(encode_frame(frame))
                    with pytest.raises(ChannelError):
                        await channel.recv(1 << 20)
        assert last.refused["outsider"] == 2 and last.held() == set()
        assert all(p.grad is None for p in last.stage.parameters())
