"""Time to a target accuracy across an emulated WAN (``bench/wan.py --train``): p2ptrain (top-k 1%,
dense, and local-SGD with 2-bit sparse pseudo-gradients), ``p2ptrain.Optimizer`` in a user's loop
(top-k 1%, bench/wan_user_worker.py), torch DDP over gloo, and hivemind 1.1.12's
``hivemind.Optimizer``; each peer in its own network namespace behind the same ``--rate`` link, same
task, same model, same per-peer batch.

The task is bench/train.py's (scikit-learn digits, an MLP 64-H-H-10, Adam at lr 0.02 with the
demo's cosine schedule); every peer reads the same shards of the same dataset (p2ptrain's members
fetch theirs by CID; DDP's ranks read them from the store they were built in; hivemind's peers from
arrays exported from it: hivemind runs in a venv of its own and cannot import p2ptrain).
Accuracy is on the dataset's test split: p2ptrain's at its checkpoints (a confirmed record), DDP's
and hivemind's every ``--eval-every`` steps (default 1: they stop at the first step at the target).

Two clocks for every run, in ``time_to_target_from_launch_s`` and
``time_to_target_from_first_step_s``:
- from launch: processes started to the target. DDP: its ranks' process start, imports and
  ``init_process_group`` included; hivemind: its processes and DHT start; p2ptrain: the node
  processes' start to a connected mesh (measured once, added to each of its runs), then the task's
  publication, the members' joins and shard fetches over the WAN, the election and the first plan.
- from the first step: DDP's and hivemind's first step (after their barrier), p2ptrain's first plan
  (the coordinator's log) to the target.
``time_to_target_s`` keeps the meaning it had: p2ptrain from the task's publication, DDP and
hivemind from their first step.

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
import datetime
import tempfile
import time
from pathlib import Path
from typing import Any

import train as train_bench  # bench/train.py: the task text and the p2ptrain run (bench/ is on sys.path)

from p2ptrain.data import build_dataset, load_source
from p2ptrain.base import UserError
from p2ptrain.ipfs import EmbeddedStore
from p2ptrain.node import NODE_ARGS
from p2ptrain.control import ControlClient
from p2ptrain.testing import IFACE, emulated_wan, wait_for, wan_node_processes

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
USER_PORT = 4101  # p2ptrain.Optimizer's members listen here, each inside its own namespace
POLL_S = 0.25  # how often the bench asks the publisher's node for the run's confirmed chain
# After the target, the bench cancels the run; members settle their last span's checkpoint first
# (leading.CANCEL_SETTLE_S, 20 s) and the next run waits for them.
CANCEL_WAIT_S = 60.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--train")
    group.add_argument("--hidden", type=int, default=512, help="width of the MLP's two hidden layers")
    group.add_argument("--batch", type=int, default=64, help="batch per peer per step")
    group.add_argument("--steps", type=int, default=150, help="the task's total steps (the most any run takes)")
    group.add_argument("--checkpoint", type=int, default=10, help="p2ptrain sync runs: steps between checkpoints")
    group.add_argument("--eval-every", type=int, default=1,
                       help="DDP and hivemind: steps (epochs) between evaluations (1: they stop at the first step at the target)")
    group.add_argument("--skip-hivemind", action="store_true")
    group.add_argument("--hivemind-timeout", type=float, default=RUN_TIMEOUT_S,
                       help="seconds of hivemind training before it counts as not reaching the target")
    group.add_argument("--skip-user-loop", action="store_true",
                       help="no p2ptrain.Optimizer run (a user's loop, bench/wan_user_worker.py)")
    group.add_argument("--skip-node-run", action="store_true", help="no node-run p2ptrain runs")
    group.add_argument("--skip-dense", action="store_true", help="no p2ptrain dense run")
    group.add_argument("--skip-ddp", action="store_true", help="no DDP run (a run too long to share one lock with hivemind's)")
    group.add_argument("--lsgd-inner", type=int, default=10,
                       help="p2ptrain local-SGD run: inner steps H per round (0: no local-SGD run)")
    group.add_argument("--lsgd-density", type=float, default=0.01, help="its pseudo-gradient's top-k share (2-bit values)")
    group.add_argument("--no-overlap", action="store_true",
                       help="p2ptrain tasks without [training] overlap_checkpoints (for nodes of a release before it)")
    group.add_argument("--logs", type=Path, default=None,
                       help="copy each p2ptrain node's log here (node0.log, ...) before the work folder goes")
    group.add_argument("--lsgd-steps", type=int, default=30, help="its outer steps at most (one checkpoint each)")


class WanCluster:
    """What bench/train.py's task texts need of a cluster: the homes and a control call."""

    def __init__(self, homes: list[Path]) -> None:
        self.homes = homes

    def call(self, home: Path, op: str, **params: Any) -> dict[str, Any]:
        return ControlClient(home, timeout=120.0).call(op, **params)


