"""Cut a model into S contiguous stages, balanced by parameter count.

The pieces a model is made of, the balanced cut and the check for weights tied across stages live in
:mod:`p2ptrain.models._pieces` (a task's parse checks the cut on the meta device, and ``task`` does
not import this package); here the stages themselves, built on the model's own modules.

Each stage is an ``nn.Module`` that holds the model's own submodules (no copies), so the stages of one
model share its parameters, and composed in order they compute the same operations as the whole
model's ``forward``: the same bits (tests/pipeline/test_partition.py). Each stage keeps the whole
model's tensor names (:meth:`Stage.state_names`), so a stage's file is a subset of the model's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from p2ptrain.models import cut_at, cut_pieces, Piece, pieces_of


class Stage(nn.Module):
    """Stage ``index`` of ``count``: pieces ``first`` .. ``last`` (inclusive) of the model, applied in order."""

    def __init__(self, index: int, count: int, first: int, pieces: Sequence[Piece]) -> None:
        super().__init__()
        self.index, self.count, self.first = index, count, first
        self.last = first + len(pieces) - 1
        self.pieces = nn.ModuleList(pieces)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for piece in self.pieces:
            x = piece(x)
        return x

    def state_names(self) -> list[str]:
        """The names this stage's tensors have in the whole model's state dict, in its order."""
        names = []
        for piece in self.pieces:
            assert isinstance(piece, Piece)
            names += piece.state_names()
        return names

    def model_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This stage's parameters under their names in the whole model, in the stage's order."""
        out = []
        for piece in self.pieces:
            assert isinstance(piece, Piece)
            for prefix, part in zip(piece.prefixes, piece.parts, strict=True):
                out += [(f"{prefix}.{name}", p) for name, p in part.named_parameters()]
        return out

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.parameters())


def partition(model: nn.Module, stages: int) -> list[Stage]:
    """``model`` cut into ``stages`` contiguous stages balanced by parameter count (the embedding in
    the first, the head in the last). The stages hold the model's own modules: composed in order,
    they are the model. ``models.PartitionError`` when the model is no sequence of pieces, has fewer
    pieces than stages, or a weight is tied across two stages (each would train its own copy)."""
    pieces, cut = cut_pieces(model, stages)
    return [
        Stage(i, stages, a, pieces[a:b])
        for i, (a, b) in enumerate(zip(cut.bounds, cut.bounds[1:], strict=False))
    ]


def partition_at(model: nn.Module, bounds: Sequence[int]) -> list[Stage]:
    """``model`` cut at ``bounds`` (each stage's first piece, then the number of pieces), as a plan
    of a task that moves its cut by measured time names it (protocol/_recut.py); the stages hold the
    model's own modules, as :func:`partition`'s. ``models.PartitionError`` as ``models.cut_at``."""
    pieces = pieces_of(model)
    cut = cut_at(pieces, bounds)
    count = len(cut.bounds) - 1
    return [Stage(i, count, a, pieces[a:b]) for i, (a, b) in enumerate(zip(cut.bounds, cut.bounds[1:], strict=False))]


def output_shape(stage: nn.Module, x: torch.Tensor) -> torch.Size:
    """The shape of ``stage``'s output for an input shaped and typed as ``x``, computed on the meta
    device (nothing allocated, the values of the stage's tensors untouched, wherever they are: a member's
    freed stages are on meta already). A driver checks every answer against it: an activation of
    another shape is the answering replica's fault, not the next stage's. (``functional_call``
    swaps the stage's tensors for the meta ones while it runs: not for a stage that computes in
    another thread meanwhile; a driver asks it of the stages it does not serve.)"""
    meta = {name: torch.empty_like(t, device="meta") for name, t in
            [*stage.named_parameters(remove_duplicate=False), *stage.named_buffers(remove_duplicate=False)]}
    with torch.no_grad():
        out: torch.Tensor = torch.func.functional_call(stage, meta, (torch.empty_like(x, device="meta"),))
    return out.shape
