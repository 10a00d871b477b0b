"""Local-SGD's outer optimizer with sparse, quantized pseudo-gradients, in one process (no network).

Four ``LocalSGDTrainer`` members on scikit-learn digits (an MLP 64-hidden-10, Adam inside), their
pseudo-gradients averaged the way the network does it (error feedback per member; slice m of the
vector chosen by member (m + round) mod P from its own accumulated vector; each member's values
quantized and dequantized with ``wire.quantized``), then the outer step. It answers which outer
optimizer to use with sparse values in seconds instead of a cluster run (docs/training.md, "Which
outer optimizer"); bytes and times come from bench/train.py --local-sgd.

    .venv/bin/python bench/local_sgd_offline.py H,ROUNDS,DENSITY,VALUES,OUTER,LR [...]
    e.g. 20,24,1,fp32,nesterov,0.003 20,24,0.1,2bit,nesterov,0.003 20,24,0.1,2bit,average,0.003
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from p2ptrain.collective import ErrorFeedback
from p2ptrain.data import load_source
from p2ptrain.training import new_trainer
from p2ptrain.task import load_task
from p2ptrain.wire.quantization import KINDS, roundtrip

WORLD, BATCH, HIDDEN = 4, 16, 32


def run(inner: int, rounds: int, density: float, values: str, outer: str, lr: float) -> tuple[float, float]:
    """Test accuracy and loss of member 0 after ``rounds`` outer steps."""
    _, x, y = load_source("sklearn:digits")
    x = (x / 16).astype(np.float32)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    n_test = len(x) // 5
    test = [(torch.tensor(x[:n_test]), torch.tensor(y[:n_test]))]
    x, y = x[n_test:], y[n_test:]
    outer_table = f'[outer]\noptimizer = "{outer}"\n'
    task = load_task(f"""name = "offline"\n[model]\nname = "mlp"
kwargs = {{ in_features = 64, hidden = [{HIDDEN}], out_features = 10 }}
[dataset]\nmanifest = "bafkreigh2akiscaildcqabsyg3dfr6chu3fgpregiymsck7e7aqa4s52zy"
[optimizer]\nname = "adam"\nlr = {lr}
[training]\nbatch_size = {BATCH}\nmode = "local_sgd"\ninner_steps = {inner}\ntotal_steps = {rounds}\n{outer_table}""")
    members = [new_trainer(task, device="cpu") for _ in range(WORLD)]

    def shard(rank: int):
        xs, ys = x[rank::WORLD], y[rank::WORLD]
        rng = np.random.default_rng(rank)
        while True:
            p = rng.permutation(len(xs))
            for i in range(0, len(p) - BATCH + 1, BATCH):
                yield torch.tensor(xs[p[i:i + BATCH]]), torch.tensor(ys[p[i:i + BATCH]])

    data = [shard(r) for r in range(WORLD)]
    n = members[0].num_parameters
    feedback = [ErrorFeedback(n) for _ in range(WORLD)]
    bounds = np.linspace(0, n, WORLD + 1).astype(int)
    for r in range(rounds):
        deltas = [m.compute_gradient(d) for m, d in zip(members, data)]
        if density >= 1.0:
            average = torch.stack(deltas).mean(0)
        else:
            pending = [f.accumulate(d) for f, d in zip(feedback, deltas)]
            accumulated = [p.accumulated for p in pending]
            chosen = []
            for m in range(WORLD):
                a, b = int(bounds[m]), int(bounds[m + 1])
                k = max(1, int(density * (b - a)))
                chosen.append(torch.topk(accumulated[(m + r) % WORLD][a:b].abs(), k).indices.sort().values + a)
            idx = torch.cat(chosen)
            sent = [roundtrip(acc[idx], values) if values in KINDS else acc[idx] for acc in accumulated]
            average = torch.zeros(n)
            average[idx] = torch.stack(sent).mean(0)
            for f, p, s in zip(feedback, pending, sent):
                f.commit(p, idx, torch.float32, s)
        for m in members:
            m.apply(average.clone())
    metrics = members[0].evaluate(test)
    return metrics.accuracy, metrics.loss


def main() -> None:
    torch.set_num_threads(1)
    for spec in sys.argv[1:] or ["20,24,1,fp32,nesterov,0.003", "20,24,0.1,2bit,nesterov,0.003",
                                 "20,24,0.1,2bit,average,0.003"]:
        inner, rounds, density, values, outer, lr = spec.split(",")
        accuracy, loss = run(int(inner), int(rounds), float(density), values, outer, float(lr))
        print(f"H={inner} rounds={rounds} density={density} values={values} outer={outer} lr={lr}: "
              f"accuracy {accuracy:.3f}, test loss {loss:.3f}", flush=True)


if __name__ == "__main__":
    main()
