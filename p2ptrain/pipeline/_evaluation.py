"""A checkpoint's test-split metrics, computed through the stages: no member holds the whole model.

Whoever computes a record's metrics (the coordinator, which serves one stage or none) sends each test
batch forward through one replica of every stage (``EVAL``: the stage's input, and at the last stage
the targets too), computing its own stage itself, and sums the last stage's ``SCORE`` answers (mean
loss, correct predictions among how many) as one process's evaluation does
(``training.evaluate_batches``: the mean over samples of each batch's mean loss, weighted by its
predictions). A replica keeps no graph for an EVAL and accumulates nothing, and answers in fp32, so
the metrics are those of the assembled model within float rounding (``model verify --eval`` checks
them so).

Bounded: at most ``max_samples`` samples of the split (the batches after are not sent), each hop
within ``hop_timeout`` (a replica that fails, answers garbage or too late is left for the rest of the
evaluation and the hop goes to another replica of its stage), the whole within ``deadline_s``
(:class:`EvaluationFailed` past it, or when a stage has no replica left): metrics are a report, so
the caller publishes without them rather than stall (docs/pipeline.md, "Test metrics").
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID
from torch import nn

from p2ptrain.net import ChannelError
from p2ptrain.pipeline._channels import ChannelPool
from p2ptrain.pipeline._driver import PipelineError
from p2ptrain.pipeline._partition import output_shape
from p2ptrain.pipeline._replica import eval_forward, eval_score, Loss, PROTOCOL
from p2ptrain.wire.activations import ActivationError, decode_frame, DEFAULT_LIMITS, encode_frame, Frame, Kind, Limits

# A hop's deadline and the whole evaluation's, unless the caller says otherwise.
EVAL_HOP_TIMEOUT_S = 30.0
EVAL_DEADLINE_S = 300.0


class EvaluationFailed(PipelineError):
    """No metrics: a stage without a replica that answers, or the evaluation's deadline passed."""


@dataclass(frozen=True)
class Evaluation:
    loss: float
    accuracy: float
    samples: int  # the batches' samples evaluated
    predictions: int  # what the accuracy counts (a language model predicts one token per position)


class _BadAnswer(Exception):
    pass


async def evaluate_stages(
    host: IHost, replicas: Mapping[int, Sequence[ID]], cut: Sequence[nn.Module], loss: Loss,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]], *, step: int, local: int | None = None,
    protocol: str = PROTOCOL, limits: Limits = DEFAULT_LIMITS, hop_timeout: float = EVAL_HOP_TIMEOUT_S,
    deadline_s: float = EVAL_DEADLINE_S, max_samples: int | None = None,
    pool: ChannelPool | None = None,
) -> Evaluation:
    """The mean loss and accuracy of the model ``cut`` into stages over ``batches`` (input, targets),
    each stage computed by one of its ``replicas`` (tried in order), except stage ``local``, computed
    here from ``cut[local]``; ``loss``: the last stage's, as its replicas have it. ``cut``: every
    stage's module (those not held here on the meta device: only their output shapes are used, to
    check the answers). ``step``: what the replicas serve now (each refuses another step).
    :class:`EvaluationFailed` when it cannot complete (module doc)."""
    own = pool if pool is not None else ChannelPool(host, protocol, clock=time.monotonic)
    left_out: set[Hashable] = set()
    loss_sum, hits, predictions, samples = 0.0, 0, 0, 0
    try:
        with trio.move_on_after(deadline_s) as scope:
            for mb, (x, targets) in enumerate(batches):
                if max_samples is not None and samples >= max_samples:
                    break
                if max_samples is not None and samples + len(x) > max_samples:
                    x, targets = x[: max_samples - samples], targets[: max_samples - samples]
                for s in range(len(cut) - 1):
                    x = await _through(own, replicas, cut, left_out, s, local, step, mb, (x,), hop_timeout, limits)
                mean, h = await _scored(own, replicas, cut, loss, left_out, local, step, mb, x, targets, hop_timeout, limits)
                n = targets.numel()
                loss_sum, hits, predictions, samples = loss_sum + mean * n, hits + h, predictions + n, samples + len(x)
        if scope.cancelled_caught:
            raise EvaluationFailed(f"the evaluation took over {deadline_s:.0f} s ({samples} samples done)")
    finally:
        if pool is None:
            await own.aclose()
    if predictions == 0:
        raise EvaluationFailed("the test split is empty")
    return Evaluation(loss=loss_sum / predictions, accuracy=hits / predictions, samples=samples, predictions=predictions)


