"""One member's local step on the CPU and on CUDA, same run, same machine: what the GPU buys a peer.

    python bench/gpu_step.py [--hidden 2048] [--batch 256] [--steps 20] [--json]

A registry MLP (784 -> hidden -> hidden -> 10, Adam) in :class:`p2ptrain.training.Trainer`: one
step is ``compute_gradient`` (forward, backward, the flat fp32 gradient copied to the CPU, where the
all-reduce takes it) plus ``apply`` (the averaged gradient back to the device, the optimizer step,
the rollback copy of weights and optimizer state on the CPU). The all-reduce itself is left out (its
cost is the network's: bench/allreduce.py). Medians over ``--steps`` after three warm-up steps, for
cpu fp32, and, where CUDA is available, cuda fp32, bf16 and fp16 autocast. Random inputs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterator

import torch

from p2ptrain.task import load_task
from p2ptrain.training import Trainer

TASK = """\
name = "gpu-step"
[model]
name = "mlp"
kwargs = {{ in_features = 784, hidden = [{hidden}, {hidden}], out_features = 10 }}
[dataset]
manifest = "QmPr27mpm19tVRhDMn98aEecF9ii7FVYZVuQNeTGNTFida"
[optimizer]
name = "adam"
lr = 0.001
[training]
batch_size = {batch}
total_steps = 1000
"""


def _batches(batch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    while True:
        yield torch.randn(batch, 784, generator=g), torch.randint(0, 10, (batch,), generator=g)


def step_times(device: str, precision: str, hidden: int, batch: int, steps: int) -> dict[str, float]:
    trainer = Trainer(load_task(TASK.format(hidden=hidden, batch=batch)), device=device, precision=precision)
    data = _batches(batch)
    grad_s, apply_s = [], []
    for i in range(steps + 3):
        t0 = time.perf_counter()
        flat = trainer.compute_gradient(data)  # ends with the gradient on the CPU: synchronised
        t1 = time.perf_counter()
        trainer.apply(flat)
        if trainer.device.type == "cuda":
            torch.cuda.synchronize(trainer.device)
        t2 = time.perf_counter()
        if i >= 3:
            grad_s.append(t1 - t0)
            apply_s.append(t2 - t1)
    gradient, apply = statistics.median(grad_s), statistics.median(apply_s)
    return {"gradient_ms": gradient * 1e3, "apply_ms": apply * 1e3, "step_ms": (gradient + apply) * 1e3,
            "samples_per_s": batch / (gradient + apply)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    cases = [("cpu", "fp32")]
    if torch.cuda.is_available():
        cases += [("cuda", "fp32"), ("cuda", "bf16"), ("cuda", "fp16")]
    result: dict[str, object] = {
        "parameters": 784 * args.hidden + args.hidden * args.hidden + args.hidden * 10 + 2 * args.hidden + 10,
        "batch": args.batch, "cpu_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "torch": torch.__version__,
    }
    for device, precision in cases:
        result[f"{device}_{precision}"] = step_times(device, precision, args.hidden, args.batch, args.steps)
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
