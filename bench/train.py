"""Training benchmark: step time with and without synchronisation, and time to 90% accuracy.

Runs N real `p2ptrain node start` processes on loopback (the demo's cluster) and, in the same run,
two tasks on scikit-learn digits: top-k 1% and dense. For each, every peer reports, over the rounds
it completed, its local step time (forward/backward, then the optimizer step) and its sync time (the
all-reduce, waiting for the other members included), so "step time without sync" and "with sync"
come from the same steps. Time to 90% is the wall time from
publishing the task until a confirmed model with test accuracy >= 0.90 is seen.

    .venv/bin/python bench/train.py --peers 4 [--hidden 512] [--batch 256] [--steps 80] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from p2ptrain.cli.demo import TASK_TEMPLATE, Cluster
from p2ptrain.data.build import build_dataset
from p2ptrain.data.builtin import load_source
from p2ptrain.errors import UserError
from p2ptrain.ipfs.embedded import EmbeddedStore


def task_text(manifest: str, density: float, args: argparse.Namespace, name: str) -> str:
    text = TASK_TEMPLATE.format(manifest=manifest, steps=args.steps, checkpoint=5, density=density, peers=args.peers)
    text = text.replace('name = "demo-digits-mlp"', f'name = "{name}"')
    text = text.replace("hidden = [64]", f"hidden = [{args.hidden}, {args.hidden}]")
    return text.replace("batch_size = 32", f"batch_size = {args.batch}")


def run_task(cluster: Cluster, manifest: str, density: float, args: argparse.Namespace) -> dict:
    first = cluster.homes[0]
    started = time.monotonic()
    task_cid = cluster.call(first, "task.publish", text=task_text(manifest, density, args, f"bench-{density}"),
                            join=True)["task_cid"]
    to_90 = None
    while True:
        try:
            statuses = [cluster.call(h, "task.status", task_cid=task_cid) for h in cluster.homes]
        except UserError:  # a peer has not heard of the task yet
            time.sleep(0.5)
            continue
        for record in statuses[0].get("chain", []):
            if to_90 is None and record["metrics"].get("accuracy", 0) >= 0.90:
                to_90 = (time.monotonic() - started, record["step"])
        if all(s.get("state") == "done" for s in statuses):
            break
        if time.monotonic() - started > args.timeout:
            raise SystemExit(f"density {density}: not done in {args.timeout} s")
        time.sleep(0.5)
    members = [s for s in statuses if s.get("rounds_done")]
    rounds = sum(s["rounds_done"] for s in members)
    compute = sum(s["compute_s"] + s["apply_s"] for s in members)
    sync = sum(s["sync_s"] for s in members)
    return {
        "density": density,
        "wall_s": round(time.monotonic() - started, 1),
        "step_without_sync_ms": round(1000 * compute / rounds, 2),
        "step_with_sync_ms": round(1000 * (compute + sync) / rounds, 2),
        "sync_overhead": round(sync / compute, 3),
        # The member that waits least is the slowest one: its sync is closest to the round's own cost;
        # the others' extra is waiting for it.
        "sync_ms_per_round_by_member": sorted(round(1000 * s["sync_s"] / s["rounds_done"], 1) for s in members),
        "bytes_per_peer_per_step": round(sum(s["bytes_sent"] for s in members) / rounds),
        "time_to_90_s": round(to_90[0], 1) if to_90 else None,
        "step_at_90": to_90[1] if to_90 else None,
        "final_accuracy": statuses[0]["chain"][-1]["metrics"].get("accuracy"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512, help="width of the MLP's two hidden layers")
    parser.add_argument("--batch", type=int, default=256, help="batch size per peer per step")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="p2ptrain-bench-train-"))
    cluster = Cluster(workdir, args.peers)
    load_before = os.getloadavg()[0]
    try:
        first = cluster.homes[0]
        first.mkdir(mode=0o700)
        name, features, labels = load_source("sklearn:digits")
        manifest, _ = build_dataset(EmbeddedStore(first), name, features, labels, num_shards=8)
        cluster.start(ready_timeout=120.0)
        rows = [run_task(cluster, manifest, d, args) for d in (0.01, 1.0)]
    finally:
        cluster.stop()
    result = {"peers": args.peers, "model": f"mlp 64-{args.hidden}-{args.hidden}-10", "batch": args.batch,
              "steps": args.steps, "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
              "runs": rows}
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.peers} peers, {result['model']}, batch {args.batch}/peer, {args.steps} steps, "
          f"load {result['load_average']}")
    for r in rows:
        print(f"density {r['density']:<5} step {r['step_without_sync_ms']:.1f} ms alone, "
              f"{r['step_with_sync_ms']:.1f} ms with sync (overhead {100 * r['sync_overhead']:.0f}%), "
              f"{r['bytes_per_peer_per_step']} B/peer/step, 90% after {r['time_to_90_s']} s "
              f"(step {r['step_at_90']}), final accuracy {r['final_accuracy']:.3f}; "
              f"sync per round by member {r['sync_ms_per_round_by_member']} ms")


if __name__ == "__main__":
    main()
