"""Time to a target accuracy across an emulated WAN (``bench/wan.py --train``): p2ptrain (top-k 1%
and dense), torch DDP over gloo, and hivemind 1.1.12's ``hivemind.Optimizer``; each peer in its own
network namespace behind the same ``--rate`` link, same task, same model, same per-peer batch.

The task is bench/train.py's (scikit-learn digits, an MLP 64-H-H-10, Adam at lr 0.02 with the
demo's cosine schedule); every peer reads the same shards of the same dataset (p2ptrain's members
fetch theirs by CID; DDP's ranks read them from the store they were built in; hivemind's peers from
arrays exported from it: hivemind runs in a venv of its own and cannot import p2ptrain).
Accuracy is on the dataset's test split, every ``--checkpoint`` steps (p2ptrain: at its checkpoints).

Clocks: p2ptrain's starts when the task is published (members then fetch the task and their shards
over the WAN), DDP's and hivemind's when their process group / DHT is up and the data is loaded, so
p2ptrain pays for more of its start than the others do.

hivemind is installed by this bench, never by the package: ``HIVEMIND_VENV`` (default
/work/hivemind-venv) with ``pip install torch==2.13.0 hivemind==1.1.12`` (its wheel ships ``p2pd``).
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
from typing import Any

import train as train_bench  # bench/train.py: the task text and the p2ptrain run (bench/ is on sys.path)

from p2ptrain.data.build import build_dataset
from p2ptrain.data.builtin import load_source
from p2ptrain.ipfs.embedded import EmbeddedStore
from p2ptrain.local_nodes import NODE_ARGS
from p2ptrain.net.control import ControlClient
from p2ptrain.testing import emulated_wan, wait_for, wan_node_processes
from p2ptrain.testing.wan import IFACE

HIVEMIND_VENV = Path(os.environ.get("HIVEMIND_VENV", "/work/hivemind-venv"))
TARGET_ACCURACY = 0.90  # what bench/train.py's run_task times
# Bound on one baseline run (DDP or hivemind) to the target: past it the run counts as not reaching it.
RUN_TIMEOUT_S = 900.0
GLOO_PORT = 29500  # inside rank 0's namespace: every port there is free
# A node process imports torch and libp2p: minutes on this 2-core box when it runs at load 20.
NODE_READY_TIMEOUT_S = 300.0
# hivemind's matchmaking window per global step: its default, 5 s. At 1 s (shorter than its 3 s
# request timeout, which hivemind warns may deadlock) its peers at load 20 kept failing to form a
# group ("could not find a group") and fell out of sync.
HIVEMIND_MATCHMAKING_S = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--train")
    group.add_argument("--hidden", type=int, default=512, help="width of the MLP's two hidden layers")
    group.add_argument("--batch", type=int, default=64, help="batch per peer per step")
    group.add_argument("--steps", type=int, default=150, help="the task's total steps (the most any run takes)")
    group.add_argument("--checkpoint", type=int, default=10, help="steps between evaluations")
    group.add_argument("--skip-hivemind", action="store_true")


class WanCluster:
    """What bench/train.py's run_task needs of a cluster: the homes and a control call."""

    def __init__(self, homes: list[Path]) -> None:
        self.homes = homes

    def call(self, home: Path, op: str, **params: Any) -> dict[str, Any]:
        return ControlClient(home, timeout=120.0).call(op, **params)


