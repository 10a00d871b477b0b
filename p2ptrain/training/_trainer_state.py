"""A trainer's state outside the step: a snapshot of it, and the optimizer's state as named tensors.

An optimizer file (what a late joiner resumes from, by CID) holds the step counter as
``trainer.step`` and each per-parameter tensor as ``state.<param index>.<key>``: names, not
pickles, so a file from a peer is read by checking every name, key and shape against the model
and the optimizer this member built itself (:func:`optimizer_state`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from p2ptrain.protocol import RecordError, state_bytes, tensors_bytes

# A parameter index in an optimizer file's tensor names: up to 9 ASCII digits (a model of more than
# 10**9 parameter tensors does not exist; a longer run of digits only costs int() time).
_INDEX = re.compile(r"[0-9]{1,9}")
# The per-parameter state keys of the registry's optimizers (what their files may name).
OPTIMIZER_STATE_KEYS = {"sgd": {"momentum_buffer"}, "adam": {"step", "exp_avg", "exp_avg_sq"},
                        "adamw": {"step", "exp_avg", "exp_avg_sq"}}


@dataclass(frozen=True)
class StateSnapshot:
    """A member's state at one step, as tensor copies (:meth:`Trainer.snapshot`)."""

    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    card: dict[str, Any]
    module: nn.Module  # the architecture on the meta device, for :meth:`Trainer.evaluate_snapshot`

    def model_bytes(self) -> bytes:
        """What :meth:`Trainer.model_bytes` gave at :attr:`step`."""
        return state_bytes(self.model, self.card)

    def optimizer_bytes(self) -> bytes:
        """What :meth:`Trainer.optimizer_bytes` gave at :attr:`step`."""
        return tensors_bytes(self.optimizer)


def optimizer_tensors(
    optimizer: torch.optim.Optimizer, step: int, copy: Callable[[str, torch.Tensor], torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """``optimizer``'s state as named tensors (``state.<param index>.<key>``) plus ``step`` as
    ``trainer.step``, each a copy (``copy(name, tensor)`` makes it; default a fresh CPU clone)."""
    out = {"trainer.step": torch.tensor(step, dtype=torch.int64)}
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                name = f"state.{index}.{key}"
                out[name] = copy(name, value) if copy else value.detach().cpu().clone()
    return out


def state_name(name: str, params: int, key_ok: Callable[[str], bool]) -> tuple[int, str]:
    """The (parameter index, key) that an optimizer file's tensor ``name`` names, for a model of
    ``params`` parameters and keys that ``key_ok`` accepts; anything else is a :class:`RecordError`."""
    parts = name.split(".")
    # ASCII digits only: str.isdigit() also accepts '²', on which int() raises ValueError.
    if len(parts) != 3 or parts[0] != "state" or not _INDEX.fullmatch(parts[1]) or not key_ok(parts[2]):
        raise RecordError(f"optimizer file has unexpected tensor {name!r}")
    index = int(parts[1])
    if index >= params:
        raise RecordError(f"optimizer file names parameter {index}, the model has {params}")
    return index, parts[2]


def optimizer_state(
    optim_t: Mapping[str, torch.Tensor], params: Sequence[nn.Parameter], allowed: Collection[str]
) -> dict[int, dict[str, torch.Tensor]]:
    """The ``state`` of an optimizer's state dict from an optimizer file's tensors (``trainer.step``
    left out): each key one of ``allowed``, each tensor but ``step`` its parameter's shape."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in sorted(optim_t.items()):  # sorted: the first problem named is the same everywhere
        if name == "trainer.step":
            continue
        index, key = state_name(name, len(params), allowed.__contains__)
        if key != "step" and tensor.shape != params[index].shape:
            raise RecordError(f"optimizer tensor {name} has shape {tuple(tensor.shape)}, "
                              f"parameter has {tuple(params[index].shape)}")
        state.setdefault(index, {})[key] = tensor
    return state
