"""Checks on whole tensors that every layer makes, done in one pass.

A leaf module (it imports nothing of ours), so the collective and the trainer can share it.
"""

from __future__ import annotations

import numpy as np
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


_NUMPY_OF = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.uint16, torch.uint8: np.uint8}


def large_empty(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised flat tensor, backed by transparent huge pages where the kernel offers them.

    For buffers of model size that live across steps (error-feedback residuals, round outputs):
    numpy advises the kernel to back its large allocations with 2 MiB pages (``madvise``; Linux's
    default policy is "madvise"), torch's allocator does not. On 16M floats that made a full pass
    ~30% cheaper and a gather or scatter at 1% of the positions ~1/3 cheaper (2.1 -> 1.4 ms: far
    fewer TLB misses). Elsewhere it is a plain allocation.
    """
    array = np.empty(numel, dtype=_NUMPY_OF[dtype])
    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if dtype == torch.bfloat16 else tensor
