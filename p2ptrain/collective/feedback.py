"""Error feedback: what a peer did not send is kept and added to its next gradient.

With it, any compressor (top-k included) converges like plain SGD (Karimireddy et al., ICML 2019).
Optional extras from Deep Gradient Compression (Lin et al., ICLR 2018): momentum correction
(accumulate velocity, not raw gradients, and zero the velocity of sent entries — momentum factor
masking) and local gradient clipping. With momentum correction the optimizer must be plain SGD:
the momentum already lives here.

Updates are two-phase so a failed round loses nothing: :meth:`ErrorFeedback.accumulate` computes the
candidate state without changing anything; only :meth:`ErrorFeedback.commit`, after the round
succeeded, makes it current. A retry with the same gradient then starts from the same state.
Invariant after a commit: sent + residual == accumulated input, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Pending:
    """One step's accumulated tensor (what top-k selects from) and its candidate velocity."""

    accumulated: torch.Tensor
    velocity: torch.Tensor | None


class ErrorFeedback:
    """Residual (and optional velocity) of one peer for one flat float32 gradient vector."""

    def __init__(self, numel: int, *, momentum: float = 0.0, clip_norm: float | None = None) -> None:
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if clip_norm is not None and clip_norm <= 0:
            raise ValueError("clip_norm must be positive")
        self.momentum = momentum
        self.clip_norm = clip_norm
        self.residual = torch.zeros(numel, dtype=torch.float32)
        self.velocity = torch.zeros(numel, dtype=torch.float32) if momentum else None

    def accumulate(self, grad: torch.Tensor) -> Pending:
        """residual + grad (or + the corrected velocity); the state is not changed yet."""
        if grad.shape != self.residual.shape:
            raise ValueError(f"gradient has shape {tuple(grad.shape)}, expected {tuple(self.residual.shape)}")
        grad = grad.to(torch.float32)
        if self.clip_norm is not None:
            norm = float(torch.linalg.vector_norm(grad))
            if norm > self.clip_norm:
                grad = grad * (self.clip_norm / norm)
        velocity = None
        if self.velocity is not None:
            velocity = torch.add(grad, self.velocity, alpha=self.momentum)
            return Pending(self.residual + velocity, velocity)
        return Pending(self.residual + grad, None)

    def commit(self, pending: Pending, indices: torch.Tensor | None, value_dtype: torch.dtype) -> None:
        """Make ``pending`` current after sending its entries at ``indices`` (None: all of them).

        The sent values were ``accumulated[indices]`` cast to ``value_dtype``; the rounding of that
        cast stays in the residual, so nothing is lost to fp16 either. Sparse rounds zero the
        velocity of sent entries (DGC's momentum factor masking: their momentum would otherwise be
        applied twice, late); a dense round keeps it, which is exactly momentum SGD.
        """
        accumulated = pending.accumulated
        if indices is None:
            sent = accumulated.to(value_dtype).to(torch.float32)
            residual = accumulated - sent
        else:
            residual = accumulated  # take ownership: accumulate() made a fresh tensor
            chosen = accumulated.index_select(0, indices)
            residual.index_copy_(0, indices, chosen - chosen.to(value_dtype).to(torch.float32))
        self.residual = residual
        if pending.velocity is not None:
            if indices is not None:
                pending.velocity.index_fill_(0, indices, 0.0)
            self.velocity = pending.velocity
