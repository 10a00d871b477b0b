"""Cut a model into S contiguous stages, balanced by parameter count.

A model that can be cut is a sequence of *pieces* applied one after the other: the registry's
``transformer_lm`` (embedding, one piece per block, norm and head) and any ``nn.Sequential`` (its
children). Anything else is refused: cutting an arbitrary ``forward`` would mean tracing the code of
a model, and the model's code is exactly what the network never sends.

Each stage is an ``nn.Module`` that holds the model's own submodules (no copies), so the stages of one
model share its parameters, and composed in order they compute the same operations as the whole
model's ``forward``: the same bits (tests/pipeline/test_partition.py). Each stage keeps the whole
model's tensor names (:meth:`Stage.state_names`), so a stage's file is a subset of the model's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from p2ptrain.models import TinyLM


class PartitionError(ValueError):
    """A model that cannot be cut as asked (the only error of this module)."""


class _Piece(nn.Module):
    """One piece of a model: its submodules under their names in the whole model, and the call that
    applies them. ``owned`` keeps the names (``blocks.3``) so that a stage reports them."""

    def __init__(self, owned: dict[str, nn.Module]) -> None:
        super().__init__()
        self.prefixes = list(owned)
        self.parts = nn.ModuleList(owned.values())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for part in self.parts:
            x = part(x)
        return x


class _LMEmbed(_Piece):
    """TinyLM's token + position embeddings (what its forward does before the first block)."""

    def __init__(self, model: TinyLM) -> None:
        super().__init__({"tokens": model.tokens, "positions": model.positions})
        self.context = model.context

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        if t > self.context:
            raise ValueError(f"sequence of {t} tokens is longer than the model's context {self.context}")
        tokens, positions = self.parts
        out: torch.Tensor = tokens(x.long()) + positions(torch.arange(t, device=x.device))
        return out


class _LMBlock(_Piece):
    """One TinyLM block; the causal mask is rebuilt from the activation, as TinyLM.forward builds it."""

    def __init__(self, name: str, block: nn.Module) -> None:
        super().__init__({name: block})

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        t = h.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=h.device, dtype=h.dtype)
        out: torch.Tensor = self.parts[0](h, src_mask=mask, is_causal=True)
        return out


def pieces_of(model: nn.Module) -> list[_Piece]:
    """The model as a sequence of pieces; :class:`PartitionError` for a model that is not one."""
    if isinstance(model, TinyLM):
        blocks = [_LMBlock(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
        return [_LMEmbed(model), *blocks, _Piece({"norm": model.norm, "head": model.head})]
    if isinstance(model, nn.Sequential):
        # _modules, not named_children(): that skips a module's second appearance, and a Sequential
        # that applies one module twice would lose a step of its forward.
        return [_Piece({name: child}) for name, child in model._modules.items() if child is not None]
    raise PartitionError(
        f"a {type(model).__name__} cannot be cut into stages: only transformer_lm and nn.Sequential "
        "models (a sequence of blocks) can"
    )


class Stage(nn.Module):
    """Stage ``index`` of ``count``: pieces ``first`` .. ``last`` (inclusive) of the model, applied in order."""

    def __init__(self, index: int, count: int, first: int, pieces: Sequence[_Piece]) -> None:
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
            assert isinstance(piece, _Piece)
            for prefix, part in zip(piece.prefixes, piece.parts, strict=True):
                names += [f"{prefix}.{name}" for name in part.state_dict()]
        return names

    def model_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This stage's parameters under their names in the whole model, in the stage's order."""
        out = []
        for piece in self.pieces:
            assert isinstance(piece, _Piece)
            for prefix, part in zip(piece.prefixes, piece.parts, strict=True):
                out += [(f"{prefix}.{name}", p) for name, p in part.named_parameters()]
        return out

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.parameters())


@dataclass(frozen=True)
class Cut:
    """Where a model of ``sizes`` (parameters per piece) is cut: stage i holds pieces
    ``bounds[i]`` .. ``bounds[i + 1] - 1``."""

    bounds: tuple[int, ...]
    sizes: tuple[int, ...]

    def stage_sizes(self) -> list[int]:
        return [sum(self.sizes[a:b]) for a, b in zip(self.bounds, self.bounds[1:], strict=False)]


def balanced_cut(sizes: Sequence[int], stages: int) -> Cut:
    """The contiguous cut of pieces of ``sizes`` into ``stages`` non-empty runs whose largest run is
    smallest (ties: each cut as early as it can be), exactly, by dynamic programming."""
    n = len(sizes)
    if not 1 <= stages <= n:
        raise PartitionError(f"cannot cut {n} pieces into {stages} stages (1 to {n} stages)")
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    # best[k][j]: the smallest largest-stage of pieces[:j] in k stages; cut[k][j]: where the last begins.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    bounds = [n]
    for k in range(stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return Cut(tuple(reversed(bounds)), tuple(sizes))


def _tied_across(pieces: Sequence[_Piece], cut: Cut) -> str | None:
    """The name of a parameter reached from two stages, if any."""
    seen: dict[int, int] = {}
    for stage, (a, b) in enumerate(zip(cut.bounds, cut.bounds[1:], strict=False)):
        for piece in pieces[a:b]:
            for prefix, part in zip(piece.prefixes, piece.parts, strict=True):
                for name, p in part.named_parameters(remove_duplicate=False):
                    if seen.setdefault(id(p), stage) != stage:
                        return f"{prefix}.{name}"
    return None


def partition(model: nn.Module, stages: int) -> list[Stage]:
    """``model`` cut into ``stages`` contiguous stages balanced by parameter count (the embedding in
    the first, the head in the last). The stages hold the model's own modules: composed in order,
    they are the model. :class:`PartitionError` when the model is no sequence of pieces, has fewer
    pieces than stages, or a weight is tied across two stages (each would train its own copy)."""
    pieces = pieces_of(model)
    sizes = [sum(p.numel() for p in piece.parameters()) for piece in pieces]
    cut = balanced_cut(sizes, stages)
    tied = _tied_across(pieces, cut)
    if tied is not None:
        raise PartitionError(f"{tied} is tied to a weight of another stage; cut elsewhere or untie it")
    return [
        Stage(i, stages, a, pieces[a:b])
        for i, (a, b) in enumerate(zip(cut.bounds, cut.bounds[1:], strict=False))
    ]