def task_args(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(steps=args.steps, checkpoint=args.checkpoint, peers=args.peers, hidden=args.hidden,
                              batch=args.batch, sync_interval=1, timeout=RUN_TIMEOUT_S)


def run_p2ptrain(args: argparse.Namespace, workdir: Path) -> tuple[str, list[dict]]:
    """Both p2ptrain runs (1%, dense) on node processes in the namespaces; the dataset's manifest."""
    home0 = workdir / "node0"
    home0.mkdir(parents=True, mode=0o700)
    name, features, labels = load_source("sklearn:digits")
    manifest, _ = build_dataset(EmbeddedStore(home0), name, features, labels, num_shards=8)
    with emulated_wan(args.peers, args.rate) as wan, \
            wan_node_processes(wan, workdir, extra_args=NODE_ARGS, ready_timeout=NODE_READY_TIMEOUT_S) as procs:
        wait_for(lambda: min(len(p.status()["peers"]) for p in procs) >= args.peers - 1, 120, interval=0.2)
        cluster = WanCluster([p.home for p in procs])
        rows = [train_bench.run_task(cluster, manifest, density, task_args(args)) for density in (0.01, 1.0)]
    return manifest, rows


# ---- torch DDP over gloo, one rank per namespace ------------------------------------------------------


def ddp_worker(argv: list[str]) -> None:
    """One DDP rank: the task's model wrapped in DistributedDataParallel, its shards, its optimizer."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from p2ptrain.data.dataset import IPFSDataset
    from p2ptrain.training.task import load_task
    from p2ptrain.training.trainer import (Trainer, batched, batches_forever, evaluate_batches, loss_and_hits,
                                           lr_at)

    rank, world, master, task_file, store_home, checkpoint = argv[0:6]
    rank, world, checkpoint = int(rank), int(world), int(checkpoint)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR=master, MASTER_PORT=str(GLOO_PORT), GLOO_SOCKET_IFNAME=IFACE)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    task = load_task(Path(task_file).read_text())
    store = EmbeddedStore(Path(store_home))
    trainer = Trainer(task, device="cpu")  # the same model, seed and optimizer as a p2ptrain member's
    model = DistributedDataParallel(trainer.model)
    batches = batches_forever(IPFSDataset(task.dataset.manifest, split=task.dataset.train_split, rank=rank,
                                          world_size=world, store=store, seed=task.seed + rank),
                              task.training.batch_size)
    test = list(IPFSDataset(task.dataset.manifest, split="test", store=store, shuffle=False))
    dist.barrier()
    started, reached, accuracy = time.perf_counter(), None, 0.0
    for step in range(trainer.total_steps):
        for group in trainer.optimizer.param_groups:
            group["lr"] = lr_at(task, step, trainer.total_steps)
        model.train()
        x, y = next(batches)
        loss, _, _ = loss_and_hits(model(x), y)
        trainer.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP's gloo all-reduce of the gradient buckets
        trainer.optimizer.step()
        if (step + 1) % checkpoint == 0 or step + 1 == trainer.total_steps:
            flag = torch.zeros(1)
            if rank == 0:
                accuracy = evaluate_batches(trainer.model, batched(test, 256)).accuracy
                flag[0] = accuracy >= TARGET_ACCURACY
            dist.broadcast(flag, 0)
            if flag[0] and reached is None:
                reached = (time.perf_counter() - started, step + 1)
                break
    if rank == 0:
        print("RESULT " + json.dumps({"time_to_target_s": reached and round(reached[0], 2),
                                      "steps": reached[1] if reached else trainer.total_steps,
                                      "final_accuracy": accuracy,
                                      "bytes_per_peer_per_step": 2 * (world - 1) / world * 4 * trainer.num_parameters}),
              flush=True)
    dist.destroy_process_group()


def run_ddp(args: argparse.Namespace, task_file: Path, store_home: Path) -> dict:
    with emulated_wan(args.peers, args.rate) as wan:
        procs = [wan[i].popen([sys.executable, __file__, "--ddp-worker", str(i), str(args.peers), wan[0].ip,
                               str(task_file), str(store_home), str(args.checkpoint)],
                              stdout=subprocess.PIPE, text=True) for i in range(args.peers)]
        outs = [proc.communicate(timeout=RUN_TIMEOUT_S)[0] for proc in procs]
    line = next((ln for ln in outs[0].splitlines() if ln.startswith("RESULT ")), None)
    if line is None or any(p.returncode for p in procs):
        raise SystemExit("a DDP rank failed")
    return json.loads(line[7:])


# ---- hivemind.Optimizer, one peer per namespace -----------------------------------------------------

HIVEMIND_WORKER = r'''
import json, sys, time
import numpy as np, torch, hivemind
rank, world, ip, data, hidden, batch, steps, checkpoint, target, lr, matchmaking = sys.argv[1:12]
rank, world, hidden, batch, steps, checkpoint = map(int, (rank, world, hidden, batch, steps, checkpoint))
torch.set_num_threads(1); torch.manual_seed(0)
arrays = np.load(data)
x, y = torch.from_numpy(arrays[f"x{rank}"]), torch.from_numpy(arrays[f"y{rank}"])
tx, ty = torch.from_numpy(arrays["test_x"]), torch.from_numpy(arrays["test_y"])
model = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                            torch.nn.ReLU(), torch.nn.Linear(hidden, 10))
initial = [] if rank == 0 else [sys.stdin.readline().strip()]
dht = hivemind.DHT(host_maddrs=[f"/ip4/{ip}/tcp/0"], initial_peers=initial, start=True)
if rank == 0:
    print("ADDR " + str([a for a in dht.get_visible_maddrs() if ip in str(a)][0]), flush=True)
opt = hivemind.Optimizer(dht=dht, run_id="wan-bench", batch_size_per_step=batch, target_batch_size=batch * world,
                         optimizer=lambda params: torch.optim.Adam(params, lr=float(lr)), params=model.parameters(),
                         matchmaking_time=float(matchmaking), averaging_timeout=60.0, verbose=False)
print("READY", flush=True); sys.stdin.readline()
g = torch.Generator().manual_seed(rank)
# hivemind's butterfly all-reduce of the gradients (not measured: its schedule's volume, as DDP's)
volume = 2 * (world - 1) / world * 4 * sum(p.numel() for p in model.parameters())
started, reached, accuracy, local, evaluated = time.perf_counter(), None, 0.0, 0, 0
while opt.local_epoch < steps and time.perf_counter() - started < 900:
    i = torch.randint(len(x), (batch,), generator=g)
    loss = torch.nn.functional.cross_entropy(model(x[i]), y[i])
    opt.zero_grad(); loss.backward(); opt.step(); local += 1
    if opt.local_epoch and opt.local_epoch % checkpoint == 0 and opt.local_epoch != evaluated and rank == 0:
        evaluated = opt.local_epoch
        with torch.no_grad():
            accuracy = float((model(tx).argmax(1) == ty).float().mean())
        print(f"hivemind rank 0: epoch {opt.local_epoch}, {local} local steps, accuracy {accuracy:.3f}, "
              f"{time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
        if accuracy >= float(target) and reached is None:
            reached = (time.perf_counter() - started, opt.local_epoch)
            print("RESULT " + json.dumps({"time_to_target_s": round(reached[0], 2), "steps": opt.local_epoch,
                                          "local_steps": local, "final_accuracy": accuracy,
                                          "bytes_per_peer_per_step": volume}), flush=True)
            break
if rank == 0 and reached is None:
    print("RESULT " + json.dumps({"time_to_target_s": None, "steps": opt.local_epoch, "local_steps": local,
                                  "final_accuracy": accuracy, "bytes_per_peer_per_step": volume}), flush=True)
sys.stdout.flush()
import os; os._exit(0)
'''


def export_arrays(manifest: str, store_home: Path, peers: int, out: Path) -> None:
    """Each rank's train shards and the test split as numpy arrays, for a process without p2ptrain."""
    import numpy as np

    from p2ptrain.data.dataset import IPFSDataset

    store = EmbeddedStore(store_home)
    arrays: dict[str, Any] = {}
    for rank in range(peers):
        samples = list(IPFSDataset(manifest, split="train", rank=rank, world_size=peers, store=store, shuffle=False))
        arrays[f"x{rank}"] = np.stack([s[0].numpy() for s in samples]).astype(np.float32)
        arrays[f"y{rank}"] = np.array([int(s[1]) for s in samples], dtype=np.int64)
    test = list(IPFSDataset(manifest, split="test", store=store, shuffle=False))
    arrays["test_x"] = np.stack([s[0].numpy() for s in test]).astype(np.float32)
    arrays["test_y"] = np.array([int(s[1]) for s in test], dtype=np.int64)
    np.savez(out, **arrays)


def run_hivemind(args: argparse.Namespace, data: Path, workdir: Path) -> dict:
    python = HIVEMIND_VENV / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"hivemind: no venv at {HIVEMIND_VENV} (python -m venv {HIVEMIND_VENV} && "
                         f"{HIVEMIND_VENV}/bin/pip install torch==2.13.0 hivemind==1.1.12)")
    script = workdir / "hivemind_worker.py"
    script.write_text(HIVEMIND_WORKER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with emulated_wan(args.peers, args.rate) as wan:
        def start(i: int) -> subprocess.Popen[str]:
            return wan[i].popen([str(python), str(script), str(i), str(args.peers), wan[i].ip, str(data),
                                 str(args.hidden), str(args.batch), str(args.steps), str(args.checkpoint),
                                 str(TARGET_ACCURACY), "0.02", str(HIVEMIND_MATCHMAKING_S)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

        procs = [start(0)]
        addr = procs[0].stdout.readline().split()[1]
        procs += [start(i) for i in range(1, args.peers)]
        for proc in procs[1:]:
            proc.stdin.write(addr + "\n")
            proc.stdin.flush()
        for proc in procs:
            if proc.stdout.readline().strip() != "READY":
                raise SystemExit("a hivemind peer failed to start")
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        line = next((ln for ln in iter(procs[0].stdout.readline, "") if ln.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit("hivemind: rank 0 gave no result")
    return json.loads(line[7:])


def train_race(args: argparse.Namespace) -> dict:
    """The four runs, one after another; ``time_to_target_s`` per system, and each run's details."""
    workdir = Path(tempfile.mkdtemp(prefix="p2ptrain-wan-train-"))
    try:
        manifest, (sparse, dense) = run_p2ptrain(args, workdir)
        home0 = workdir / "node0"
        task_file = workdir / "task.toml"
        task_file.write_text(train_bench.task_text(manifest, 1.0, task_args(args), "bench-ddp"))
        ddp = run_ddp(args, task_file, home0)
        runs = {"p2ptrain": sparse, "p2ptrain_dense": dense, "ddp": ddp}
        if not args.skip_hivemind:
            data = workdir / "arrays.npz"
            export_arrays(manifest, home0, args.peers, data)
            runs["hivemind"] = run_hivemind(args, data, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    times = {"p2ptrain": sparse["time_to_90_s"], "p2ptrain_dense": dense["time_to_90_s"], "ddp": ddp["time_to_target_s"]}
    if "hivemind" in runs:
        times["hivemind"] = runs["hivemind"]["time_to_target_s"]
    return {"target_accuracy": TARGET_ACCURACY, "model": f"mlp 64-{args.hidden}-{args.hidden}-10",
            "batch_per_peer": args.batch, "time_to_target_s": times, "train_runs": runs}


if __name__ == "__main__" and sys.argv[1:2] == ["--ddp-worker"]:
    ddp_worker(sys.argv[2:])
