"""The language task across an emulated WAN: sync mode against local-SGD, test loss after equal wall time.

Four ``p2ptrain node start`` processes, each in its own network namespace behind a ``--rate`` link
(20 Mbit/s both ways by default, :func:`p2ptrain.testing.emulated_wan`), train
node/tasks/stdlib-lm.toml's model (a byte-level ``transformer_lm``, 5.69M parameters) on
``text:python-stdlib`` (what ``p2ptrain dataset add text:python-stdlib`` reads), one run after the
other on the same nodes:

- ``sync``: one all-reduce of the gradient per optimizer step, top-k 1% with error feedback, fp32
  values (the mode's and bench/train.py's default density);
- ``local_sgd``: ``--inner`` AdamW steps per member, then one all-reduce of the pseudo-gradient
  (top-k: the task file's 2% or each ``--lsgd-density``, 2-bit values, error feedback) and the
  ``average`` outer step; one run per density.

Both runs have the same model, data, per-peer batch, inner optimizer and learning-rate schedule (over
the same number of optimizer steps, ``--schedule-steps``), and checkpoint every ``--inner`` optimizer
steps (sync: ``checkpoint_interval = H``; local-SGD: every outer step), so both are evaluated equally
often. Each run's clock starts when its task is published; after ``--wall`` seconds it is cancelled.
The figure compared is the **test loss of the last confirmed checkpoint seen by then**: the
coordinator's evaluation on the data set's test split, as published in the signed record (the run's
chain, ``task status``); every checkpoint's (time, step, loss) is reported too.

The text is cut to ``--windows`` windows of 129 bytes (a seeded sample of the 8 MiB that ``dataset
add`` reads) with ``--test-fraction`` of them as the test split, so that an evaluation of the 5.7M
model (a forward pass over the split on one core) stays a small part of the run on a shared CPU.

    flock /tmp/p2ptrain-bench.lock .venv/bin/python bench/wan_lm.py --wall 150 --inner 10 \
        [--lsgd-density 0.02 0.1] [--windows 8192 --test-fraction 0.0125] --json
    .venv/bin/python bench/wan_lm.py --offline --inner 10      # one outer step in one process, no network
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from p2ptrain.data import build_dataset, load_source
from p2ptrain.base import UserError
from p2ptrain.ipfs import EmbeddedStore
from p2ptrain.node import NODE_ARGS
from p2ptrain.control import ControlClient
from p2ptrain.testing import emulated_wan, wait_for, wan_node_processes

TASK_FILE = Path(__file__).resolve().parent.parent / "node" / "tasks" / "stdlib-lm.toml"
# A node process imports torch and libp2p: minutes on this 2-core box when it runs at load 20.
NODE_READY_TIMEOUT_S = 300.0
# How long the bench waits for the nodes to see each other, and for a cancelled run to stop.
MESH_TIMEOUT_S = 120.0
CANCEL_TIMEOUT_S = 180.0
# How often the run's chain is read (one control call to the first node): the grain of the times
# at which checkpoints are seen.
POLL_S = 1.0
# One control call's bound: a node at load 20 may take seconds to answer while it evaluates.
CONTROL_TIMEOUT_S = 120.0
SYNC_DENSITY = 0.01  # sync mode's top-k share (bench/train.py's and the demo's)


def task_text(manifest: str, mode: str, args: argparse.Namespace, density: float | None = None) -> str:
    """node/tasks/stdlib-lm.toml for ``mode``, with the bench's data, batch, H, schedule and peers
    (and, in local-SGD mode, ``density`` instead of the file's when given)."""
    text = TASK_FILE.read_text()
    h = args.inner
    text = text.replace("QmReplaceWithTheManifestCidPrintedByDatasetAdd", manifest)
    text = text.replace('name = "stdlib-lm"', f'name = "bench-lm-{mode}-{density}-{os.getpid()}"')
    text = re.sub(r"warmup_steps = \d+", f"warmup_steps = {args.warmup}", text)
    text = re.sub(r"(?m)^batch_size = \d+", f"batch_size = {args.batch}", text)
    text = re.sub(r"min = \d+", f"min = {args.peers}", text)  # every run starts with all four members
    if mode == "sync":
        text = re.sub(r'mode = "local_sgd".*\n', "", text)
        text = re.sub(r"inner_steps = \d+.*\n", "", text)
        text = re.sub(r"total_steps = \d+", f"total_steps = {args.schedule_steps}", text)
        text = re.sub(r"checkpoint_interval = \d+", f"checkpoint_interval = {h}", text)
        text = re.sub(r"\[outer\]\n(?:[^\[]*\n)", "", text)
        text = re.sub(r"density = [0-9.]+", f"density = {SYNC_DENSITY}", text)
        text = re.sub(r'values = "2bit".*\n', "", text)
    else:
        text = re.sub(r"inner_steps = \d+", f"inner_steps = {h}", text)
        text = re.sub(r"total_steps = \d+", f"total_steps = {args.schedule_steps // h}", text)
        text = re.sub(r"checkpoint_interval = \d+", "checkpoint_interval = 1", text)
        if density is not None:
            text = re.sub(r"(?m)^density = [0-9.]+", f"density = {density}", text)
    return text


def file_density() -> float:
    """The top-k share node/tasks/stdlib-lm.toml gives the pseudo-gradient."""
    return float(re.search(r"(?m)^density = ([0-9.]+)", TASK_FILE.read_text())[1])


def build_text(home: Path, args: argparse.Namespace) -> str:
    """``text:python-stdlib``, a seeded sample of ``--windows`` windows, stored in ``home``: the manifest."""
    name, features, labels = load_source("text:python-stdlib")
    pick = np.sort(np.random.default_rng(0).choice(len(features), size=min(args.windows, len(features)),
                                                    replace=False))
    manifest, _ = build_dataset(EmbeddedStore(home), name, features[pick], labels[pick], num_shards=8,
                                test_fraction=args.test_fraction)
    return manifest


def call(home: Path, op: str, **params: Any) -> dict[str, Any]:
    return ControlClient(home, timeout=CONTROL_TIMEOUT_S).call(op, **params)


def run_mode(homes: list[Path], manifest: str, mode: str, args: argparse.Namespace,
             density: float | None = None) -> dict[str, Any]:
    """Publish the task in ``mode``, read its chain for ``--wall`` seconds, cancel it; the figures."""
    first = homes[0]
    load = os.getloadavg()[0]
    started = time.monotonic()
    text = task_text(manifest, mode, args, density)
    task_cid = call(first, "task.publish", text=text, join=True)["task_cid"]
    seen: dict[int, dict[str, Any]] = {}  # version -> the checkpoint and when it was first seen
    while (elapsed := time.monotonic() - started) < args.wall:
        try:
            status = call(first, "task.status", task_cid=task_cid)
        except UserError:
            status = {}
        for record in status.get("chain", []):
            if record["version"] not in seen and "loss" in record["metrics"]:
                seen[record["version"]] = {"seen_s": round(elapsed, 1), "step": record["step"],
                                           "test_loss": round(record["metrics"]["loss"], 4),
                                           "accuracy": round(record["metrics"].get("accuracy", 0.0), 4)}
        time.sleep(POLL_S)
    statuses = [call(h, "task.status", task_cid=task_cid) for h in homes]
    call(first, "task.cancel", task_cid=task_cid)
    wait_for(lambda: all(call(h, "task.status", task_cid=task_cid).get("state") in ("done", "cancelled", "failed")
                         for h in homes), CANCEL_TIMEOUT_S, interval=1.0)
    checkpoints = [seen[v] for v in sorted(seen)]
    last = checkpoints[-1] if checkpoints else None
    h = args.inner if mode == "local_sgd" else 1
    members = [s for s in statuses if s.get("rounds_done")]
    rounds = sum(s["rounds_done"] for s in members)
    return {
        "mode": mode,
        "inner_steps": args.inner if mode == "local_sgd" else None,
        "density": float(re.search(r"(?m)^density = ([0-9.]+)", text)[1]),
        "values": "fp32" if mode == "sync" else "2bit",
        "wall_s": args.wall,
        "load_average": [round(load, 2), round(os.getloadavg()[0], 2)],
        "optimizer_steps_at_wall": max((s.get("step", 0) for s in statuses), default=0) * h,
        "test_loss_at_wall": last["test_loss"] if last else None,
        "accuracy_at_wall": last["accuracy"] if last else None,
        "last_checkpoint_seen_s": last["seen_s"] if last else None,
        "checkpoints": checkpoints,
        "bytes_per_peer_per_round": round(sum(s["bytes_sent"] for s in members) / rounds) if rounds else None,
        "bytes_per_peer": round(sum(s["bytes_sent"] for s in members) / max(1, len(members))),
        "sync_share": round(sum(s["sync_s"] for s in members)
                            / max(1e-9, sum(s["sync_s"] + s["compute_s"] + s["apply_s"] for s in members)), 3),
    }


def offline(args: argparse.Namespace) -> dict[str, Any]:
    """One outer step without the network, in one process: ``--peers`` members each take ``--inner``
    AdamW steps (the task's lr 0.001, weight decay 0.01, the warmup) from the same seeded model on
    their own batches; the test loss of the shared weights after the ``average`` outer step with the
    exact mean pseudo-gradient, and with the top ``d`` of it (by the mean's magnitude) sent quantized,
    for each ``--offline-density`` and quantizer. What the density buys in the first rounds, before
    error feedback has delivered anything (the network runs see only a few outer steps)."""
    import torch
    import torch.nn.functional as F

    from p2ptrain.models import build_model
    from p2ptrain.wire.quantization import roundtrip

    torch.set_num_threads(1)
    _, features, labels = load_source("text:python-stdlib")
    pick = np.random.default_rng(0).choice(len(features), size=min(args.windows, len(features)), replace=False)
    x, y = torch.from_numpy(features[pick].astype(np.int64)), torch.from_numpy(labels[pick].astype(np.int64))
    test = max(1, round(len(pick) * args.test_fraction))
    tx, ty, x, y = x[-test:], y[-test:], x[:-test], y[:-test]
    model = build_model("transformer_lm", dict(vocab_size=256, context=128, width=256, depth=7, heads=8), 0)
    params = list(model.parameters())

    def weights() -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in params])

    def set_weights(flat: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for p in params:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    def test_loss(flat: torch.Tensor) -> float:
        set_weights(flat)
        with torch.no_grad():
            return round(float(F.cross_entropy(model(tx).reshape(-1, 256), ty.reshape(-1))), 4)

    theta = weights().clone()
    deltas = []
    for member in range(args.peers):
        set_weights(theta)
        optimizer = torch.optim.AdamW(params, lr=0.001, weight_decay=0.01)
        g = torch.Generator().manual_seed(member)
        for i in range(args.inner):
            for group in optimizer.param_groups:
                group["lr"] = 0.001 * min(1.0, (i + 1) / max(1, args.warmup))
            batch = torch.randint(len(x), (args.batch,), generator=g)
            loss = F.cross_entropy(model(x[batch]).reshape(-1, 256), y[batch].reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        deltas.append(theta - weights())
    mean = torch.stack(deltas).mean(0)
    result: dict[str, Any] = {"initial": test_loss(theta), "dense_fp32": test_loss(theta - mean)}
    for density in args.offline_density:
        indices = torch.topk(mean.abs(), int(density * mean.numel())).indices.sort().values
        for kind in ("2bit", "int8"):
            total = torch.zeros_like(theta)
            for delta in deltas:
                total[indices] += roundtrip(delta[indices], kind)
            result[f"{density:g}_{kind}"] = test_loss(theta - total / args.peers)
    return {"peers": args.peers, "inner_steps": args.inner, "batch_per_peer": args.batch, "test_windows": test,
            "test_loss_after_one_outer_step": result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rate", default="20mbit", help="each peer's link, both ways (tc rate)")
    parser.add_argument("--wall", type=float, default=150.0, help="seconds each run trains, from its publication")
    parser.add_argument("--inner", type=int, default=10, help="H of the local-SGD run; both runs checkpoint every H steps")
    parser.add_argument("--batch", type=int, default=16, help="windows of 128 bytes per peer per optimizer step")
    parser.add_argument("--warmup", type=int, default=10, help="warmup optimizer steps of the cosine schedule")
    parser.add_argument("--schedule-steps", type=int, default=400,
                        help="optimizer steps the cosine schedule spans (more than either run takes in --wall)")
    parser.add_argument("--windows", type=int, default=8192, help="text windows in the data set (train + test)")
    parser.add_argument("--test-fraction", type=float, default=0.0125,
                        help="share of the windows in the test split (0.0125 of 8192: 102 windows, 13K bytes)")
    parser.add_argument("--lsgd-density", type=float, nargs="+",
                        help="local-SGD runs, one per top-k share (default: the task file's, 0.02)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--offline", action="store_true",
                        help="no network: the test loss after one outer step, dense and at each --offline-density")
    parser.add_argument("--offline-density", type=float, nargs="+", default=[0.02, 0.1, 0.25, 0.5])
    args = parser.parse_args()
    if args.offline:
        print(json.dumps(offline(args)))
        return
    workdir = Path(tempfile.mkdtemp(prefix="p2ptrain-wan-lm-"))
    load_before = os.getloadavg()[0]
    began = time.strftime("%H:%M:%S", time.gmtime())
    try:
        home0 = workdir / "node0"
        home0.mkdir(parents=True, mode=0o700)
        manifest = build_text(home0, args)
        with emulated_wan(args.peers, args.rate) as wan, \
                wan_node_processes(wan, workdir, extra_args=NODE_ARGS, ready_timeout=NODE_READY_TIMEOUT_S) as procs:
            wait_for(lambda: min(len(p.status()["peers"]) for p in procs) >= args.peers - 1, MESH_TIMEOUT_S,
                     interval=0.5)
            homes = [p.home for p in procs]
            runs = [run_mode(homes, manifest, "sync", args)]
            runs += [run_mode(homes, manifest, "local_sgd", args, d) for d in args.lsgd_density or [file_density()]]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result: dict[str, Any] = {
        "peers": args.peers, "rate": args.rate, "task": "node/tasks/stdlib-lm.toml (transformer_lm, 5.69M parameters)",
        "batch_per_peer": args.batch, "windows": args.windows, "test_fraction": args.test_fraction,
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "utc": [began, time.strftime("%H:%M:%S", time.gmtime())], "runs": runs,
    }
    sync_loss = runs[0]["test_loss_at_wall"]
    for r in runs[1:]:  # the target: lower test loss than sync mode's after the same wall time
        r["lower_loss_than_sync"] = None if None in (sync_loss, r["test_loss_at_wall"]) else r["test_loss_at_wall"] < sync_loss
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.peers} peers at {args.rate}, batch {args.batch}/peer, load {result['load_average']}")
    for r in runs:
        print(f"{r['mode']:<9} {r['density']:<5} {r['values']} after {r['wall_s']:.0f} s: test loss {r['test_loss_at_wall']} "
              f"(checkpoint seen at {r['last_checkpoint_seen_s']} s), {r['optimizer_steps_at_wall']} optimizer steps, "
              f"{r['bytes_per_peer']} B sent per peer, sync share {r['sync_share']}")
        for c in r["checkpoints"]:
            print(f"    {c['seen_s']:>6} s  step {c['step']:>4}  loss {c['test_loss']}  accuracy {c['accuracy']}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
