"""Samples into batches, epoch after epoch, and a module's loss and accuracy over batches: what the
trainer, the coordinator's evaluation, ``model eval`` and the benches' baselines share."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator, Sized
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from p2ptrain.training._trainer_error import TrainerError

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Metrics:
    loss: float
    accuracy: float
    samples: int


def loss_and_hits(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """Mean cross-entropy, correct predictions and predictions, for ``(N, C)`` or ``(N, T, V)`` logits."""
    flat_logits = logits.reshape(-1, logits.shape[-1]).float()
    flat_targets = targets.reshape(-1).long()
    loss = F.cross_entropy(flat_logits, flat_targets)
    hits = int((flat_logits.argmax(-1) == flat_targets).sum())
    return loss, hits, flat_targets.numel()


def batched(samples: Iterable[Batch], batch_size: int) -> Iterator[Batch]:
    """Stack ``(features, label)`` samples (e.g. from ``IPFSDataset``) into batches; the last may be short."""
    xs: list[torch.Tensor] = []
    ys: list[torch.Tensor] = []
    for x, y in samples:
        xs.append(torch.as_tensor(x))
        ys.append(torch.as_tensor(y))
        if len(xs) == batch_size:
            yield torch.stack(xs), torch.stack(ys)
            xs, ys = [], []
    if xs:
        yield torch.stack(xs), torch.stack(ys)


def batches_forever(dataset: Iterable[Batch], batch_size: int, first_epoch: int = 0, skip: int = 0) -> Iterator[Batch]:
    """Batches epoch after epoch, calling ``dataset.set_epoch`` (when it has one) to reshuffle;
    the first epoch's first ``skip`` batches are passed over (their samples read, not stacked)."""
    epoch = first_epoch
    while True:
        set_epoch = getattr(dataset, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(epoch)
        samples = itertools.islice(dataset, skip * batch_size, None) if skip else dataset
        skip, empty = 0, True
        for batch in batched(samples, batch_size):
            empty = False
            yield batch
        if empty:
            raise TrainerError("the training data of this member is empty")
        epoch += 1


class PositionedBatches(Iterator[Batch]):
    """:func:`batches_forever` of a sized dataset from its ``position``-th batch (counted over
    every epoch from the first), knowing its position as it goes.

    So the batches a member takes at a step are a function of the step (the trainer's
    ``batch_position``), not of what its process did before: a member that resumed after a stop, rolled a
    step back, or moved to another rank takes the batches it would have taken without that.
    Getting there reads (not stacks) up to one epoch of the member's samples.
    """

    def __init__(self, dataset: Sized, batch_size: int, position: int = 0) -> None:
        per_epoch = -(-len(dataset) // batch_size)  # batched() yields a last, short batch
        if per_epoch == 0:
            raise TrainerError("the training data of this member is empty")
        epoch, skip = divmod(position, per_epoch)
        self.position = position
        self._batches = batches_forever(dataset, batch_size, first_epoch=epoch, skip=skip)  # type: ignore[arg-type]

    def __next__(self) -> Batch:
        batch = next(self._batches)
        self.position += 1
        return batch


@torch.no_grad()
def evaluate_batches(
    module: nn.Module,
    batches: Iterable[Batch],
    device: torch.device = torch.device("cpu"),
    autocast: Callable[[], Any] = contextlib.nullcontext,
) -> Metrics:
    """Mean cross-entropy and accuracy of ``module`` (put in eval mode) over ``batches``."""
    module.eval()
    loss_sum, hits, count = 0.0, 0, 0
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with autocast():
            logits = module(x)
        loss, h, n = loss_and_hits(logits, y)
        loss_sum += float(loss) * n
        hits += h
        count += n
    if count == 0:
        raise TrainerError("evaluation data is empty")
    return Metrics(loss=loss_sum / count, accuracy=hits / count, samples=count)
