"""Test accuracy of raw vs ``dataset add --standardize`` features on sklearn:breast_cancer.

    python bench/standardize.py

30 raw features on scales from 0.001 to 4000: one member, the real Trainer and IPFSDataset (as a
run's rounds use them), an MLP [64], 500 steps of batch 32, SGD lr 0.05 and Adam lr 0.001, seeds
0-2. Results: docs/content.md ("Standardized features").
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from p2ptrain.data import IPFSDataset, build_dataset, load_source
from p2ptrain.ipfs import open_store
from p2ptrain.training import Trainer, batched, batches_forever
from p2ptrain.task import load_task

TASK = """name = "bc"\nseed = {seed}\n[model]\nname = "mlp"\nkwargs = {{ in_features = 30, hidden = [64], out_features = 2 }}
[dataset]\nmanifest = "{cid}"\n[optimizer]\nname = "{opt}"\nlr = {lr}\n[training]\nbatch_size = 32\ntotal_steps = {steps}\n"""
STEPS = 500
store = open_store(Path(tempfile.mkdtemp()))
name, x, y = load_source("sklearn:breast_cancer")
for opt, lr in (("sgd", 0.05), ("adam", 0.001)):
    for std in (False, True):
        accs = []
        for seed in range(3):
            cid, _ = build_dataset(store, name, x, y, 4, standardize=std)
            t = Trainer(load_task(TASK.format(seed=seed, cid=cid, opt=opt, lr=lr, steps=STEPS)), device="cpu")
            b = batches_forever(IPFSDataset(cid, store=store, seed=seed), 32)
            for _ in range(STEPS):
                t.apply(t.compute_gradient(b))
            accs.append(t.evaluate(batched(IPFSDataset(cid, split="test", store=store, shuffle=False), 256)).accuracy)
        print(f"{opt} lr {lr} standardize={std}: test accuracy " + " ".join(f"{a:.3f}" for a in accs), flush=True)
