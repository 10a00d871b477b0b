"""A model's gradients as one flat vector cut into buckets, and back.

Top-k is chosen per bucket (so a layer with small gradients still gets its share, as DGC does per
layer) while a whole step travels in one all-reduce round (one set of hops, not one per layer).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

BUCKET_BYTES = 8 << 20


class Buckets:
    """Consecutive trainable parameters grouped into flat buckets of about ``bucket_bytes``."""

    def __init__(self, params: Iterable[torch.nn.Parameter], *, bucket_bytes: int = BUCKET_BYTES) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("no trainable parameters")
        for p in self.params:
            if p.dtype != torch.float32:
                raise ValueError(f"parameters must be float32, found {p.dtype}")
        self.sizes: list[int] = []
        current = 0
        for p in self.params:
            n = p.numel()
            if current and (current + n) * 4 > bucket_bytes:
                self.sizes.append(current)
                current = 0
            current += n
        self.sizes.append(current)
        self.numel = sum(self.sizes)

    def flatten_grads(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """All gradients in one flat float32 tensor (zeros where a parameter has no gradient)."""
        flat = torch.empty(self.numel, dtype=torch.float32) if out is None else out
        offset = 0
        for p in self.params:
            n = p.numel()
            if p.grad is None:
                flat[offset : offset + n].zero_()
            else:
                flat[offset : offset + n].copy_(p.grad.reshape(-1))
            offset += n
        return flat

    def write_grads(self, flat: torch.Tensor) -> None:
        """Set every parameter's ``.grad`` from the flat vector (the averaged update)."""
        if flat.shape != (self.numel,):
            raise ValueError(f"expected a flat tensor of {self.numel} entries, got {tuple(flat.shape)}")
        offset = 0
        for p in self.params:
            n = p.numel()
            piece = flat[offset : offset + n].view_as(p)
            if p.grad is None:
                p.grad = piece.to(p.dtype).clone()
            else:
                p.grad.copy_(piece)
            offset += n
