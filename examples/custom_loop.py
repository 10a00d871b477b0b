"""Your own model, your own loop: a small CNN with BatchNorm on digits, trained across peers.

The loop is the usual PyTorch one; ``p2ptrain.Optimizer`` wraps the optimizer, and each
``opt.step()`` is one step of the run, the same on every member (their weights stay bitwise equal).
BatchNorm's running statistics are each member's own between checkpoints and averaged at each one.
Run one copy per member (see examples/_common.py)::

    python examples/custom_loop.py --member 0 --members 2 --listen /ip4/127.0.0.1/tcp/4001
    python examples/custom_loop.py --member 1 --members 2 --bootstrap /ip4/127.0.0.1/tcp/4001/p2p/<its id>
"""

from __future__ import annotations

import torch
from _common import accuracy, digits, parse_args, report, run_member
from torch import nn

import p2ptrain


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x.view(-1, 1, 8, 8)).flatten(1))


def main() -> None:
    args = parse_args(__doc__, steps=100, run="digits-cnn")
    train_data, test_data = digits(args.member, args.members)
    torch.manual_seed(args.member)
    model = SmallCNN()
    loader = torch.utils.data.DataLoader(train_data, batch_size=32, shuffle=True, drop_last=True)
    opt = p2ptrain.Optimizer(torch.optim.Adam(model.parameters(), lr=3e-3, fused=True), model=model,
                             run=args.run, home=args.home, listen=[args.listen],
                             bootstrap=args.bootstrap, density=0.1, checkpoint_every=25,
                             min_peers=min(2, args.members), max_peers=args.members, total_steps=args.steps,
                             evaluate=lambda m: {"accuracy": accuracy(m, test_data)})
    print(f"member {args.member} of run {opt.run_cid} at {opt.addresses[0]}", flush=True)
    with opt:
        try:
            while True:  # epochs, until the run's last step
                model.train()
                for x, y in loader:
                    opt.zero_grad()
                    loss = nn.functional.cross_entropy(model(x), y)
                    loss.backward()
                    opt.step(loss=loss)
        except p2ptrain.RunFinished:
            pass
        report(model, test_data, member=args.member, model_cid=opt.model_cid, run_cid=opt.run_cid,
               steps=opt.step_count)


if __name__ == "__main__":
    run_member(main)
