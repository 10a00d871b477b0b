"""What a run of the user's own model is: an architecture card, stored by CID, that names every tensor.

No code crosses the network (README, "Ground rules"): every member runs the same script and builds
its own ``nn.Module``. What the members must agree on travels instead, as data: the name, shape and
dtype of every parameter and buffer, the optimizer's class and hyperparameters, and the run's mode
and compression options. :func:`card_of` writes that down as canonical JSON; its CID (the
*fingerprint*) goes into the run's task, so a task CID names one architecture exactly.

A member whose model or options differ is refused when it joins, with one line naming the first
tensor or option that differs (:func:`first_difference`): a different width of one layer, another
learning rate, a missing buffer. Comparing two cards needs no code from the other side.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from p2ptrain.base import boundedjson

# The card of a large model lists every tensor (~80 B each): 16 MiB is 200,000 tensors, far past any
# model a member can hold, and a card is read (bounded) before anything is built from it.
MAX_CARD_BYTES = 16 * 1024 * 1024
# Every tensor, and the optimizer's hyperparameters, are at most this deep in the card.
MAX_CARD_DEPTH = 8
CARD_SCHEMA = "p2ptrain.architecture/1"
# Hyperparameter values a card keeps: numbers, booleans, strings, None and flat lists of them (betas).
_SCALARS = (bool, int, float, str, type(None))


class CardError(ValueError):
    """An architecture card that cannot be read, or a model or optimizer that cannot be described."""


def tensors_of(module: nn.Module) -> list[list[Any]]:
    """``[name, shape, dtype, kind]`` for every parameter and buffer of ``module``, in state-dict
    order (``kind``: ``"param"`` or ``"buffer"``; a non-persistent buffer is not in the state dict
    and so not in the card)."""
    params = {name for name, _ in module.named_parameters()}
    out = []
    for name, tensor in module.state_dict().items():
        out.append([name, list(tensor.shape), str(tensor.dtype).removeprefix("torch."),
                    "param" if name in params else "buffer"])
    return out


def optimizer_of(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's class and, per parameter group, its hyperparameters and group size."""
    cls = type(optimizer)
    groups = []
    for group in optimizer.param_groups:
        hyper: dict[str, Any] = {}
        for key, value in sorted(group.items()):
            if key == "params":
                continue
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if isinstance(value, (tuple, list)) and all(isinstance(v, _SCALARS) for v in value):
                value = list(value)
            elif not isinstance(value, _SCALARS):
                raise CardError(f"optimizer hyperparameter {key!r} is a {type(value).__name__}: a run's options "
                                "must be numbers, booleans, strings or lists of them")
            hyper[key] = value
        groups.append({"params": len(group["params"]), **hyper})
    return {"class": f"{cls.__module__}.{cls.__qualname__}", "groups": groups}


