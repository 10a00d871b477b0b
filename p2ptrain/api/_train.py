"""``p2ptrain.train(model, train_data, ...)``: the one-call form of :class:`~p2ptrain.api.Optimizer`.

::

    result = p2ptrain.train(SimpleNN(), my_dataset, test_data=my_test_set, steps=500, batch_size=32,
                            run="digits", bootstrap=[...])
    result.model_cid, result.metrics

Each machine passes its own ``train_data`` (the federated case: a ``torch.utils.data.Dataset`` of
``(input, target)`` pairs that never leaves the machine), or the same
:class:`~p2ptrain.data.IPFSDataset` by CID (shared data): then each member reads the shards
of its position among the run's first members (shard ``i`` to position ``i % members``; with fewer
shards than members, positions share shards), so the members cover the data between them.

The loop is the one anyone writes (``zero_grad``, the loss's ``backward``, ``step``) until the run's
last step, with a progress bar on a terminal. ``steps`` is the run's length in batches; ``epochs``
counts it from this member's data (members must agree on the length: it is part of the run's
card, and a member that counts another is refused naming ``total_steps``; give ``steps`` when the
members' datasets differ in size). In local-SGD mode a run step is ``inner_steps`` batches.
Batches go to the device of the model's parameters (a model on a GPU trains there from a dataset
on the CPU, as the run's own tasks do).
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from p2ptrain.api._arguments import check_dataset, check_model
from p2ptrain.api._optimizer import Optimizer, RunFinished
from p2ptrain.training import evaluate_batches, module_device

__all__ = ["TrainResult", "train"]

log = logging.getLogger(__name__)

# A shared dataset is sharded by position among the first span's members, which forms once
# min_peers members are there: waited for this long, then this member reads every shard.
MEMBERS_WAIT_S = 300.0

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TrainResult:
    """What a :func:`train` call ends with: the run's last confirmed model and this member's view."""

    model_cid: str | None  # the latest confirmed (signed, attested) model of the run
    run_cid: str  # the run's task CID: `p2ptrain task status`, `model fetch --latest` take it
    steps: int  # run steps this member held at the end
    metrics: dict[str, float] = field(default_factory=dict)  # test_data's loss/accuracy with the final weights
    peers: tuple[str, ...] = ()  # the members of the last span


def train(
    model: nn.Module,
    train_data: Dataset[Any],
    *,
    test_data: Dataset[Any] | None = None,
    optimizer: torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer] | None = None,
    loss: Loss | None = None,
    steps: int | None = None,
    epochs: int | None = None,
    batch_size: int = 32,
    run: str,
    progress: bool | None = None,
    seed: int = 0,
    **options: Any,
) -> TrainResult:
    """Train ``model`` across the peers of run ``run`` until its last step; see the module.

    ``optimizer``: a ``torch.optim.Optimizer`` over ``model``'s parameters or a function of the
    parameters making one (default Adam, lr 1e-3, fused). ``loss(output, target)``: default cross-entropy.
    ``progress``: a bar on stderr (default: when stderr is a terminal); one line on stderr says
    first where this member listens (what the others pass as ``bootstrap``). ``seed``: this member's
    shuffling. Every other keyword goes to :class:`~p2ptrain.api.Optimizer`
    (``bootstrap``, ``home``, ``mode``, ``inner_steps``, ``density``, ``checkpoint_every``,
    ``min_peers``, ...).
    """
    if (steps is None) == (epochs is None):
        raise ValueError("give steps or epochs (one of them)")
    check_model(model)
    check_dataset("train_data", train_data)
    if test_data is not None:
        check_dataset("test_data", test_data)
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, not {batch_size}")
    shared = _is_shared(train_data)
    loader = _loader(train_data, batch_size, seed)
    if steps is None:
        assert epochs is not None
        if shared or isinstance(train_data, IterableDataset):
            raise ValueError("epochs needs a dataset with a length; give steps for a shared or streamed dataset")
        steps = epochs * len(loader)
    if steps < 1:
        raise ValueError(f"the run needs at least one step (steps={steps}; is train_data empty?)")
    inner = options.get("inner_steps") if options.get("mode") == "local_sgd" else None
    total = math.ceil(steps / inner) if inner else steps
    loss_fn: Loss = loss or nn.functional.cross_entropy
    inner_opt = _optimizer(optimizer, model)
    device = module_device(model)
    evaluate = _evaluator(test_data, batch_size, device) if test_data is not None else None
    with Optimizer(inner_opt, model=model, run=run, total_steps=total, evaluate=evaluate, **options) as opt:
        # What the other members need to join (as `node start` says where it listens): without it a
        # user starting the first member has no address with a peer ID to pass as bootstrap.
        print(f"p2ptrain: member of run {run!r} ({opt.run_cid}) at {' '.join(opt.addresses)}", file=sys.stderr,
              flush=True)
        if shared:
            _shard(train_data, opt)
            loader = _loader(train_data, batch_size, seed)
        bar = _bar(progress, total, run)
        try:
            model.train()
            for x, y in _batches(loader):
                x, y = _to(x, device), _to(y, device)
                opt.zero_grad()
                value = loss_fn(model(x), y)
                value.backward()  # type: ignore[no-untyped-call]
                try:
                    opt.step(loss=value)
                except RunFinished:
                    break
                if bar is not None:
                    bar.n = opt.step_count
                    bar.set_postfix(loss=f"{float(value):.4f}", peers=len(opt.peers), refresh=False)
                    bar.refresh()
        finally:
            if bar is not None:
                bar.close()
        status = opt.status()
        metrics = evaluate(model) if evaluate is not None else {}
        return TrainResult(model_cid=opt.model_cid, run_cid=opt.run_cid, steps=status.step, metrics=metrics,
                           peers=status.members)


def _optimizer(optimizer: torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer] | None,
               model: nn.Module) -> torch.optim.Optimizer:
    if optimizer is None:
        # fused: torch's default Adam kernel is up to 2x slower on the zeros a sparse average leaves
        # (the Optimizer warns of it; a default the user did not choose must not earn that warning).
        return torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    made = optimizer(model.parameters())
    if not isinstance(made, torch.optim.Optimizer):
        raise TypeError(f"optimizer= made a {type(made).__name__}, not a torch.optim.Optimizer")
    return made


def _is_shared(data: Dataset[Any]) -> bool:
    from p2ptrain.data import IPFSDataset

    return isinstance(data, IPFSDataset)


def _loader(data: Dataset[Any], batch_size: int, seed: int) -> DataLoader[Any]:
    if isinstance(data, IterableDataset):
        return DataLoader(data, batch_size=batch_size, drop_last=True)
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(data, batch_size=batch_size, shuffle=True, drop_last=len(data) >= batch_size,  # type: ignore[arg-type]
                      generator=generator)


def _batches(loader: DataLoader[Any]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The loader's batches, epoch after epoch (the run decides when to stop)."""
    epoch = 0
    while True:
        dataset = loader.dataset
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(epoch)
        empty = True
        for x, y in loader:
            empty = False
            yield x, y
        if empty:
            raise ValueError("train_data holds no batch (fewer samples than one?)")
        epoch += 1


