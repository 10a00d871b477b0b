"""What the examples share: their command line (one member of a run) and the digits data.

Every example is one member of a run. Start it on each machine (or several times on one) with the
address of a member that already runs::

    python examples/custom_loop.py --member 0 --members 3 --listen /ip4/0.0.0.0/tcp/4001
    python examples/custom_loop.py --member 1 --members 3 --bootstrap /ip4/10.0.0.1/tcp/4001/p2p/12D3Koo...

(the first prints its address). Each member keeps its own home (identity, store), by default
``~/.p2ptrain/runs/<run>-member<i>``: members started on one machine need one each, so ``--member``
names it as well. ``--member i --members n`` picks this member's part of the digits
data: each machine trains on its own samples, which never leave it. ``n`` is also the run's
``max_peers``: once all ``n`` are alive, its first election and first plan need not wait for more.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from sklearn.datasets import load_digits
from torch import nn

from p2ptrain.base import UserError, command_line_words, default_home


def parse_args(doc: str, steps: int, run: str, extra: Sequence[tuple[str, dict[str, Any]]] = ()) -> argparse.Namespace:
    """The members' options (``run``: the example's run name), and ``extra``: an example's own, as
    ``(flag, add_argument's keywords)``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    for flag, options in extra:
        parser.add_argument(flag, **options)
    parser.add_argument("--home", help="this member's p2ptrain home (default ~/.p2ptrain/runs/<run>-member<i>)")
    parser.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0", help="multiaddr to listen on")
    parser.add_argument("--bootstrap", nargs="*", default=[], help="addresses of members already running")
    parser.add_argument("--member", type=int, default=0, help="this member's part of the data (0-based)")
    parser.add_argument("--members", type=int, default=1, help="parts the data is cut into: the run's members (max_peers)")
    parser.add_argument("--steps", type=int, default=steps, help="the run's length in steps")
    parser.add_argument("--run", default=run, help=f"the run's name (the same on every member; default {run})")
    parser.add_argument("--verbose", action="store_true", help="log what the run does")
    args = parser.parse_args()
    if args.home is None:  # Optimizer's own default is one home per run: a second member here would share it
        args.home = str(default_home() / "runs" / f"{args.run}-member{args.member}")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    return args


def run_member(main: Callable[[], None]) -> None:
    """``main()``, with p2ptrain's one-line errors (a node already running on this ``--home``, a
    bootstrap address with no peer ID, a run that stopped) said as one line on stderr with exit status
    1, as the command line says them: they came as a 15-line traceback ending in that line. An
    argument is named by the example's flag (``--home``, ``--bootstrap``: what the user typed), not
    by the keyword the example passed it on as (``Optimizer(home=...)``)."""
    try:
        main()
    except UserError as exc:
        raise SystemExit(f"{Path(sys.argv[0]).name}: error: {command_line_words(exc)}") from None


def digits(member: int, members: int) -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    """This member's part of the training digits (every members-th sample), and the shared test set."""
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))  # the same split on every machine
    x, y = x[order], y[order]
    train_x, train_y, test_x, test_y = x[:1400], y[:1400], x[1400:], y[1400:]
    mine = slice(member, None, members)
    return (torch.utils.data.TensorDataset(train_x[mine], train_y[mine]),
            torch.utils.data.TensorDataset(test_x, test_y))


def accuracy(model: nn.Module, data: torch.utils.data.TensorDataset) -> float:
    x, y = data.tensors
    model.eval()
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def weights_digest(model: nn.Module) -> str:
    """A digest of every tensor of the state dict, to compare members by."""
    weights = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        weights.update(name.encode() + tensor.detach().cpu().contiguous().numpy().tobytes())
    return weights.hexdigest()


def report(model: nn.Module, data: torch.utils.data.TensorDataset, **fields: object) -> None:
    """One JSON line: what the run ended with here, and digests to compare members by."""
    x, _ = data.tensors
    model.eval()
    with torch.no_grad():
        predictions = hashlib.sha256(model(x).argmax(1).numpy().tobytes()).hexdigest()
    print(json.dumps({**fields, "accuracy": accuracy(model, data), "weights": weights_digest(model),
                      "predictions": predictions}), flush=True)
