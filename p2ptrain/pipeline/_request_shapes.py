"""What the tensors of a request to a stage's replica may be: the task fixes every one of them.

A driver sends a stage at most ``microbatch_size`` samples at a time (run/_stages.py cuts its batch
so), the coordinator evaluates at most ``eval_batch_size`` a batch, and one sample's activation at
a stage's input, its gradient at the stage's output and its targets have the shapes the model and
the data set give them (a `transformer_lm`'s: context x width, and context token ids). Without
this, a replica took any tensor within the frame limits (4 Mi values) and computed it: a hostile
driver's FORWARDs of many microbatches' samples each loaded an honest replica until the other
drivers judged it a straggler (docs/security.md, "Pipelined tasks"). With it, a request whose
tensors are not of the task's shapes is refused before anything is computed, and the frame limits
(what a replica reads and decodes of a request at most) are the task's largest request's, never
over the default ones (a large model's eval batch would otherwise let a peer make a replica buffer
gigabytes a stream; such an EVAL is refused as it was before).

The shapes are computed once, on the meta device, on a model of their own (nothing allocated, and
no stage a member serves is touched while it computes in another thread): :func:`request_shapes`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from p2ptrain.pipeline._partition import output_shape, partition, partition_at
from p2ptrain.wire.activations import DEFAULT_LIMITS, Frame, Kind, Limits

# The requests whose second tensor is the gradient of the stage's output (the others': targets).
_BACKWARDS = (Kind.BACKWARD, Kind.CHECK_BACKWARD)


@dataclass(frozen=True)
class RequestShapes:
    """The requests one stage's replica answers: at most ``microbatch`` samples (``evaluation`` in an
    EVAL), each shaped ``inputs`` at the stage's input, ``outputs`` at its output (a BACKWARD's
    gradient; None at the last stage, which takes none) and ``targets`` (the last stage's LOSS and EVAL)."""

    microbatch: int
    evaluation: int
    inputs: tuple[int, ...]
    outputs: tuple[int, ...] | None
    targets: tuple[int, ...]

    def limits(self) -> Limits:
        """The frame limits of the largest request (a tensor of the most samples of any request, each
        of the largest per-sample shape a request carries), within the default limits."""
        shapes = [self.inputs, self.targets] + ([self.outputs] if self.outputs is not None else [])
        largest = max(self.microbatch, self.evaluation) * max(math.prod(s) for s in shapes)
        return Limits(max_rank=1 + max(map(len, shapes)), max_elements=min(largest, DEFAULT_LIMITS.max_elements))

    def problem(self, request: Frame) -> str | None:
        """Why ``request``'s tensors are not of the task's shapes, or None (a request of the right
        kind and number of tensors: StageReplica checks those first)."""
        if not request.tensors:
            return None  # HOLDINGS
        most = self.evaluation if request.kind == Kind.EVAL else self.microbatch
        x = request.tensors[0]
        samples = x.shape[0]
        name = Kind(request.kind).name
        if samples > most:
            return f"a {name} of {samples} samples; the task's are at most {most}"
        if tuple(x.shape[1:]) != self.inputs:
            return f"a {name} of input {tuple(x.shape)}; the stage takes {('n', *self.inputs)}"
        if len(request.tensors) > 1:
            second = self.outputs if request.kind in _BACKWARDS else self.targets
            if second is None:
                return f"a {name} at the last stage, which takes no gradient of its output"
            expected = (samples, *second)
            if tuple(request.tensors[1].shape) != expected:
                return f"a {name} whose second tensor is {tuple(request.tensors[1].shape)}, not {expected}"
        return None


def request_shapes(model: nn.Module, stages: int, sample: torch.Tensor, targets: Sequence[int], *,
                   microbatch: int, evaluation: int, cut: Sequence[int] | None = None) -> list[RequestShapes]:
    """Each of the ``stages`` stages' :class:`RequestShapes` for ``model`` (on the meta device: a
    model of its own, not the one trained) cut as the task cuts it (or at the bounds ``cut``, a
    plan's); ``sample``: one sample as stage 0 takes it (its shape and dtype; any device),
    ``targets``: one sample's targets' shape."""
    x = torch.empty((1, *sample.shape), dtype=sample.dtype, device="meta")
    shapes = [tuple(sample.shape)]
    for stage in partition(model, stages) if cut is None else partition_at(model, cut):
        x = torch.empty(output_shape(stage, x), dtype=torch.float32, device="meta")
        shapes.append(tuple(x.shape[1:]))
    return [RequestShapes(microbatch, evaluation, shapes[i], shapes[i + 1] if i < stages - 1 else None, tuple(targets))
            for i in range(stages)]
