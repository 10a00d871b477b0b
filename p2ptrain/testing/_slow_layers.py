"""Layers made slow on purpose, for tests and benches of the plans that weigh stages by measured time
(docs/pipeline.md, "Re-cutting by measured time"): a slowness that goes with a model's pieces
wherever a cut puts them, as a layer with more arithmetic than its parameters say."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from p2ptrain.models import LMBlock, Piece


class _SlowBackward(torch.autograd.Function):
    """Identity, whose backward keeps the computing thread ``seconds`` first."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return h.view_as(h)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


@contextmanager
def slow_layers(seconds: Mapping[str, float]) -> Iterator[None]:
    """Within the block, each forward and each backward of a ``transformer_lm`` piece whose first
    module is named in ``seconds`` (``"blocks.1"``; ``"norm"``: the head) takes that many seconds
    more, in the thread that computes it (a stage's replica and driver compute in worker threads,
    one computation at a time), whichever member's stage holds it. Not on the meta device."""
    kinds = (LMBlock, Piece)  # the blocks, and the head (a plain Piece of norm and head)
    originals = {kind: kind.__dict__["forward"] for kind in kinds}

    def slowed(original: Any) -> Any:
        def forward(self: Piece, h: torch.Tensor) -> torch.Tensor:
            delay = seconds.get(self.prefixes[0], 0.0)
            if not delay or h.is_meta:
                out: torch.Tensor = original(self, h)
                return out
            time.sleep(delay)
            slow: torch.Tensor = _SlowBackward.apply(original(self, h), delay)  # type: ignore[no-untyped-call]
            return slow
        return forward

    for kind in kinds:
        kind.forward = slowed(originals[kind])  # type: ignore[method-assign]
    try:
        yield
    finally:
        for kind, original in originals.items():
            kind.forward = original  # type: ignore[method-assign]