def card_of(module: nn.Module, optimizer: torch.optim.Optimizer, options: Mapping[str, Any]) -> dict[str, Any]:
    """The architecture card of a run of ``module`` trained with ``optimizer`` under ``options``
    (the run's mode, compression, buffers rule: what every member must pass the same)."""
    if not any(True for _ in module.parameters()):
        raise CardError("the model has no parameters: there is nothing to train")
    state = module.state_dict()
    first: dict[int, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first and name in state:
            raise CardError(f"parameters {first[id(param)]} and {name} are one tensor (tied), which a model file stores "
                            "once: wrap a transformers model in p2ptrain.models.CausalLM (it keeps the tie)")
        first.setdefault(id(param), name)
    owned = {id(p) for p in module.parameters()}
    given = [p for group in optimizer.param_groups for p in group["params"]]
    strangers = [p for p in given if id(p) not in owned]
    if strangers:
        raise CardError(f"the optimizer holds {len(strangers)} tensor(s) that are not the model's parameters")
    if len(given) != len(owned):
        raise CardError(f"the optimizer holds {len(given)} of the model's {len(owned)} parameters: "
                        "give it model.parameters()")
    card = {
        "schema": CARD_SCHEMA,
        "module": f"{type(module).__module__}.{type(module).__qualname__}",
        "tensors": tensors_of(module),
        "optimizer": optimizer_of(optimizer),
        "options": dict(sorted(options.items())),
    }
    card_bytes(card)  # every value canonical JSON can hold (finite numbers), or CardError
    return card


def card_bytes(card: Mapping[str, Any]) -> bytes:
    """Canonical JSON of a card: the bytes its CID names."""
    try:
        return boundedjson.canonical(dict(card))
    except ValueError as exc:  # NaN or infinity in a hyperparameter
        raise CardError(f"the run's options cannot be written down: {exc}") from None


def card_from_bytes(data: bytes) -> dict[str, Any]:
    """A card fetched by CID, bounded and checked for its shape; :class:`CardError` otherwise."""
    if len(data) > MAX_CARD_BYTES:
        raise CardError(f"architecture card of {len(data)} B is over the {MAX_CARD_BYTES} B limit")
    try:
        card = boundedjson.loads(data, max_depth=MAX_CARD_DEPTH, what="architecture card")
    except boundedjson.JSONBoundsError as exc:
        raise CardError(str(exc)) from None
    if not isinstance(card, dict) or card.get("schema") != CARD_SCHEMA:
        raise CardError(f"not an architecture card (schema {CARD_SCHEMA})")
    tensors, optimizer, options = card.get("tensors"), card.get("optimizer"), card.get("options")
    if not isinstance(tensors, list) or not isinstance(optimizer, dict) or not isinstance(options, dict):
        raise CardError("an architecture card has tensors, an optimizer and options")
    for entry in tensors:
        if not (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str)
                and isinstance(entry[1], list) and all(isinstance(d, int) and d >= 0 for d in entry[1])
                and isinstance(entry[2], str) and entry[3] in ("param", "buffer")):
            raise CardError(f"architecture card: a tensor entry is not [name, shape, dtype, kind]: {str(entry)[:80]}")
    if card_bytes(card) != data:
        raise CardError("architecture card: bytes are not in canonical form")
    return card


def first_difference(theirs: Mapping[str, Any], mine: Mapping[str, Any]) -> str | None:
    """The first way ``mine`` (this member's card) differs from ``theirs`` (the run's), as one line
    that names the tensor or option; None when they describe the same run."""
    run_tensors = {t[0]: t for t in theirs["tensors"]}
    my_tensors = {t[0]: t for t in mine["tensors"]}
    for name, entry in run_tensors.items():
        other = my_tensors.get(name)
        if other is None:
            return f"the run's model has {entry[3]} {name} {tuple(entry[1])}, this model has none"
        if other[1:] != entry[1:]:
            return (f"{entry[3]} {name}: the run's is {tuple(entry[1])} {entry[2]}, "
                    f"this model's is {tuple(other[1])} {other[2]}")
    extra = [name for name in my_tensors if name not in run_tensors]
    if extra:
        return f"this model has {my_tensors[extra[0]][3]} {extra[0]}, the run's model has none"
    if [t[0] for t in theirs["tensors"]] != [t[0] for t in mine["tensors"]]:
        return "the model's tensors come in another order than the run's"
    run_opt, my_opt = theirs["optimizer"], mine["optimizer"]
    if run_opt.get("class") != my_opt.get("class"):
        return f"optimizer: the run's is {run_opt.get('class')}, this one is {my_opt.get('class')}"
    run_groups, my_groups = run_opt.get("groups", []), my_opt.get("groups", [])
    if len(run_groups) != len(my_groups):
        return f"optimizer: the run's has {len(run_groups)} parameter groups, this one {len(my_groups)}"
    for i, (a, b) in enumerate(zip(run_groups, my_groups)):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return f"optimizer group {i} {key}: the run's is {a.get(key)!r}, this one's is {b.get(key)!r}"
    for key in sorted(set(theirs["options"]) | set(mine["options"])):
        if theirs["options"].get(key) != mine["options"].get(key):
            return f"option {key}: the run's is {theirs['options'].get(key)!r}, this one's is {mine['options'].get(key)!r}"
    if theirs.get("module") != mine.get("module"):
        return f"the run's model is a {theirs.get('module')}, this one a {mine.get('module')}"
    return None
