"""Training benchmark: step time with and without synchronisation, and time to 90% accuracy.

Runs N real `p2ptrain node start` processes on loopback (the demo's cluster) and, in the same run:

1. the baseline without synchronisation: N processes (one per peer, as many threads each, at the
   same time, so they share the cores as the peers do) take the task's local steps on their own
   shards, each applying its own gradient: the step time a peer has when it talks to nobody;
2. two tasks on scikit-learn digits, top-k 1% and dense, trained by the nodes. Every peer reports,
   over the rounds it completed, its local step time (forward/backward, then the optimizer step) and
   its sync time (the all-reduce, waiting for the other members included); a step with
   synchronisation is their sum.

The sync overhead is step-with-sync / baseline-step - 1. The peers' own split is printed too: the
share of a step they spent in sync, and each member's sync per round. Time to 90% is the wall time
from publishing the task until a confirmed model with test accuracy >= 0.90 is seen.

    .venv/bin/python bench/train.py --peers 4 [--hidden 512] [--batch 256] [--steps 80]
                                    [--sync-interval 1] [--checkpoint 5] [--keep] [--json]

``--local-sgd``: instead, the same nodes train, one after the other, the same task (model, data,
per-peer batch, inner optimizer) as sync mode at 1% top-k, as local-SGD dense with DiLoCo's Nesterov
outer step (fp32 values), and as local-SGD sparse (``--lsgd-density``, 2-bit values, ``average``
outer step), for every H of ``--inner``; each run is cancelled once a confirmed checkpoint reaches
``--target`` test accuracy. Reported per run: wall time and bytes each peer sent to the target
(its mean bytes per round times the rounds to the target), and the sync run's bytes over each.

    .venv/bin/python bench/train.py --local-sgd --peers 4 --hidden 64 --batch 32 [--inner 10 50 100]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from p2ptrain.cli.demo import Cluster
from p2ptrain.data import build_dataset, load_source
from p2ptrain.base import UserError
from p2ptrain.ipfs import EmbeddedStore
from p2ptrain.node import NODE_ARGS
from p2ptrain.task import TASK_TEMPLATE


def task_text(manifest: str, density: float, args: argparse.Namespace, name: str) -> str:
    text = TASK_TEMPLATE.format(manifest=manifest, steps=args.steps, checkpoint=args.checkpoint, density=density,
                                peers=args.peers)
    text = text.replace('name = "demo-digits-mlp"', f'name = "{name}"')
    text = text.replace("hidden = [64]", f"hidden = [{args.hidden}, {args.hidden}]")
    return text.replace("batch_size = 32", f"batch_size = {args.batch}\nsync_interval = {args.sync_interval}")


LOCAL_WARMUP_STEPS = 3
THREADS = int(NODE_ARGS[NODE_ARGS.index("--threads") + 1])  # the baseline's peers get what the nodes get


def local_worker(args: argparse.Namespace) -> None:
    """One peer's steps with nobody to talk to: its gradient goes straight into its optimizer.

    Prints READY once warm, waits for a line on stdin so that all peers' timed steps overlap, then
    prints the JSON of its step times.
    """
    import torch

    from p2ptrain.data import IPFSDataset
    from p2ptrain.training import Trainer, batches_forever
    from p2ptrain.task import load_task

    torch.set_num_threads(THREADS)
    task = load_task(Path(args.local_task).read_text())
    dataset = IPFSDataset(
        task.dataset.manifest, split=task.dataset.train_split, rank=args.local_worker, world_size=args.peers,
        store=EmbeddedStore(Path(args.local_store)), seed=task.seed + args.local_worker,
    )
    batches = batches_forever(dataset, task.training.batch_size)
    trainer = Trainer(task, total_steps=LOCAL_WARMUP_STEPS + args.steps, device="cpu")

    def step() -> float:
        began = time.perf_counter()
        trainer.apply(trainer.compute_gradient(batches))
        return time.perf_counter() - began

    for _ in range(LOCAL_WARMUP_STEPS):
        step()
    print("READY", flush=True)
    sys.stdin.readline()
    print(json.dumps([step() for _ in range(args.steps)]), flush=True)


def run_local(task_file: Path, store: Path, args: argparse.Namespace) -> float:
    """The baseline: every peer's local steps at once, no synchronisation; the mean step in ms."""
    argv = [sys.executable, __file__, "--peers", str(args.peers), "--steps", str(args.steps),
            "--local-task", str(task_file), "--local-store", str(store)]
    procs = [subprocess.Popen([*argv, "--local-worker", str(i)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) for i in range(args.peers)]
    try:
        for proc in procs:
            if proc.stdout.readline().strip() != "READY":
                raise SystemExit("a local baseline worker failed to start")
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        times = [json.loads(proc.stdout.readline()) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return 1000 * sum(sum(t) / len(t) for t in times) / len(times)


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
        "in_run_local_step_ms": round(1000 * compute / rounds, 2),
        "step_with_sync_ms": round(1000 * (compute + sync) / rounds, 2),
        "sync_share": round(sync / (compute + sync), 3),
        # Each member's mean: a round's own cost plus, in each round, the wait for members whose
        # step ended later.
        "sync_ms_per_round_by_member": sorted(round(1000 * s["sync_s"] / s["rounds_done"], 1) for s in members),
        "bytes_per_peer_per_step": round(sum(s["bytes_sent"] for s in members) / rounds),
        "time_to_90_s": round(to_90[0], 1) if to_90 else None,
        "step_at_90": to_90[1] if to_90 else None,
        "final_accuracy": statuses[0]["chain"][-1]["metrics"].get("accuracy"),
    }


def local_sgd_text(sync_text: str, inner: int, density: float, values: str, outer: str, steps: int,
                   checkpoint: int) -> str:
    """The sync task turned local-SGD: same model, data, batch and inner optimizer."""
    text = sync_text.replace("batch_size =", f'mode = "local_sgd"\ninner_steps = {inner}\nbatch_size =', 1)
    text = text.replace("total_steps = ", "total_steps_was = ", 1).replace("checkpoint_interval = ", "checkpoint_was = ", 1)
    text = "\n".join(line for line in text.splitlines() if not line.startswith(("total_steps_was", "checkpoint_was")))
    text = text.replace("batch_size =", f"total_steps = {steps}\ncheckpoint_interval = {checkpoint}\nbatch_size =", 1)
    text = text.replace("density = 0.01", f"density = {density}" + (f'\nvalues = "{values}"' if values != "fp32" else ""))
    return text + f'\n[outer]\noptimizer = "{outer}"\n'


def run_to_target(cluster: Cluster, text: str, label: str, args: argparse.Namespace) -> dict:
    """Publish ``text``, wait for a confirmed checkpoint at ``args.target`` accuracy (or the end),
    cancel the run, and report time and bytes per peer to the target."""
    first = cluster.homes[0]
    started = time.monotonic()
    task_cid = cluster.call(first, "task.publish", text=text, join=True)["task_cid"]
    hit = None
    statuses: list[dict] = []
    while hit is None:
        try:
            statuses = [cluster.call(h, "task.status", task_cid=task_cid) for h in cluster.homes]
        except UserError:
            time.sleep(0.5)
            continue
        for record in statuses[0].get("chain", []):
            if record["metrics"].get("accuracy", 0) >= args.target:
                hit = (time.monotonic() - started, record["step"], record["metrics"]["accuracy"])
                break
        if hit is None and all(s.get("state") == "done" for s in statuses):
            break
        if time.monotonic() - started > args.timeout:
            break
        if hit is None:
            time.sleep(0.5)
    members = [s for s in statuses if s.get("rounds_done")]
    per_round = sum(s["bytes_sent"] / s["rounds_done"] for s in members) / max(1, len(members))
    if hit is not None and statuses[0].get("state") not in ("done", "cancelled"):
        cluster.call(first, "task.cancel", task_cid=task_cid)
        while not all(cluster.call(h, "task.status", task_cid=task_cid).get("state") in ("done", "cancelled", "failed")
                      for h in cluster.homes):
            time.sleep(0.5)
    return {
        "run": label,
        "time_to_target_s": round(hit[0], 1) if hit else None,
        "rounds_to_target": hit[1] if hit else None,
        "accuracy_at_target": round(hit[2], 4) if hit else None,
        "bytes_per_peer_per_round": round(per_round),
        "bytes_per_peer_to_target": round(per_round * hit[1]) if hit else None,
        "best_accuracy": max((r["metrics"].get("accuracy", 0) for r in statuses[0].get("chain", [])), default=None),
    }


def compare_local_sgd(cluster: Cluster, manifest: str, args: argparse.Namespace) -> list[dict]:
    """Sync sparse, then local-SGD dense (DiLoCo) and sparse + 2-bit for each H, to the target."""
    sync_text = task_text(manifest, 0.01, args, "bench-sync")
    rows = [run_to_target(cluster, sync_text, "sync, 1% top-k, fp32 values", args)]
    for inner in args.inner:
        outer_steps = max(3, args.inner_budget // inner)
        checkpoint = max(1, args.inner_checkpoint // inner)
        for label, density, values, outer in (
            (f"local-SGD dense (DiLoCo, nesterov), H={inner}", 1.0, "fp32", "nesterov"),
            (f"local-SGD {100 * args.lsgd_density:g}% top-k 2-bit (average), H={inner}", args.lsgd_density, "2bit", "average"),
        ):
            text = local_sgd_text(sync_text, inner, density, values, outer, outer_steps, checkpoint)
            text = text.replace('name = "bench-sync"', f'name = "bench-lsgd-{inner}-{density}"')
            rows.append(run_to_target(cluster, text, label, args))
    base = rows[0]["bytes_per_peer_to_target"]
    for row in rows:
        mine = row["bytes_per_peer_to_target"]
        row["fewer_bytes_than_sync"] = round(base / mine, 1) if base and mine else None
    return rows


def rescale(row: dict, local_ms: float) -> dict:
    """``row`` with the baseline's step time and its overhead against it."""
    row["step_without_sync_ms"] = local_ms
    row["sync_overhead"] = round(row["step_with_sync_ms"] / local_ms - 1, 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512, help="width of the MLP's two hidden layers")
    parser.add_argument("--batch", type=int, default=256, help="batch size per peer per step")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--sync-interval", type=int, default=1,
                        help="local batches per round (accumulated into one gradient, one all-reduce, one step)")
    parser.add_argument("--checkpoint", type=int, default=5, help="the task's checkpoint interval (steps)")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the peers' homes and logs (the path is printed)")
    parser.add_argument("--local-sgd", action="store_true",
                        help="compare sync sparse, local-SGD dense and local-SGD sparse+2-bit to --target")
    parser.add_argument("--inner", type=int, nargs="+", default=[10, 50, 100], help="H values (--local-sgd)")
    parser.add_argument("--lsgd-density", type=float, default=0.02, help="top-k share of local-SGD sparse")
    parser.add_argument("--target", type=float, default=0.90, help="test accuracy to reach (--local-sgd)")
    parser.add_argument("--inner-budget", type=int, default=1500,
                        help="inner steps per member a local-SGD run may take (its outer steps: this / H, at least 3)")
    parser.add_argument("--inner-checkpoint", type=int, default=20,
                        help="inner steps between local-SGD checkpoints (at least one outer step)")
    parser.add_argument("--local-worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--local-task", help=argparse.SUPPRESS)
    parser.add_argument("--local-store", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.local_worker is not None:
        local_worker(args)
        return
    workdir = Path(tempfile.mkdtemp(prefix="p2ptrain-bench-train-"))
    cluster = Cluster(workdir, args.peers)
    load_before = os.getloadavg()[0]
    try:
        first = cluster.homes[0]
        first.mkdir(mode=0o700)
        name, features, labels = load_source("sklearn:digits")
        manifest, _ = build_dataset(EmbeddedStore(first), name, features, labels, num_shards=8)
        cluster.start(ready_timeout=120.0)
        if args.local_sgd:
            rows = compare_local_sgd(cluster, manifest, args)
            result = {"peers": args.peers, "model": f"mlp 64-{args.hidden}-{args.hidden}-10", "batch": args.batch,
                      "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)], "runs": rows}
            print(json.dumps(result) if args.json else "\n".join(json.dumps(r) for r in [result["load_average"], *rows]))
            return
        task_file = workdir / "local-task.toml"
        task_file.write_text(task_text(manifest, 0.01, args, "bench-local"))
        # The baseline before and after the tasks, so that a change in the machine's load during
        # the run shows (and is averaged) rather than skewing the ratio one way.
        before = run_local(task_file, first, args)
        sparse = run_task(cluster, manifest, 0.01, args)
        dense = run_task(cluster, manifest, 1.0, args)
        after = run_local(task_file, first, args)
        local = {"step_ms": round((before + after) / 2, 2), "step_ms_before": round(before, 2),
                 "step_ms_after": round(after, 2)}
        rows = [rescale(row, local["step_ms"]) for row in (sparse, dense)]
    finally:
        cluster.stop()
        if args.keep:
            print(f"peers' homes and logs kept in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    result = {"peers": args.peers, "model": f"mlp 64-{args.hidden}-{args.hidden}-10", "batch": args.batch,
              "sync_interval": args.sync_interval,
              "steps": args.steps, "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
              "local": local, "runs": rows}
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.peers} peers, {result['model']}, batch {args.batch}/peer, sync interval {args.sync_interval}, "
          f"{args.steps} steps, "
          f"load {result['load_average']}")
    print(f"without sync: step {local['step_ms']:.1f} ms ({local['step_ms_before']:.1f} before the tasks, "
          f"{local['step_ms_after']:.1f} after)")
    for r in rows:
        print(f"density {r['density']:<5} step {r['step_with_sync_ms']:.1f} ms with sync "
              f"(overhead {100 * r['sync_overhead']:.0f}% over the baseline); in the run: "
              f"{r['in_run_local_step_ms']:.1f} ms local + sync ({100 * r['sync_share']:.0f}% of a step), "
              f"{r['bytes_per_peer_per_step']} B/peer/step, 90% after {r['time_to_90_s']} s "
              f"(step {r['step_at_90']}), final accuracy {r['final_accuracy']:.3f}; "
              f"sync per round by member {r['sync_ms_per_round_by_member']} ms")


if __name__ == "__main__":
    main()
