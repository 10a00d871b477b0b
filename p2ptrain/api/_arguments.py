"""Checks of what a script passes the Python API that the layers below cannot tell apart.

A list of addresses given as one string (``bootstrap="/ip4/…/p2p/…"``) is a sequence of its
characters: each one reached the node as an address, and the script read "node setting bootstrap
lists 80 addresses; at most 64", or "'/' is not a multiaddr", about a list it never wrote. And what
a first script gets wrong (``model=model.state_dict()``, a DataLoader or a tensor as ``train_data``,
an empty one) raised from deep inside torch (``'DataLoader' object is not subscriptable``,
``num_samples should be a positive integer value``) once a node had started: each is one line here,
at the call, saying what to pass instead.
"""

from __future__ import annotations

from collections.abc import Sequence, Sized
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset


def address_list(keyword: str, value: Sequence[str]) -> list[str]:
    """``value`` (the addresses given as ``keyword=``) as a list; a TypeError for one string."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{keyword}= takes a list of addresses, not one string: {keyword}=[{value!r}]")
    return list(value)


def check_inputs(optimizer: object, model: object, run: object) -> None:
    """``p2ptrain.Optimizer``'s own arguments: a TypeError naming the one of the wrong kind."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"p2ptrain.Optimizer wraps a torch.optim.Optimizer, not a {type(optimizer).__name__}")
    check_model(model)
    if not isinstance(run, str):
        raise TypeError(f"run= takes the run's name, a string (the same on every member), not {run!r}")


def check_model(model: object) -> None:
    """A TypeError unless ``model`` is an ``nn.Module`` (a state dict or a function is not)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model= takes your torch.nn.Module (the one whose parameters the optimizer holds), "
                        f"not a {type(model).__name__}")


def check_dataset(keyword: str, data: object) -> None:
    """A TypeError unless ``data`` is a Dataset of ``(features, label)`` (or a list of such pairs),
    saying how to make one of what was given; a ValueError when it is empty."""
    hint = None
    if isinstance(data, DataLoader):
        hint = f"pass {keyword}=loader.dataset (train batches it itself, by batch_size=)"
    elif isinstance(data, (str, Path)):
        hint = "a file is read by `p2ptrain dataset add PATH`, then p2ptrain.IPFSDataset(MANIFEST_CID)"
    elif isinstance(data, torch.Tensor) or type(data).__module__ == "numpy" or isinstance(data, tuple):
        hint = "pair features with labels: torch.utils.data.TensorDataset(torch.as_tensor(x), torch.as_tensor(y))"
    elif not isinstance(data, (Dataset, list)):
        hint = "a torch.utils.data.Dataset of (features, label), e.g. TensorDataset(x, y)"
    if hint is not None:
        raise TypeError(f"{keyword}= takes a torch Dataset of (features, label), not a {type(data).__name__}: {hint}")
    if not isinstance(data, IterableDataset) and isinstance(data, Sized) and len(data) == 0:
        raise ValueError(f"{keyword}= is empty: it has no (features, label) to train or test on")
