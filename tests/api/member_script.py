"""One member of a run of a module defined here (not in p2ptrain's registry), from its own loop:
what tests/api/test_user_runs.py starts as separate processes. Prints one JSON line at the end.

``--scale S`` makes a hostile member: it multiplies its gradients by S before each step.
``--slow-below N`` makes a slow member while the run's span has fewer than N members: it rests
``SLOW_STEP_S`` after each step (as a member busy with its data would), so that a run of a few hundred
steps is still under way when a late joiner gets in, however loaded the machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import time

import torch
from sklearn.datasets import load_digits
from torch import nn

import p2ptrain

SLOW_STEP_S = 0.5


class DigitsNet(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, width), nn.BatchNorm1d(width), nn.ReLU())
        self.out = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(x))


def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))  # the same split everywhere
    x, y = x[order], y[order]
    return x[:1400], y[:1400], x[1400:], y[1400:]


def digest(model: nn.Module, x: torch.Tensor) -> tuple[str, str]:
    weights = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        weights.update(name.encode() + tensor.detach().contiguous().numpy().tobytes())
    model.eval()
    with torch.no_grad():
        predictions = hashlib.sha256(model(x).argmax(1).numpy().tobytes()).hexdigest()
    return weights.hexdigest(), predictions


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--home", "--listen"):
        parser.add_argument(flag)
    parser.add_argument("--bootstrap", nargs="*", default=[])
    parser.add_argument("--member", type=int, default=0)
    parser.add_argument("--members", type=int, default=1)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--checkpoint-every", type=int, default=25)
    parser.add_argument("--robust", default="none")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--load", help="only load this model CID from --home into a fresh instance and report")
    parser.add_argument("--wait-for", help="a late joiner: start taking part once this file exists")
    parser.add_argument("--slow-below", type=int, default=0, help="rest after each step while the span has fewer members")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("libp2p", "p2ptrain.mesh", "p2ptrain.net", "p2ptrain.ipfs"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    train_x, train_y, test_x, test_y = digits()
    torch.manual_seed(args.member)
    model = DigitsNet()
    if args.load:
        p2ptrain.load_state(model, args.load, home=args.home)
        weights, predictions = digest(model, test_x)
        print(json.dumps({"weights": weights, "predictions": predictions}), flush=True)
        return
    # p2ptrain imports its API lazily: the Optimizer's imports (libp2p, the services) are done before
    # the wait, so that a late joiner joins the moment it is told.
    optimizer_class = p2ptrain.Optimizer
    while args.wait_for and not os.path.exists(args.wait_for):
        time.sleep(0.1)
    mine = slice(args.member, None, args.members)
    data = torch.utils.data.TensorDataset(train_x[mine], train_y[mine])
    loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True, drop_last=True)
    opt = optimizer_class(torch.optim.Adam(model.parameters(), lr=3e-3, fused=True), model=model, run="test-digits",
                             home=args.home, listen=[args.listen], bootstrap=args.bootstrap, density=0.1,
                             robust=args.robust, checkpoint_every=args.checkpoint_every, min_peers=2,
                             total_steps=args.steps)
    print(json.dumps({"started": args.member, "run_cid": opt.run_cid}), flush=True)
    with opt:
        try:
            while True:
                model.train()
                for x, y in loader:
                    opt.zero_grad()
                    nn.functional.cross_entropy(model(x), y).backward()
                    if args.scale != 1.0:
                        for p in model.parameters():
                            assert p.grad is not None
                            p.grad.mul_(args.scale)
                    opt.step()
                    if args.slow_below and len(opt.peers) < args.slow_below:
                        time.sleep(SLOW_STEP_S)
        except p2ptrain.RunFinished:
            pass
        model.eval()
        with torch.no_grad():
            accuracy = float((model(test_x).argmax(1) == test_y).float().mean())
        weights, predictions = digest(model, test_x)
        print(json.dumps({"member": args.member, "model_cid": opt.model_cid, "run_cid": opt.run_cid,
                          "steps": opt.step_count, "peers": list(opt.peers), "accuracy": accuracy, "weights": weights,
                          "predictions": predictions}), flush=True)


if __name__ == "__main__":
    main()
