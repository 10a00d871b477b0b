"""Which of torch's CPU kernel sets give the same bits: a few elementwise operations and 20 optimizer
steps of the demo task's MLP from the same inputs, once per kernel set this CPU can run
(``ATEN_CPU_CAPABILITY``, each in a fresh process), as SHA-256 prefixes.

Members must take the same optimizer step to the same bits to attest each other's checkpoints
(docs/deploy.md, "Which machines compute the same bits"). Two machines agree where their rows
agree: run this on each (``--json`` for one line to compare) and see which kernel set each picks
(``torch.backends.cpu.get_cpu_capability()``, the "picked" line).

    python bench/arithmetic.py [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys

CAPABILITIES = ("default", "avx2", "avx512")


def _digest(values: object) -> str:
    import numpy as np

    return hashlib.sha256(np.ascontiguousarray(values).tobytes()).hexdigest()[:12]


def measure() -> dict[str, str]:
    """The digests under this process's kernel set: operations on 100,003 float32 values (NumPy's
    generator: the same inputs everywhere), and model + optimizer bytes after 20 steps of each
    optimizer on fixed gradients."""
    import numpy as np
    import torch

    from p2ptrain.task import TASK_TEMPLATE, load_task
    from p2ptrain.training import Trainer

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    a, b, c = (torch.from_numpy(rng.standard_normal(100_003).astype(np.float32)) for _ in range(3))
    c = c.abs() + 0.1
    ops = {
        "mul": lambda: a * b, "add": lambda: a + b, "div": lambda: a / c, "sqrt": lambda: c.sqrt(),
        "addcdiv": lambda: torch.addcdiv(a, b, c, value=0.3), "lerp": lambda: torch.lerp(a, b, 0.1),
        "addcmul": lambda: torch.addcmul(a, b, c, value=0.3), "add_alpha": lambda: torch.add(a, b, alpha=0.3),
    }
    out = {"picked": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__}
    out.update({name: _digest(op().numpy()) for name, op in ops.items()})
    text = TASK_TEMPLATE.format(manifest="QmPr27mpm19tVRhDMn98aEecF9ii7FVYZVuQNeTGNTFida", steps=100, checkpoint=10,
                                density=0.01, peers=4)
    for optimizer, table in (("adam", 'name = "adam"'), ("sgd", 'name = "sgd"\nmomentum = 0.9')):
        trainer = Trainer(load_task(text.replace('name = "adam"', table)), device="cpu")
        n = sum(p.numel() for p in trainer.params)
        for step in range(20):
            trainer.apply(torch.from_numpy(np.random.default_rng(step).standard_normal(n).astype(np.float32) * 0.1))
        out[optimizer] = hashlib.sha256(trainer.model_bytes() + trainer.optimizer_bytes()).hexdigest()[:12]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON line: {kernel set: {what: digest}}")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: this process's set
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure()))
        return
    rows: dict[str, dict[str, str]] = {}
    for capability in CAPABILITIES:
        env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
        done = subprocess.run([sys.executable, __file__, "--one"], env=env, capture_output=True, text=True,
                              timeout=300, check=True)
        row = json.loads(done.stdout.strip().splitlines()[-1])
        if row["picked"].lower() != capability:
            continue  # this CPU cannot run that set: torch picked another one
        rows[capability] = row
    if args.json:
        print(json.dumps(rows))
        return
    names = [k for k in next(iter(rows.values())) if k not in ("picked", "torch")]
    print(f"torch {next(iter(rows.values()))['torch']}; default: the scalar kernels")
    print(f"{'kernels':<10}" + "".join(f"{n:>14}" for n in names))
    for capability, row in rows.items():
        print(f"{capability:<10}" + "".join(f"{row[n]:>14}" for n in names))


if __name__ == "__main__":
    main()
