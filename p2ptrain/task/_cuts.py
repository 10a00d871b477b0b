"""Where a pipelined task's model is cut: the cut by parameter count every run starts from, the
stages' parameters under any cut of its pieces, and whether a cut is one a plan may name
(docs/pipeline.md, "Re-cutting by measured time"). A cut is its *bounds*: each stage's first piece,
then the number of pieces (``S + 1`` integers from 0). Pure functions of the task, computed on
the meta device and kept for the few models a node runs (the plans check them at every plan)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from p2ptrain.models import balanced_cut, MAX_PARAMETERS, piece_sizes, stage_sizes, tied_across
from p2ptrain.task._spec import Task


@lru_cache(maxsize=16)
def _pieces(name: str, arguments: str) -> tuple[int, ...]:
    return tuple(piece_sizes(name, json.loads(arguments)))


def _arguments(task: Task) -> tuple[str, dict[str, Any]]:
    return task.model.name, task.model.arguments


def piece_parameters(task: Task) -> tuple[int, ...]:
    """Parameters of each piece of a pipelined task's model, in order (on the meta device)."""
    assert task.pipeline is not None, "a task without [pipeline] has no pieces"
    name, arguments = _arguments(task)
    return _pieces(name, json.dumps(arguments, sort_keys=True))


def parameter_cut(task: Task) -> tuple[int, ...]:
    """The bounds of the task's cut by parameter count (``models.balanced_cut``): the cut of every
    plan that names none, and of the run's initial model."""
    assert task.pipeline is not None, "a task without [pipeline] has no cut"
    name, arguments = _arguments(task)
    return _parameter_cut(name, json.dumps(arguments, sort_keys=True), task.pipeline.stages)


@lru_cache(maxsize=16)
def _parameter_cut(name: str, arguments: str, stages: int) -> tuple[int, ...]:
    return balanced_cut(_pieces(name, arguments), stages).bounds  # the search is O(S n^2): once per model


def stage_parameters(task: Task, cut: Sequence[int] | None = None) -> list[int]:
    """Parameters of each of a pipelined task's stages under the cut ``cut`` (its bounds; None:
    the cut by parameter count): the stages' costs in the plans' assignment before any step time
    is measured."""
    assert task.pipeline is not None, "a task without [pipeline] has no stages"
    if cut is None:
        return stage_sizes(task.model.name, task.model.arguments, task.pipeline.stages)
    sizes = piece_parameters(task)
    return [sum(sizes[a:b]) for a, b in zip(cut, cut[1:], strict=False)]


def cut_problem(task: Task, cut: Sequence[int]) -> str | None:
    """Why ``cut`` is not a cut a plan of this pipelined task may name, or None: its stages must be
    the task's ``stages`` non-empty contiguous runs of its pieces, each within the
    ``MAX_PARAMETERS`` one member holds (the parse's rule for the parameter cut), and no weight tied
    across two of them."""
    assert task.pipeline is not None, "a task without [pipeline] has no cut"
    pieces = len(piece_parameters(task))
    if len(cut) != task.pipeline.stages + 1 or cut[0] != 0 or cut[-1] != pieces:
        return f"its cut {list(cut)} is not {task.pipeline.stages} stages of the model's {pieces} pieces"
    if any(b <= a for a, b in zip(cut, cut[1:], strict=False)):
        return f"its cut {list(cut)} leaves a stage without a piece"
    sizes = stage_parameters(task, cut)
    if max(sizes) > MAX_PARAMETERS:
        return f"its cut puts {max(sizes):,} parameters in stage {sizes.index(max(sizes))}, over {MAX_PARAMETERS:,}"
    name, arguments = _arguments(task)
    tied = _tied_across(name, json.dumps(arguments, sort_keys=True), tuple(cut))
    return None if tied is None else f"its cut puts {tied} in two stages"


@lru_cache(maxsize=64)
def _tied_across(name: str, arguments: str, cut: tuple[int, ...]) -> str | None:
    # Builds the model on the meta device: once per cut, not at every plan and manifest checked.
    return tied_across(name, json.loads(arguments), cut)


def cost_cut(task: Task, costs: Sequence[int]) -> tuple[int, ...]:
    """The bounds of the cut of a pipelined task's pieces, each of cost ``costs[i]``, whose
    costliest stage costs least (``models.balanced_cut``, the exact search the parameter cut uses)."""
    assert task.pipeline is not None, "a task without [pipeline] has no cut"
    return balanced_cut(costs, task.pipeline.stages).bounds