def task_args(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(steps=args.steps, checkpoint=args.checkpoint, peers=args.peers, hidden=args.hidden,
                              batch=args.batch, sync_interval=1, timeout=RUN_TIMEOUT_S)


def overlap(text: str, args: argparse.Namespace) -> str:
    """The task with its checkpoints settling while the next span trains (docs/training.md), unless
    ``--no-overlap``: nodes of a release before the field refuse a task that names it."""
    return text if args.no_overlap else text.replace("[training]\n", "[training]\noverlap_checkpoints = true\n", 1)


def progress(what: str, row: dict | None = None) -> None:
    """A line on stderr as each part ends: a run cut short still leaves its finished rows."""
    print(f"wan_train {time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}: {what}"
          + (f" {json.dumps(row)}" if row is not None else ""), file=sys.stderr, flush=True)


def log_stamps(homes: list[Path], name: str, day: float) -> dict[str, list[float]]:
    """Wall-clock stamps of a task's start from the nodes' logs (logs.TEXT_FORMAT, local HH:MM:SS.mmm
    on the day of ``day``): every member's "joined", the first "coordinator of term", the first plan."""
    marks = {"joined": ": joined;", "elected": ": coordinator of term", "first_plan": ": plan rounds 0-"}
    midnight = datetime.datetime.fromtimestamp(day).replace(hour=0, minute=0, second=0, microsecond=0).timestamp()
    found: dict[str, list[float]] = {key: [] for key in marks}
    for home in homes:
        log = home / "logs" / "node.log"
        for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
            if f"task {name} (" not in line:
                continue
            for key, mark in marks.items():
                if mark in line:
                    h, m, rest = line[:12].split(":")
                    found[key].append(midnight + 3600 * int(h) + 60 * int(m) + float(rest))
    return {key: sorted(v) for key, v in found.items()}


def run_p2p_task(cluster: WanCluster, text: str, name: str, nodes_up_s: float) -> dict:
    """Publish ``text`` (task ``name``), wait for a confirmed checkpoint at the target, cancel the run.

    Clocks: ``time_to_target_s`` from the publication (this key's meaning since the bench was
    written), ``from_launch_s`` adds the nodes' own start (``nodes_up_s``: processes launched to a
    connected mesh), ``from_first_step_s`` from the first plan (the coordinator's log) on. The target
    is seen when the publisher's ``task status`` shows a confirmed record at it (polled every
    POLL_S): a model every member attested, not one member's evaluation.
    """
    first = cluster.homes[0]
    published = time.time()
    task_cid = cluster.call(first, "task.publish", text=text, join=True)["task_cid"]
    hit = None
    status: dict[str, Any] = {}
    while hit is None:
        try:
            status = cluster.call(first, "task.status", task_cid=task_cid)
        except UserError:  # not heard of yet
            status = {}
        for record in status.get("chain", []):
            if record["metrics"].get("accuracy", 0) >= TARGET_ACCURACY:
                hit = (time.time(), record["step"], record["metrics"]["accuracy"])
                break
        if hit is None and status.get("state") in ("done", "failed", "cancelled"):
            break
        if time.time() - published > RUN_TIMEOUT_S:
            break
        if hit is None:
            time.sleep(POLL_S)
    statuses = [cluster.call(h, "task.status", task_cid=task_cid) for h in cluster.homes]
    if statuses[0].get("state") not in ("done", "cancelled", "failed"):
        cluster.call(first, "task.cancel", task_cid=task_cid)
        deadline = time.time() + CANCEL_WAIT_S
        while time.time() < deadline and not all(
                cluster.call(h, "task.status", task_cid=task_cid).get("state") in ("done", "cancelled", "failed")
                for h in cluster.homes):
            time.sleep(POLL_S)
    stamps = log_stamps(cluster.homes, name, published)
    first_plan = stamps["first_plan"][0] if stamps["first_plan"] else None
    members = [s for s in statuses if s.get("rounds_done")]
    rounds = sum(s["rounds_done"] for s in members) or 1
    best = max((r["metrics"].get("accuracy", 0) for r in statuses[0].get("chain", [])), default=None)
    row = {
        "time_to_target_s": hit and round(hit[0] - published, 2),
        "from_launch_s": hit and round(nodes_up_s + hit[0] - published, 2),
        "from_first_step_s": hit and first_plan and round(hit[0] - first_plan, 2),
        "steps": hit[1] if hit else None,
        "final_accuracy": hit[2] if hit else best,
        "start_s": {key: round(v[-1 if key == "joined" else 0] - published, 2) if v else None
                    for key, v in stamps.items()},
        "nodes_up_s": round(nodes_up_s, 2),
        "compute_ms_per_round": round(1000 * sum(s["compute_s"] + s["apply_s"] for s in members) / rounds, 1),
        "sync_ms_per_round": round(1000 * sum(s["sync_s"] for s in members) / rounds, 1),
        "bytes_per_peer_per_step": round(sum(s["bytes_sent"] for s in members) / rounds),
    }
    progress(f"p2ptrain {name} ({time.time() - published:.1f} s with its cancel)", row)
    return row


def dataset_only(home0: Path) -> str:
    """The digits dataset in ``home0``'s store (8 train shards); its manifest."""
    home0.mkdir(parents=True, mode=0o700)
    name, features, labels = load_source("sklearn:digits")
    manifest, _ = build_dataset(EmbeddedStore(home0), name, features, labels, num_shards=8)
    return manifest


def run_p2ptrain(args: argparse.Namespace, workdir: Path) -> tuple[str, dict[str, dict]]:
    """p2ptrain's runs (sync 1%, sync dense, local-SGD) one after the other on the same node
    processes in the namespaces; the dataset's manifest."""
    manifest = dataset_only(workdir / "node0")
    with emulated_wan(args.peers, args.rate) as wan:
        launched = time.time()
        with wan_node_processes(wan, workdir, extra_args=NODE_ARGS, ready_timeout=NODE_READY_TIMEOUT_S) as procs:
            wait_for(lambda: min(len(p.status()["peers"]) for p in procs) >= args.peers - 1, 120, interval=0.2)
            nodes_up_s = time.time() - launched
            progress(f"p2ptrain nodes up in {nodes_up_s:.1f} s")
            cluster = WanCluster([p.home for p in procs])
            targs = task_args(args)
            sync_text = overlap(train_bench.task_text(manifest, 0.01, targs, "wan-sync-1pct"), args)
            runs = {"p2ptrain": run_p2p_task(cluster, sync_text, "wan-sync-1pct", nodes_up_s)}
            if not args.skip_dense:
                text = overlap(train_bench.task_text(manifest, 1.0, targs, "wan-sync-dense"), args)
                runs["p2ptrain_dense"] = run_p2p_task(cluster, text, "wan-sync-dense", nodes_up_s)
            if args.lsgd_inner:
                text = train_bench.local_sgd_text(sync_text, args.lsgd_inner, args.lsgd_density, "2bit", "average",
                                                  args.lsgd_steps, 1).replace('"wan-sync-1pct"', '"wan-lsgd"')
                row = run_p2p_task(cluster, text, "wan-lsgd", nodes_up_s)
                row.update(inner_steps=args.lsgd_inner, outer_steps=row.pop("steps"),
                           bytes_per_peer_per_round=row.pop("bytes_per_peer_per_step"),
                           compute_ms_per_outer_round=row.pop("compute_ms_per_round"),
                           sync_ms_per_outer_round=row.pop("sync_ms_per_round"))
                runs["p2ptrain_local_sgd"] = row
            if args.logs is not None:
                args.logs.mkdir(parents=True, exist_ok=True)
                for i, proc in enumerate(procs):
                    log = proc.home / "logs" / "node.log"
                    if log.exists():
                        shutil.copyfile(log, args.logs / f"node{i}.log")
    return manifest, runs


# ---- p2ptrain.Optimizer in a user's loop, one member per namespace ------------------------------------


def run_user_loop(args: argparse.Namespace, task_file: Path, store_home: Path, workdir: Path) -> dict:
    """The members of bench/wan_user_worker.py (a user's script around ``p2ptrain.Optimizer``), one
    per namespace, top-k 1% as the node-run sync run; the target is seen as for a node-run task (a
    confirmed record at it in member 0's ``task status``), then the members are stopped.

    Clocks: from launch (the processes started) and from member 0's first ``opt.step()``."""
    from p2ptrain.base import load_or_create_identity, peer_id_of

    worker = Path(__file__).resolve().parent / "wan_user_worker.py"
    homes = [workdir / f"user{i}" for i in range(args.peers)]
    ids = []
    for home in homes:
        home.mkdir(parents=True, mode=0o700)
        ids.append(peer_id_of(load_or_create_identity(home)).to_base58())
    with emulated_wan(args.peers, args.rate) as wan:
        addrs = [f"/ip4/{wan[i].ip}/tcp/{USER_PORT}" for i in range(args.peers)]
        logs = [open(home / "script.log", "w") for home in homes]  # noqa: SIM115 (the members hold them)
        launched = time.time()
        procs = [wan[i].popen([sys.executable, str(worker), "--home", str(homes[i]), "--listen", addrs[i],
                               "--bootstrap", *[f"{addrs[j]}/p2p/{ids[j]}" for j in range(args.peers) if j != i],
                               "--member", str(i), "--members", str(args.peers), "--task", str(task_file),
                               "--store", str(store_home), "--density", "0.01", "--checkpoint", str(args.checkpoint)],
                              stdout=subprocess.PIPE, stderr=logs[i], text=True)
                 for i in range(args.peers)]
        try:
            line = procs[0].stdout.readline()
            if not line.startswith('{"started"'):
                raise SystemExit(f"user loop: member 0 did not take part: {(homes[0] / 'script.log').read_text()[-3000:]}")
            run_cid = json.loads(line)["run_cid"]
            client = ControlClient(homes[0], timeout=120.0)
            hit, status = None, {}
            while hit is None and time.time() - launched < RUN_TIMEOUT_S:
                if any(p.poll() is not None for p in procs):
                    if all(p.poll() == 0 for p in procs):
                        break  # the run reached its last step (RunFinished) short of the target
                    raise SystemExit(f"user loop: a member failed: {(homes[0] / 'script.log').read_text()[-3000:]}")
                try:
                    status = client.call("task.status", task_cid=run_cid)
                except UserError:  # member 0 is leaving: the run is over
                    continue
                for record in status.get("chain", []):
                    if record["metrics"].get("accuracy", 0) >= TARGET_ACCURACY:
                        hit = (time.time(), record["step"], record["metrics"]["accuracy"])
                        break
                if hit is None:
                    time.sleep(POLL_S)
            statuses = [_status_or_empty(h, run_cid) for h in homes]
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
            for log in logs:
                log.close()
    first_step = json.loads((homes[0] / "first_step.json").read_text())["wall"]
    members = [s for s in statuses if s.get("rounds_done")]
    rounds = sum(s["rounds_done"] for s in members) or 1
    best = max((r["metrics"].get("accuracy", 0) for r in status.get("chain", [])), default=None)
    return {
        "from_launch_s": hit and round(hit[0] - launched, 2),
        "from_first_step_s": hit and round(hit[0] - first_step, 2),
        "time_to_target_s": hit and round(hit[0] - first_step, 2),
        "steps": hit[1] if hit else None,
        "final_accuracy": hit[2] if hit else best,
        "start_s": {"first_step": round(first_step - launched, 2)},
        "compute_ms_per_round": round(1000 * sum(s["compute_s"] + s["apply_s"] for s in members) / rounds, 1),
        "sync_ms_per_round": round(1000 * sum(s["sync_s"] for s in members) / rounds, 1),
        "bytes_per_peer_per_step": round(sum(s["bytes_sent"] for s in members) / rounds),
    }


def _status_or_empty(home: Path, task_cid: str) -> dict[str, Any]:
    try:
        return ControlClient(home, timeout=120.0).call("task.status", task_cid=task_cid)
    except UserError:  # that member's run is over and its node gone
        return {}


# ---- torch DDP over gloo, one rank per namespace ------------------------------------------------------


def run_ddp(args: argparse.Namespace, task_file: Path, store_home: Path) -> dict:
    """The ranks of bench/wan_ddp_worker.py, one per namespace; rank 0's result with both clocks."""
    worker = Path(__file__).resolve().parent / "wan_ddp_worker.py"
    with emulated_wan(args.peers, args.rate) as wan:
        launched = time.time()
        procs = [wan[i].popen([sys.executable, str(worker), str(i), str(args.peers), wan[0].ip, str(task_file),
                               str(store_home), str(args.eval_every), str(TARGET_ACCURACY), IFACE, str(GLOO_PORT)],
                              stdout=subprocess.PIPE, text=True) for i in range(args.peers)]
        outs = [proc.communicate(timeout=RUN_TIMEOUT_S)[0] for proc in procs]
    line = next((ln for ln in outs[0].splitlines() if ln.startswith("RESULT ")), None)
    if line is None or any(p.returncode for p in procs):
        raise SystemExit("a DDP rank failed")
    result = json.loads(line[7:])
    wall = result.pop("wall")
    result.update(
        from_launch_s=wall["target"] and round(wall["target"] - launched, 2),
        from_first_step_s=result["time_to_target_s"],
        start_s={"imports": round(wall["imported"] - launched, 2), "process_group": round(wall["group_up"] - launched, 2),
                 "first_step": round(wall["first_step"] - launched, 2)},
    )
    return result


# ---- hivemind.Optimizer, one peer per namespace -----------------------------------------------------

HIVEMIND_WORKER = r'''
import json, sys, time
import numpy as np, torch, hivemind
rank, world, ip, data, hidden, batch, steps, checkpoint, target, lr, matchmaking, timeout = sys.argv[1:13]
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
first_step_wall = time.time()
started, reached, accuracy, local, evaluated = time.perf_counter(), None, 0.0, 0, 0
while opt.local_epoch < steps and time.perf_counter() - started < float(timeout):
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
                                          "bytes_per_peer_per_step": volume,
                                          "wall": {"first_step": first_step_wall, "target": time.time()}}),
                  flush=True)
            break
if rank == 0 and reached is None:
    print("RESULT " + json.dumps({"time_to_target_s": None, "steps": opt.local_epoch, "local_steps": local,
                                  "final_accuracy": accuracy, "bytes_per_peer_per_step": volume,
                                  "wall": {"first_step": first_step_wall, "target": None}}), flush=True)
sys.stdout.flush()
import os; os._exit(0)
'''


def export_arrays(manifest: str, store_home: Path, peers: int, out: Path) -> None:
    """Each rank's train shards and the test split as numpy arrays, for a process without p2ptrain."""
    import numpy as np

    from p2ptrain.data import IPFSDataset

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
        launched = time.time()

        def start(i: int) -> subprocess.Popen[str]:
            return wan[i].popen([str(python), str(script), str(i), str(args.peers), wan[i].ip, str(data),
                                 str(args.hidden), str(args.batch), str(args.steps), str(args.eval_every),
                                 str(TARGET_ACCURACY), "0.02", str(HIVEMIND_MATCHMAKING_S),
                                 str(args.hivemind_timeout)],
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
    result = json.loads(line[7:])
    wall = result.pop("wall")
    result.update(from_launch_s=wall["target"] and round(wall["target"] - launched, 2),
                  from_first_step_s=result["time_to_target_s"],
                  start_s={"first_step": round(wall["first_step"] - launched, 2)})
    return result


def task_file_1pct(manifest: str, args: argparse.Namespace, workdir: Path) -> Path:
    """The sync 1% task's file (its model, data, batch, optimizer and schedule are what the user's
    script reads; its checkpoints and density it passes to p2ptrain.Optimizer)."""
    path = workdir / "task-1pct.toml"
    path.write_text(train_bench.task_text(manifest, 0.01, task_args(args), "wan-user-loop"))
    return path


def train_race(args: argparse.Namespace) -> dict:
    """Every run, one after another; ``time_to_target_s`` per system (each on its own clock, as
    since the bench was written: p2ptrain from the task's publication, DDP from its first step,
    hivemind from its first step) and the comparable clocks, ``time_to_target_from_launch_s``
    (processes launched to the target) and ``time_to_target_from_first_step_s``; each run's details."""
    workdir = Path(tempfile.mkdtemp(prefix="p2ptrain-wan-train-"))
    load = {"before": round(os.getloadavg()[0], 2)}
    try:
        if args.skip_node_run:
            manifest, runs = dataset_only(workdir / "node0"), {}
        else:
            manifest, runs = run_p2ptrain(args, workdir)
        load["after_p2ptrain"] = round(os.getloadavg()[0], 2)
        home0 = workdir / "node0"
        task_file = workdir / "task.toml"
        task_file.write_text(train_bench.task_text(manifest, 1.0, task_args(args), "bench-ddp"))
        if not args.skip_user_loop:
            try:
                runs["p2ptrain_optimizer"] = run_user_loop(args, task_file_1pct(manifest, args, workdir), home0, workdir)
            except SystemExit as exc:  # the other systems' runs still count
                runs["p2ptrain_optimizer"] = {"error": str(exc)[-2000:], "from_launch_s": None, "from_first_step_s": None,
                                              "time_to_target_s": None}
            progress("p2ptrain.Optimizer", runs["p2ptrain_optimizer"])
            load["after_user_loop"] = round(os.getloadavg()[0], 2)
        if not args.skip_ddp:
            runs["ddp"] = run_ddp(args, task_file, home0)
            progress("ddp", runs["ddp"])
            load["after_ddp"] = round(os.getloadavg()[0], 2)
        if not args.skip_hivemind:
            data = workdir / "arrays.npz"
            export_arrays(manifest, home0, args.peers, data)
            runs["hivemind"] = run_hivemind(args, data, workdir)
            progress("hivemind", runs["hivemind"])
            load["after_hivemind"] = round(os.getloadavg()[0], 2)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    launch = {name: run["from_launch_s"] for name, run in runs.items()}
    first = {name: run["from_first_step_s"] for name, run in runs.items()}

    def ratios(clock: dict[str, float | None], base: str) -> dict[str, float | None]:
        return {name: round(t / clock[base], 3) if t and clock.get(base) else None
                for name, t in clock.items() if name.startswith("p2ptrain")}

    return {"target_accuracy": TARGET_ACCURACY, "model": f"mlp 64-{args.hidden}-{args.hidden}-10",
            "parameters": runs.get("ddp", {}).get("parameters"), "batch_per_peer": args.batch, "load_avg_1m": load,
            "time_to_target_s": {name: run["time_to_target_s"] for name, run in runs.items()},
            "time_to_target_from_launch_s": launch, "time_to_target_from_first_step_s": first,
            "ratio_to_ddp": {"from_launch": ratios(launch, "ddp"), "from_first_step": ratios(first, "ddp")},
            "ratio_to_hivemind": {"from_launch": ratios(launch, "hivemind"),
                                  "from_first_step": ratios(first, "hivemind")},
            "train_runs": runs}
