"""Error feedback: what a peer did not send is kept and added to its next gradient.

With it, any compressor (top-k included) converges like plain SGD (Karimireddy et al., ICML 2019).
Optional extras from Deep Gradient Compression (Lin et al., ICLR 2018): momentum correction
(accumulate velocity, not raw gradients, and zero the velocity of sent entries — momentum factor
masking) and local gradient clipping. With momentum correction the optimizer must be plain SGD:
the momentum already lives here.

Updates are two-phase so a failed round loses nothing: :meth:`ErrorFeedback.prepare` (and
:meth:`ErrorFeedback.materialize`) compute the candidate state without changing anything; only
:meth:`ErrorFeedback.commit`, after the round succeeded, makes it current. A retry with the same
gradient then starts from the same state. Invariant after a commit: sent + residual == accumulated
input, exactly.

Every member forms the whole accumulated vector (residual + grad) while a round is being set up:
it selects its slice of the index set from it, and after the round it becomes the residual (a
buffer swap, no second full-size pass).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from p2ptrain.base import large_empty


@dataclass
class Pending:
    """One step's candidate state.

    ``grad`` is the gradient after clipping (and momentum correction: then it is the new velocity);
    ``accumulated`` (residual + grad) exists once :meth:`ErrorFeedback.materialize` has run.
    """

    grad: torch.Tensor
    velocity: torch.Tensor | None
    accumulated: torch.Tensor | None = None


class ErrorFeedback:
    """Residual (and optional velocity) of one peer for one flat float32 gradient vector.

    Two buffers per state alternate (materialize writes the spare one, commit swaps them), so a step
    allocates nothing: fresh 64 MiB tensors cost more in page faults than the arithmetic itself.
    A :class:`Pending` is therefore valid only until the next :meth:`prepare`.
    """

    def __init__(self, numel: int, *, momentum: float = 0.0, clip_norm: float | None = None) -> None:
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if clip_norm is not None and clip_norm <= 0:
            raise ValueError("clip_norm must be positive")
        self.momentum = momentum
        self.clip_norm = clip_norm
        self.residual = large_empty(numel).zero_()
        self._spare = large_empty(numel)
        self.velocity = large_empty(numel).zero_() if momentum else None
        self._spare_velocity = large_empty(numel) if momentum else None

    def prepare(self, grad: torch.Tensor) -> Pending:
        """Clip and apply momentum correction to ``grad``; the state is not changed."""
        if grad.shape != self.residual.shape:
            raise ValueError(f"gradient has shape {tuple(grad.shape)}, expected {tuple(self.residual.shape)}")
        grad = grad.to(torch.float32)
        if self.clip_norm is not None:
            norm = float(torch.linalg.vector_norm(grad))
            if norm > self.clip_norm:
                grad = grad * (self.clip_norm / norm)
        if self.velocity is None:
            return Pending(grad, None)
        velocity = torch.add(grad, self.velocity, alpha=self.momentum, out=self._spare_velocity)
        return Pending(velocity, velocity)

    def target(self, pending: Pending) -> torch.Tensor:
        """The tensor :meth:`materialize` will fill, for a caller that runs it later (in a thread)."""
        return self._spare if pending.accumulated is None else pending.accumulated

    def materialize(self, pending: Pending) -> torch.Tensor:
        """residual + grad as a whole vector (what top-k selects from); the state is not changed."""
        if pending.accumulated is None:
            pending.accumulated = torch.add(self.residual, pending.grad, out=self._spare)
        return pending.accumulated

    def accumulate(self, grad: torch.Tensor) -> Pending:
        """:meth:`prepare` then :meth:`materialize`."""
        pending = self.prepare(grad)
        self.materialize(pending)
        return pending

    def commit(
        self, pending: Pending, indices: torch.Tensor | None, value_dtype: torch.dtype,
        sent: torch.Tensor | None = None,
    ) -> None:
        """Make ``pending`` current after sending its entries at ``indices`` (None: all of them).

        The sent values were ``accumulated[indices]`` cast to ``value_dtype``, or, when given,
        ``sent`` (what the members received for them: quantized values, dequantized); the rounding
        stays in the residual, so nothing is lost to fp16 or to the quantization either. Sparse rounds zero the
        velocity of sent entries (DGC's momentum factor masking: their momentum would otherwise be
        applied twice, late); a dense round keeps it, which is exactly momentum SGD.
        """
        if pending.accumulated is None:
            raise ValueError("materialize() the pending state before committing it")
        if pending.accumulated is not self._spare:
            raise ValueError("stale pending state: prepare() was called again since")
        residual = pending.accumulated
        self._spare, self.residual = self.residual, residual
        if indices is None:
            if value_dtype == torch.float32:
                residual.zero_()
            else:
                residual.sub_(residual.to(value_dtype).to(torch.float32))
        elif sent is not None:
            residual.index_copy_(0, indices, residual.index_select(0, indices) - sent)
        elif value_dtype == torch.float32:
            residual.index_fill_(0, indices, 0.0)
        else:
            chosen = residual.index_select(0, indices)
            residual.index_copy_(0, indices, chosen - chosen.to(value_dtype).to(torch.float32))
        if pending.velocity is not None:
            if indices is not None:
                pending.velocity.index_fill_(0, indices, 0.0)
            self._spare_velocity, self.velocity = self.velocity, pending.velocity
