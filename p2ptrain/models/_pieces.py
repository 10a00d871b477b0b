"""A model as a sequence of pieces, and where to cut it into S contiguous stages balanced by
parameter count.

A model that can be cut is a sequence of *pieces* applied one after the other: the registry's
``transformer_lm`` (embedding, one piece per block, norm and head) and any ``nn.Sequential`` (its
children). Anything else is refused: cutting an arbitrary ``forward`` would mean tracing the code of
a model, and the model's code is exactly what the network never sends.

This lives with the models (not in ``pipeline``, which builds the stages and carries them over the
network) because a task's parse checks that its model can be cut into ``[pipeline] stages``, on the
meta device (:func:`stage_sizes`), and ``task`` imports ``models`` only.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from p2ptrain.models._hf import CausalLM
from p2ptrain.models._registry import (build_model, check_kwargs, lm_piece, MAX_PARAMETERS, meta_model, seeded_call,
                                       TinyLM)

# A pipelined task's whole model: at most this many parameters, each stage at most MAX_PARAMETERS
# (what one member holds; task/_parse.py checks both). Every member initialises every piece once,
# one at a time (InitialPieces: the run's initial model is a manifest of every stage's initial
# file, which each member hashes), so this bounds what a task from the network makes a peer
# compute and hash, never what it holds. Only models built by piece get it (builds_by_piece).
MAX_PIPELINED_PARAMETERS = 400_000_000


class PartitionError(ValueError):
    """A model that cannot be cut as asked (the only error of this module and of ``pipeline.partition``)."""


class Piece(nn.Module):
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

    def state_names(self) -> list[str]:
        """The names this piece's tensors have in the whole model's state dict, in its order."""
        return [f"{prefix}.{name}" for prefix, part in zip(self.prefixes, self.parts, strict=True)
                for name in part.state_dict()]


class _LMEmbed(Piece):
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


class LMBlock(Piece):
    """One TinyLM block; the causal mask is rebuilt from the activation, as TinyLM.forward builds it.
    An activation longer than the model's context is refused before the mask is built: a stage
    replica takes activations from the network, and a t x t mask (and attention) of a t that only
    the frame limits bound would take gigabytes from one frame."""

    def __init__(self, name: str, block: nn.Module, context: int) -> None:
        super().__init__({name: block})
        self.context = context

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        t = h.shape[1]
        if t > self.context:
            raise ValueError(f"activation of {t} positions is longer than the model's context {self.context}")
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=h.device, dtype=h.dtype)
        out: torch.Tensor = self.parts[0](h, src_mask=mask, is_causal=True)
        return out


def pieces_of(model: nn.Module) -> list[Piece]:
    """The model as a sequence of pieces; :class:`PartitionError` for a model that is not one."""
    if isinstance(model, TinyLM):
        blocks = [LMBlock(f"blocks.{i}", b, model.context) for i, b in enumerate(model.blocks)]
        return [_LMEmbed(model), *blocks, Piece({"norm": model.norm, "head": model.head})]
    if isinstance(model, CausalLM):
        from p2ptrain.models._hf_pieces import hf_pieces  # imports this module: on use, not at import

        return hf_pieces(model)
    if isinstance(model, nn.Sequential):
        # _modules, not named_children(): that skips a module's second appearance, and a Sequential
        # that applies one module twice would lose a step of its forward.
        return [Piece({name: child}) for name, child in model._modules.items() if child is not None]
    raise PartitionError(
        f"a {type(model).__name__} cannot be cut into stages: only transformer_lm, hf causal LMs and "
        "nn.Sequential models (a sequence of blocks) can"
    )


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


def _tied_across(pieces: Sequence[Piece], cut: Cut) -> str | None:
    """The name of a parameter reached from two stages, if any."""
    seen: dict[int, int] = {}
    for stage, (a, b) in enumerate(zip(cut.bounds, cut.bounds[1:], strict=False)):
        for piece in pieces[a:b]:
            for prefix, part in zip(piece.prefixes, piece.parts, strict=True):
                for name, p in part.named_parameters(remove_duplicate=False):
                    if seen.setdefault(id(p), stage) != stage:
                        return f"{prefix}.{name}"
    return None


def cut_pieces(model: nn.Module, stages: int) -> tuple[list[Piece], Cut]:
    """``model``'s pieces and their balanced cut into ``stages`` (:func:`balanced_cut`);
    :class:`PartitionError` when the model is no sequence of pieces, has fewer pieces than stages, or
    a weight is tied across two stages (each stage would train its own copy and the tie would
    silently break; inside one stage a tie is fine)."""
    pieces = pieces_of(model)
    sizes = [sum(p.numel() for p in piece.parameters()) for piece in pieces]
    cut = balanced_cut(sizes, stages)
    tied = _tied_across(pieces, cut)
    if tied is not None:
        untie = " (model.config.tie_word_embeddings = false unties an hf model's head)" if isinstance(model, CausalLM) else ""
        raise PartitionError(f"{tied} is tied to a weight of another stage; cut elsewhere or untie it{untie}")
    return pieces, cut


def stage_sizes(name: str, arguments: dict[str, Any], stages: int) -> list[int]:
    """Parameters of each stage of the registry model ``name`` cut into ``stages``, from the model
    built on the meta device (nothing allocated): what a task's parse checks, and the stages' costs
    before any step time is measured. :class:`PartitionError` as :func:`cut_pieces`."""
    return cut_pieces(meta_model(name, arguments), stages)[1].stage_sizes()


def piece_sizes(name: str, arguments: dict[str, Any]) -> list[int]:
    """Parameters of each piece of the registry model ``name``, in order, from the model built on
    the meta device: what a cut by measured time spreads a stage's time over (protocol/_recut.py).
    :class:`PartitionError` for a model that is no sequence of pieces."""
    return [sum(p.numel() for p in piece.parameters()) for piece in pieces_of(meta_model(name, arguments))]


def tied_across(name: str, arguments: dict[str, Any], bounds: Sequence[int]) -> str | None:
    """The name of a parameter of the registry model ``name`` that the cut ``bounds`` (each
    stage's first piece, then the number of pieces) puts in two stages, or None (meta device)."""
    pieces = pieces_of(meta_model(name, arguments))
    return _tied_across(pieces, Cut(tuple(bounds), tuple(0 for _ in pieces)))


def cut_at(pieces: Sequence[Piece], bounds: Sequence[int]) -> Cut:
    """The cut of ``pieces`` at ``bounds`` (each stage's first piece, then the number of pieces:
    a plan's cut by measured time); :class:`PartitionError` for bounds that are no cut of them into
    non-empty contiguous runs, or that put a weight in two stages."""
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != len(pieces) or any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise PartitionError(f"{list(bounds)} is no cut of {len(pieces)} pieces into non-empty stages")
    cut = Cut(tuple(bounds), tuple(sum(p.numel() for p in piece.parameters()) for piece in pieces))
    tied = _tied_across(pieces, cut)
    if tied is not None:
        raise PartitionError(f"{tied} is tied to a weight of another stage of the cut {list(bounds)}")
    return cut


def builds_by_piece(name: str) -> bool:
    """Whether the registry model ``name``'s initial bits are built one piece at a time
    (:class:`InitialPieces`): only then may a pipelined task's model outgrow one member."""
    return name == "transformer_lm"


def whole_model_cap(name: str) -> int:
    """The most parameters a registry model ``name`` may have when one process asked to build it
    whole (a model fetched, loaded, evaluated or served: a pipelined run's model is made one there):
    :data:`MAX_PIPELINED_PARAMETERS` for the models a pipelined task may grow past one member
    (:func:`builds_by_piece`), else :data:`~p2ptrain.models.MAX_PARAMETERS`."""
    return MAX_PIPELINED_PARAMETERS if builds_by_piece(name) else MAX_PARAMETERS


class InitialPieces:
    """A registry model's initial tensors, as ``build_model(name, arguments, seed)`` initialises
    them, piece by piece (under the names they have in the whole model). A ``transformer_lm``'s
    pieces are each constructed alone, from torch's generator where the pieces before it left it
    (``lm_piece``), so only one piece is ever in memory: a pipelined member takes its stage's
    initial bits, and hashes every stage's, without holding the whole model. Any other model is
    built whole and cut (its peak is the whole model's weights)."""

    def __init__(self, name: str, arguments: dict[str, Any], seed: int) -> None:
        self.name, self.seed = name, seed
        self.arguments = check_kwargs(name, arguments)
        self.names = [piece.state_names() for piece in pieces_of(meta_model(name, arguments))]
        # torch's generator before piece i, for each i the pieces drawn so far reached: a later
        # stage is taken without drawing its predecessors again.
        self._states: dict[int, torch.Tensor] = {}

    def tensors(self, first: int, last: int) -> Iterator[dict[str, torch.Tensor]]:
        """Pieces ``first`` to ``last``'s tensors, one piece's at a time, each made when asked for."""
        if not builds_by_piece(self.name):
            state = build_model(self.name, self.arguments, self.seed).state_dict()
            for names in self.names[first : last + 1]:
                yield {name: state[name] for name in names}
            return
        a = self.arguments
        shape = (a["vocab_size"], a["context"], a["width"], a["depth"], a["heads"])
        start = max((i for i in self._states if i <= first), default=0)
        generator: int | torch.Tensor = self._states.get(start, self.seed)
        for index in range(start, last + 1):
            modules, generator = seeded_call(partial(lm_piece, *shape, index), generator)
            self._states[index + 1] = generator
            if index >= first:
                values = [t for module in modules for t in module.state_dict().values()]
                yield dict(zip(self.names[index], values, strict=True))
