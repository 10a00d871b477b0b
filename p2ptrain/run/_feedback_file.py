"""This member's error feedback at its last checkpoints, kept on its own disk.

A member's error-feedback residual (what top-k has not sent yet) is its own: no record names it and
no other member holds it. A member that loaded a checkpoint without it would send less for a while
than it would have, and a run that stopped and resumed would differ in every bit from one that did
not. So at each checkpoint every member keeps its residual beside the run's chain, as
``feedback-<step>.safetensors`` (the last :data:`KEPT`), and a member that loads a checkpoint at a
step it kept takes that residual back (:meth:`~p2ptrain.run._spans.Spans.restore_feedback`).
It is read from this home's disk only, as safetensors (no pickle), checked against the model's size.
"""

from __future__ import annotations

import logging

import torch

from p2ptrain.base import write_atomic
from p2ptrain.protocol import RecordError, read_tensors, tensors_bytes
from p2ptrain.run._run_dir import RunDir

logger = logging.getLogger(__name__)

# The checkpoint whose record may still be pending and the one before it: a member restarts at the
# last confirmed record, which is one of these two.
KEPT = 2
# Beyond the residual's bytes: the safetensors header of one tensor (name, dtype, shape, offsets).
_HEADER_BYTES = 4096


def save_feedback(run_dir: RunDir, step: int, residual: torch.Tensor) -> None:
    """Keep ``residual`` as this member's error feedback at ``step`` (atomically); older ones beyond
    the last :data:`KEPT` are removed."""
    write_atomic(run_dir.feedback(step), tensors_bytes({"residual": residual}), mode=0o600)
    for old in run_dir.feedback_steps()[:-KEPT]:
        run_dir.feedback(old).unlink(missing_ok=True)


def load_feedback(run_dir: RunDir, step: int, numel: int) -> torch.Tensor | None:
    """The residual kept at ``step`` for a model of ``numel`` parameters, or None when there is
    none (or it does not fit: logged, and the member goes on without it)."""
    path = run_dir.feedback(step)
    try:
        with open(path, "rb") as f:
            data = f.read(4 * numel + _HEADER_BYTES + 1)
    except FileNotFoundError:
        return None
    try:
        tensors = read_tensors(data)
    except RecordError as exc:
        logger.warning("%s: not used: %s", path, exc)
        return None
    residual = tensors.get("residual")
    if set(tensors) != {"residual"} or residual is None or residual.dtype != torch.float32 \
            or tuple(residual.shape) != (numel,):
        logger.warning("%s: not used: it is no float32 residual of %d entries", path, numel)
        return None
    return residual