def _shard(data: Any, opt: Optimizer) -> None:
    """An IPFSDataset shared by the run: this member's shards, by its position among the members of
    the run's first span (waited for, up to MEMBERS_WAIT_S: before it, a member knows only itself)."""
    deadline = time.monotonic() + MEMBERS_WAIT_S
    while not opt.peers and time.monotonic() < deadline:
        time.sleep(0.2)
    members = sorted(opt.peers) or [opt.peer_id]
    position = members.index(opt.peer_id) if opt.peer_id in members else 0
    count = data.shard_count
    world = len(members)
    if count >= world:
        data.select(rank=position, world_size=world)
    else:  # fewer shards than members: positions share them rather than one reading nothing
        data.select(rank=position % count, world_size=count)
    log.info("run %r: this member reads shards %s of %d (position %d of %d)", opt.run, data.shard_ids, count,
             position, world)


def _to(value: Any, device: torch.device) -> Any:
    """A batch's tensor on ``device``; anything else (a dict of the user's) as it is."""
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _evaluator(test_data: Dataset[Any], batch_size: int,
               device: torch.device) -> Callable[[nn.Module], dict[str, float]]:
    loader = DataLoader(test_data, batch_size=max(batch_size, 256))

    def evaluate(model: nn.Module) -> dict[str, float]:
        with torch.no_grad():
            metrics = evaluate_batches(model, loader, device)
        return {"accuracy": metrics.accuracy, "loss": metrics.loss}

    return evaluate


def _bar(progress: bool | None, total: int, run: str) -> Any:
    if not (sys.stderr.isatty() if progress is None else progress):
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=f"run {run}", unit="step", file=sys.stderr, dynamic_ncols=True)