async def _through(
    pool: ChannelPool, replicas: Mapping[int, Sequence[ID]], cut: Sequence[nn.Module], left_out: set[Hashable],
    stage: int, local: int | None, step: int, mb: int, tensors: tuple[torch.Tensor, ...], hop_timeout: float,
    limits: Limits,
) -> torch.Tensor:
    """Stage ``stage``'s output for ``tensors[0]`` (a middle stage): here, or from a replica."""
    if stage == local:
        return await trio.to_thread.run_sync(eval_forward, cut[stage], tensors[0])
    want = output_shape(cut[stage], tensors[0])
    answer = await _ask(pool, replicas, left_out, stage, step, mb, tensors, hop_timeout, limits,
                        lambda a: a.kind == Kind.OUTPUT and len(a.tensors) == 1 and a.tensors[0].shape == want)
    return answer.tensors[0]


async def _scored(
    pool: ChannelPool, replicas: Mapping[int, Sequence[ID]], cut: Sequence[nn.Module], loss: Loss,
    left_out: set[Hashable], local: int | None, step: int, mb: int, x: torch.Tensor, targets: torch.Tensor,
    hop_timeout: float, limits: Limits,
) -> tuple[float, int]:
    """The last stage's mean loss and correct predictions for ``x`` and ``targets``."""
    last = len(cut) - 1
    if last == local:
        out = await trio.to_thread.run_sync(eval_forward, cut[last], x)
        return eval_score(out, targets, loss)
    n = targets.numel()

    def valid(a: Frame) -> bool:
        if a.kind != Kind.SCORE or len(a.tensors) != 1 or a.tensors[0].shape != (2,) or a.tensors[0].is_floating_point():
            return False
        hits, count = (int(v) for v in a.tensors[0])
        return count == n and 0 <= hits <= n and math.isfinite(a.value) and a.value >= 0

    answer = await _ask(pool, replicas, left_out, last, step, mb, (x, targets), hop_timeout, limits, valid)
    return float(answer.value), int(answer.tensors[0][0])


async def _ask(
    pool: ChannelPool, replicas: Mapping[int, Sequence[ID]], left_out: set[Hashable], stage: int, step: int,
    mb: int, tensors: tuple[torch.Tensor, ...], hop_timeout: float, limits: Limits, valid: Callable[[Frame], bool],
) -> Frame:
    """One EVAL hop to the first replica of ``stage`` not left out whose answer is ``valid``; a
    replica that fails is left out of the rest of the evaluation."""
    data = encode_frame(Frame(Kind.EVAL, step, mb, stage, tensors=tensors), "fp32")
    for peer in replicas.get(stage, ()):
        if peer in left_out:
            continue
        try:
            with trio.fail_after(hop_timeout):
                async with pool.channel(peer) as channel:
                    await channel.send(data)
                    answer = decode_frame(await channel.recv(limits.max_frame_bytes()), limits)
                    if answer.step != step or answer.microbatch != mb or answer.stage != stage or not valid(answer):
                        raise _BadAnswer(f"answered a {answer.kind} frame that is no answer to the EVAL")
            return answer
        except (ChannelError, ActivationError, _BadAnswer, trio.TooSlowError):
            left_out.add(peer)
    raise EvaluationFailed(f"no replica of stage {stage} answered the evaluation")
