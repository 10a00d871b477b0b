"""The federated shape: your ``SimpleNN`` on each machine's own data, in one call.

``p2ptrain.train`` runs the loop (with a progress bar on a terminal) until the run's last step and
returns the run's last confirmed model CID with the final metrics on ``test_data``. Each member's
samples stay on its machine; only sparse gradients (or, with ``--mode local_sgd``, quantized
pseudo-gradients) cross the network.

    python examples/federated.py --member 0 --members 3 --listen /ip4/127.0.0.1/tcp/4001
    python examples/federated.py --member 1 --members 3 --bootstrap /ip4/127.0.0.1/tcp/4001/p2p/<its id>

(the first says its address, with its peer ID, on stderr).
"""

from __future__ import annotations

import sys

import torch
from _common import digits, parse_args, report, run_member
from torch import nn

import p2ptrain


class SimpleNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def main() -> None:
    local_sgd = "--local-sgd" in sys.argv
    if local_sgd:
        sys.argv.remove("--local-sgd")
    args = parse_args(__doc__, steps=120, run="digits-federated")
    train_data, test_data = digits(args.member, args.members)
    torch.manual_seed(args.member)
    model = SimpleNN()
    # Local-SGD here is federated averaging: 4 local steps, then the members' mean model (every
    # coordinate of the pseudo-gradient); sync mode sends the top 10% of each gradient.
    mode = ({"mode": "local_sgd", "inner_steps": 4, "outer_optimizer": "average", "density": 1.0}
            if local_sgd else {"density": 0.1})
    result = p2ptrain.train(model, train_data, test_data=test_data, steps=args.steps, batch_size=32,
                            optimizer=lambda params: torch.optim.Adam(params, lr=1e-2, fused=True),
                            run=args.run, home=args.home, listen=[args.listen],
                            bootstrap=args.bootstrap, min_peers=min(2, args.members), max_peers=args.members,
                            checkpoint_every=10 if local_sgd else 40, seed=args.member, **mode)
    report(model, test_data, member=args.member, model_cid=result.model_cid, run_cid=result.run_cid,
           steps=result.steps, metrics=result.metrics)


if __name__ == "__main__":
    run_member(main)
