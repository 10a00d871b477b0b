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
from p2ptrain.wire.activations import DEFAULT_LIMITS, Frame, frame_bound, HEADER, Kind, Limits

# An evaluator's EVALs a replica holds read and not yet answered at most (RequestShapes.budget).
EVALS_IN_FLIGHT = 1
# The requests whose second tensor is the gradient of the stage's output (the others': targets).
_BACKWARDS = (Kind.BACKWARD, Kind.CHECK_BACKWARD)


@dataclass(frozen=True)
class RequestShapes:
    """The requests one stage's replica answers: at most ``microbatch`` samples (``evaluation`` in an
    EVAL), each shaped ``inputs`` at the stage's input, ``outputs`` at its output (a BACKWARD's
    gradient; None at the last stage, which takes none) and ``targets`` (the last stage's LOSS and EVAL).
    ``float_inputs``: the stage's input is an activation (stage 0's may be token ids)."""

    microbatch: int
    evaluation: int
    inputs: tuple[int, ...]
    outputs: tuple[int, ...] | None
    targets: tuple[int, ...]
    float_inputs: bool = True

    def limits(self) -> Limits:
        """The frame limits of the largest request (a tensor of the most samples of any request, each
        of the largest per-sample shape a request carries), within the default limits."""
        shapes = [self.inputs, self.targets] + ([self.outputs] if self.outputs is not None else [])
        largest = max(self.microbatch, self.evaluation) * max(math.prod(s) for s in shapes)
        return Limits(max_rank=1 + max(map(len, shapes)), max_elements=min(largest, DEFAULT_LIMITS.max_elements))

    def frame_bytes(self, *, sender: bool, evaluator: bool) -> int:
        """The longest request frame a peer of these roles sends the stage: a sender's (a driver's)
        requests carry at most ``microbatch`` samples of the input and of the widest second tensor
        (its output's gradient, or targets), an evaluator's EVAL ``evaluation`` samples of the input
        and targets; an activation's values at 4 bytes (fp32, the widest float encoding), any other's
        (token ids, targets) at 8 (i64); never over the frame limits. A driver's frame is thus never
        an evaluation batch's (the limits are the largest of any request's, for every peer): the
        bound a replica reads a peer's request within, and its budget's unit (StageReplica.reserve)."""
        inputs, targets = (self.inputs, self.float_inputs), (self.targets, False)  # targets counted as i64
        # A sender's second tensor: its output's gradient (an activation) or targets, the longer.
        seconds = [targets] + ([(self.outputs, True)] if self.outputs is not None else [])
        largest = HEADER.size  # HOLDINGS, or a peer of neither role (refused before it is read)
        if sender:
            largest = max(largest, *(_frame_bytes(self.microbatch, [inputs, second]) for second in seconds))
        if evaluator:
            largest = max(largest, _frame_bytes(self.evaluation, [inputs, targets]))
        return min(largest, self.limits().max_frame_bytes())

    def budget(self, frames: int, *, sender: bool, evaluator: bool) -> int:
        """The bytes of a peer's requests read and not yet answered a replica holds at most (its
        ``StageReplica.reserve``): a sender's ``frames`` of its longest request, an evaluator's
        :data:`EVALS_IN_FLIGHT` of its longest EVAL (an eval batch's, up to 32x a driver's frame with
        the defaults), a peer of both roles the sum. Not ``frames`` EVALs: an evaluator asks one
        batch of one stage at a time, on a channel it reuses, and leaves a replica that failed one
        out of the rest of its evaluation (pipeline/_evaluation.py), so a coordinator's budget of
        ``frames`` eval batches was only ever a hostile one's."""
        ours = frames * self.frame_bytes(sender=True, evaluator=False) if sender else 0
        return ours + (EVALS_IN_FLIGHT * self.frame_bytes(sender=False, evaluator=True) if evaluator else 0)

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


def _frame_bytes(samples: int, tensors: Sequence[tuple[tuple[int, ...], bool]]) -> int:
    """The longest frame of one tensor of ``samples`` samples of each ``(per-sample shape, is_float)``."""
    return frame_bound([((samples, *shape), is_float) for shape, is_float in tensors])


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
    return [RequestShapes(microbatch, evaluation, shapes[i], shapes[i + 1] if i < stages - 1 else None, tuple(targets),
                          float_inputs=i > 0 or sample.is_floating_point()) for i in range(stages)]
