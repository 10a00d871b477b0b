"""Evaluate a model on a dataset: the numbers `p2ptrain model eval` and the demo report."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from p2ptrain.training.trainer import Batch, batched, loss_and_hits


@torch.no_grad()
def evaluate_model(module: nn.Module, samples: Iterable[Batch], batch_size: int = 256) -> dict[str, float | int]:
    """Mean cross-entropy and accuracy of ``module`` over ``(features, label)`` samples."""
    module.eval()
    loss_sum, hits, count = 0.0, 0, 0
    for x, y in batched(samples, batch_size):
        loss, h, n = loss_and_hits(module(x), y)
        loss_sum += float(loss) * n
        hits += h
        count += n
    if count == 0:
        raise ValueError("no samples to evaluate on")
    return {"accuracy": hits / count, "loss": loss_sum / count, "samples": count}
