"""``p2ptrain.Optimizer`` in a user's own loop against the node-run task: time per step, same run.

Both sides train the identical model (a registry builder, built with
``p2ptrain.training.models.build_model``), on the same data (scikit-learn's digits, one dataset
manifest, each member reading the train shards of its rank), with the same optimizer, batch per
member, top-k density, checkpoint interval and number of members, on loopback:

- **node-run**: N ``p2ptrain node start`` processes (:class:`p2ptrain.cli.demo.Cluster`); the first
  publishes the task and all join; each node computes its gradients itself;
- **user loop**: N processes of this script (``--worker``, started with
  ``p2ptrain.testing.script_members``), each an ordinary PyTorch loop over ``DataLoader(IPFSDataset(...))``
  with ``p2ptrain.Optimizer`` wrapping ``torch.optim.Adam(fused=True)`` (the kernel the node-run
  task's optimizer uses; ``--unfused``: torch's default); each runs its own in-process node.

Both are timed the same way, from outside: the driver polls member 0's ``task status`` (its control
socket) and takes the wall time from the first status at step ``--warmup`` or later to the first
at step ``--warmup + --window`` or later, over the steps between them. Startup, meeting and joining
are before the window; checkpoints inside it (elections, signatures, attestations, the test-set
evaluation) count on both sides. The members' processes' CPU time (user + system, every thread,
from /proc) over the same window, per step, is the second measure: on a shared 2-core machine the
wall time moves with other users' load, the CPU a step costs much less. Repetitions alternate
the sides (node, user, node, user, ...) so that a change in the machine's load falls on both; the
ratio is user / node of the medians, and each repetition's pair is printed too.

    .venv/bin/python bench/user_loop.py [--members 3] [--hidden 64] [--batch 32] [--density 0.01]
                                        [--warmup 20] [--window 100] [--checkpoint 25] [--reps 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from p2ptrain.cli.demo import Cluster
from p2ptrain.data import build_dataset
from p2ptrain.data import load_source
from p2ptrain.base import UserError
from p2ptrain.ipfs import EmbeddedStore
from p2ptrain.node import NODE_ARGS
from p2ptrain.control import ops as control_ops
from p2ptrain.control import ControlClient
from p2ptrain.testing import last_json, script_members, start_script

THREADS = int(NODE_ARGS[NODE_ARGS.index("--threads") + 1])  # the user's processes get what the nodes get
LR = 0.003
START_S = 300.0  # members started, met and at the window's first step within this (a loaded machine)
POLL_S = 0.05


def model_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {"in_features": 64, "hidden": args.hidden, "out_features": 10}


def total_steps(args: argparse.Namespace) -> int:
    return args.warmup + args.window + 5  # the run goes on past the window: its end is not timed


def task_text(manifest: str, args: argparse.Namespace, name: str) -> str:
    kwargs = model_kwargs(args)
    return f"""\
name = "{name}"
seed = 0

[model]
name = "mlp"
kwargs = {{ in_features = {kwargs['in_features']}, hidden = {kwargs['hidden']}, out_features = 10 }}

[dataset]
manifest = "{manifest}"

[optimizer]
name = "adam"
lr = {LR}

[training]
batch_size = {args.batch}
total_steps = {total_steps(args)}
checkpoint_interval = {args.checkpoint}

[compression]
density = {args.density}
error_feedback = true

[peers]
min = {args.members}
max = {args.members}
"""


def dataset(store_home: Path) -> str:
    """Digits into ``store_home``'s embedded store (the same bytes, so the same manifest CID, each time)."""
    store_home.mkdir(parents=True, exist_ok=True, mode=0o700)
    name, features, labels = load_source("sklearn:digits")
    manifest, _ = build_dataset(EmbeddedStore(store_home), name, features, labels, num_shards=8)
    return manifest


# -- timing, the same for both sides --------------------------------------------------------------


def cpu_s(procs: list[subprocess.Popen[str]]) -> float:
    """CPU seconds (user + system, all threads) the members' processes have used so far."""
    total = 0
    for proc in procs:
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    return total / os.sysconf("SC_CLK_TCK")


