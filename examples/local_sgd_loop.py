"""Local-SGD from your own loop: each ``opt.step()`` is an inner step on this member alone; every
``inner_steps``-th one averages the members' pseudo-gradients (their top 25%, int8 on the wire) and
takes one outer step, the same on every member. Fewer, larger exchanges: for slow links.

    python examples/local_sgd_loop.py --member 0 --members 2 --listen /ip4/127.0.0.1/tcp/4001
    python examples/local_sgd_loop.py --member 1 --members 2 --bootstrap /ip4/127.0.0.1/tcp/4001/p2p/<its id>
"""

from __future__ import annotations

import torch
from _common import digits, parse_args, report, run_member
from torch import nn

import p2ptrain

INNER_STEPS = 8


def main() -> None:
    args = parse_args(__doc__, steps=20, run="digits-local-sgd")  # outer steps: 20 x 8 batches
    train_data, test_data = digits(args.member, args.members)
    torch.manual_seed(args.member)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    loader = torch.utils.data.DataLoader(train_data, batch_size=32, shuffle=True, drop_last=True)
    opt = p2ptrain.Optimizer(torch.optim.Adam(model.parameters(), lr=1e-2, fused=True), model=model,
                             run=args.run, home=args.home, listen=[args.listen],
                             bootstrap=args.bootstrap, mode="local_sgd", inner_steps=INNER_STEPS,
                             density=0.25, quantize="int8", checkpoint_every=5, min_peers=min(2, args.members),
                             max_peers=args.members, total_steps=args.steps)
    with opt:
        try:
            while True:
                for x, y in loader:
                    opt.zero_grad()
                    nn.functional.cross_entropy(model(x), y).backward()
                    opt.step()
        except p2ptrain.RunFinished:
            pass
        report(model, test_data, member=args.member, model_cid=opt.model_cid, run_cid=opt.run_cid,
               steps=opt.step_count)


if __name__ == "__main__":
    run_member(main)