def time_window(home: Path, task_cid: str, args: argparse.Namespace, procs: list[subprocess.Popen[str]]) -> dict:
    """Poll member 0's status of ``task_cid``: wall time per step from step ``warmup`` to
    ``warmup + window``, the members' CPU time per step over the same span, and member 0's own
    split of it (compute / sync)."""
    client = ControlClient(home, timeout=30.0)
    deadline = time.monotonic() + START_S
    first: tuple[float, int, dict] | None = None
    while True:
        if any(p.poll() is not None for p in procs):
            raise SystemExit(f"a member exited during the window (see {home})")
        before = time.monotonic()
        try:
            status = client.call(control_ops.TASK_STATUS, task_cid=task_cid)
        except UserError:  # not in the task yet
            status = {}
        now = (before + time.monotonic()) / 2
        step = int(status.get("step") or 0)
        if first is None and step >= args.warmup:
            first = (now, step, status)
            cpu0 = cpu_s(procs)
            deadline = now + args.timeout
        if first is not None and step >= args.warmup + args.window:
            t0, s0, st0 = first
            cpu = cpu_s(procs) - cpu0
            rounds = status["rounds_done"] - st0["rounds_done"]
            compute = (status["compute_s"] + status["apply_s"]) - (st0["compute_s"] + st0["apply_s"])
            sync = status["sync_s"] - st0["sync_s"]
            return {"step_ms": round(1000 * (now - t0) / (step - s0), 2), "steps": step - s0,
                    "cpu_ms_per_step": round(1000 * cpu / (step - s0), 2),
                    "window_s": round(now - t0, 1),
                    "member0_compute_ms": round(1000 * compute / rounds, 2) if rounds else None,
                    "member0_sync_ms": round(1000 * sync / rounds, 2) if rounds else None}
        if time.monotonic() > deadline:
            raise SystemExit(f"member 0 at step {step} (state {status.get('state')}) after the time allowed")
        time.sleep(POLL_S)


# -- node-run side ----------------------------------------------------------------------------------


def run_nodes(workdir: Path, args: argparse.Namespace, rep: int) -> dict:
    cluster = Cluster(workdir / f"nodes{rep}", args.members)
    try:
        manifest = dataset(cluster.homes[0])
        cluster.start(ready_timeout=START_S)
        first = cluster.homes[0]
        task_cid = cluster.call(first, control_ops.TASK_PUBLISH, text=task_text(manifest, args, f"bench-nodes-{rep}"),
                                join=True)["task_cid"]  # the others accept it (--accept-tasks)
        procs = [p.proc for p in cluster.procs if p.proc is not None]
        return time_window(first, task_cid, args, procs)
    finally:
        cluster.stop()


# -- user-loop side ---------------------------------------------------------------------------------


def run_users(workdir: Path, manifest: str, data_home: Path, args: argparse.Namespace, rep: int) -> dict:
    members = script_members(args.members, workdir / f"users{rep}")
    worker = ["--worker", "--manifest", manifest, "--data-home", str(data_home), "--run", f"bench-users-{rep}",
              *passed_args(args)]
    procs = [start_script(__file__, m, worker) for m in members]
    try:
        run_cid = started(procs[0], members[0].home)
        return time_window(members[0].home, run_cid, args, procs)
    finally:
        for proc in procs:  # the run's end is not timed: leave now
            proc.kill()
            proc.wait()


def passed_args(args: argparse.Namespace) -> list[str]:
    return [*([] if args.fused else ["--unfused"]), "--hidden", *map(str, args.hidden), "--batch", str(args.batch),
            "--density", str(args.density), "--warmup", str(args.warmup), "--window", str(args.window),
            "--checkpoint", str(args.checkpoint)]


def started(proc: subprocess.Popen[str], home: Path) -> str:
    """The run CID member 0 prints once it takes part."""
    assert proc.stdout is not None
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"member 0 exited before taking part: {(home / 'script.log').read_text()[-3000:]}")
        if line.startswith('{"started"'):
            return str(last_json(line)["run_cid"])
    raise SystemExit("member 0 did not take part in time")


def worker(args: argparse.Namespace) -> None:
    """One member: an ordinary PyTorch loop with p2ptrain.Optimizer (started by run_users)."""
    import torch
    from torch import nn

    import p2ptrain
    from p2ptrain.models import build_model

    torch.set_num_threads(THREADS)
    store = EmbeddedStore(Path(args.data_home))
    train = p2ptrain.IPFSDataset(args.manifest, split="train", rank=args.member, world_size=args.members,
                                 store=store, seed=args.member)
    test_x, test_y = map(torch.stack, zip(*p2ptrain.IPFSDataset(args.manifest, split="test", store=store,
                                                                 shuffle=False)))

    def evaluate(model: nn.Module) -> dict[str, float]:
        with torch.no_grad():
            out = model(test_x)
            return {"accuracy": float((out.argmax(1) == test_y).float().mean()),
                    "loss": float(nn.functional.cross_entropy(out, test_y))}

    model = build_model("mlp", model_kwargs(args), seed=0)
    loader = torch.utils.data.DataLoader(train, batch_size=args.batch, drop_last=True)
    opt = p2ptrain.Optimizer(torch.optim.Adam(model.parameters(), lr=LR, fused=args.fused), model=model, run=args.run,
                             home=args.home, listen=[args.listen], bootstrap=args.bootstrap, density=args.density,
                             checkpoint_every=args.checkpoint, min_peers=args.members, max_peers=args.members,
                             total_steps=total_steps(args), evaluate=evaluate)
    print(json.dumps({"started": args.member, "run_cid": opt.run_cid}), flush=True)
    with opt:
        try:
            epoch = 0
            while True:
                train.set_epoch(epoch)
                for x, y in loader:
                    opt.zero_grad()
                    loss = nn.functional.cross_entropy(model(x), y)
                    loss.backward()
                    opt.step(loss=loss)
                epoch += 1
        except p2ptrain.RunFinished:
            pass


# -- the run ----------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--members", type=int, default=3)
    parser.add_argument("--hidden", type=int, nargs="+", default=[64], help="the mlp's hidden widths")
    parser.add_argument("--batch", type=int, default=32, help="batch per member per step")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--warmup", type=int, default=20, help="steps before the timed window")
    parser.add_argument("--window", type=int, default=100, help="steps timed")
    parser.add_argument("--checkpoint", type=int, default=25, help="steps between confirmed models")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each side, alternating")
    parser.add_argument("--timeout", type=float, default=600.0, help="bound on one timed window (s)")
    parser.add_argument("--unfused", dest="fused", action="store_false",
                        help="the user's Adam with torch's default (single-tensor) kernel; the node-run task's is fused")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep homes and logs (the path is printed)")
    # A worker (one user-loop member), as p2ptrain.testing.start_script starts it.
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for flag in ("--home", "--listen", "--manifest", "--data-home", "--run"):
        parser.add_argument(flag, help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap", nargs="*", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--member", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    workdir = Path(tempfile.mkdtemp(prefix="p2ptrain-bench-user-loop-"))
    load = [round(os.getloadavg()[0], 2)]
    nodes: list[dict] = []
    users: list[dict] = []
    try:
        data_home = workdir / "data"
        manifest = dataset(data_home)
        for rep in range(args.reps):
            nodes.append(run_nodes(workdir, args, rep))
            load.append(round(os.getloadavg()[0], 2))
            users.append(run_users(workdir, manifest, data_home, args, rep))
            load.append(round(os.getloadavg()[0], 2))
            if not args.json:
                print(f"rep {rep}: node-run {nodes[-1]['step_ms']:.1f} ms/step, user loop {users[-1]['step_ms']:.1f} "
                      f"ms/step (x{users[-1]['step_ms'] / nodes[-1]['step_ms']:.2f}); load {load[-2:]}", flush=True)
            else:
                print(json.dumps({"rep": rep, "node_run": nodes[-1], "user_loop": users[-1], "load": load[-2:]}),
                      file=sys.stderr, flush=True)
    finally:
        if args.keep:
            print(f"homes and logs kept in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    node_ms = statistics.median(r["step_ms"] for r in nodes)
    user_ms = statistics.median(r["step_ms"] for r in users)
    result = {"members": args.members, "model": f"mlp 64-{'-'.join(map(str, args.hidden))}-10", "batch": args.batch,
              "density": args.density, "window": args.window, "checkpoint": args.checkpoint,
              "load_average": load, "node_run": nodes, "user_loop": users,
              "node_run_median_ms": node_ms, "user_loop_median_ms": user_ms, "ratio": round(user_ms / node_ms, 3),
              "ratio_per_rep": [round(u["step_ms"] / n["step_ms"], 3) for n, u in zip(nodes, users)],
              "node_run_cpu_median_ms": statistics.median(r["cpu_ms_per_step"] for r in nodes),
              "user_loop_cpu_median_ms": statistics.median(r["cpu_ms_per_step"] for r in users)}
    result["cpu_ratio"] = round(result["user_loop_cpu_median_ms"] / result["node_run_cpu_median_ms"], 3)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.members} members, {result['model']}, batch {args.batch}/member, density {args.density}, "
          f"{args.window} steps timed after {args.warmup}, checkpoint every {args.checkpoint}; load {load}")
    print(f"median: node-run {node_ms:.1f} ms/step, user loop {user_ms:.1f} ms/step: x{result['ratio']:.2f} "
          f"(per rep {result['ratio_per_rep']})")
    print(f"CPU time of the members' processes per step (all members): node-run {result['node_run_cpu_median_ms']:.1f} ms, "
          f"user loop {result['user_loop_cpu_median_ms']:.1f} ms: x{result['cpu_ratio']:.2f}")
    for label, rows in (("node-run", nodes), ("user loop", users)):
        print(f"{label}: member 0's own split per step (compute+apply / sync, ms): "
              + ", ".join(f"{r['member0_compute_ms']}/{r['member0_sync_ms']}" for r in rows))


if __name__ == "__main__":
    main()
