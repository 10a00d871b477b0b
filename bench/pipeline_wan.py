"""Pipeline stages (issue 31) across an emulated WAN: p2ptrain's nodes against
``torch.distributed.pipelining``, same model, same stages, same links, same session.

    flock /tmp/p2ptrain-bench.lock .venv/bin/python bench/pipeline_wan.py [--rate 100mbit]
        [--stages 4] [--replicas 2] [--width 128] [--depth 8] [--context 64] [--vocab 256] [--heads 4]
        [--batch 16] [--micro 4] [--activations int8] [--steps 24] [--no-baseline] [--json]
        [--stage-sum dense|sparse|both] [--density 0.01] [--baseline-steps N] [--baseline-reps R]

**p2ptrain**: S x R ``p2ptrain node start`` processes, each in its own network namespace behind a
``--rate`` link both ways (:func:`p2ptrain.testing.emulated_wan`), join one pipelined task (a
``transformer_lm`` of the given size, ``[pipeline] stages = S``, ``activations``), published by the
first node: what a user runs, elections, plans, stage protocol, per-stage gradient sums and
checkpoints included. ``--stage-sum``: how each stage's replicas sum their gradients (``[pipeline]
stage_sum``: ``dense``, the exact fp32 sum, as the baseline's all-reduce; ``sparse``, top-k with
error feedback at ``--density``; ``both``: a dense run, then a sparse one, after the same baseline).
The global batch is ``--batch`` samples a step, as the baseline's: each driver
(a replica of stage 0; the plan makes R of them) reads ``--batch / R`` of its shard per step, in
microbatches of ``--micro``. Random tokens (seed 0), as the baseline's. Tokens/s is counted from the
first node's ``task status`` polled every ``POLL_S``: (global batch x context) per step, from the
first time a step >= ``WARMUP_STEPS`` is seen to the last step seen before the run is done, over
the time between (so the run's start, the joins and the first plan are not counted). Over the same
steps, ``nodes_cpu_s_per_step``: the CPU seconds all node processes used per step (/proc), what a
step costs the machine whatever else runs on it; ``sent_bytes_per_step``: what the interfaces of
all the namespaces sent per step (IP and TCP headers included, as the baseline's measured bytes),
``busiest_sent_bytes_per_step`` the most one member sent; ``losses``: the step's loss as the first
node's ``task status`` showed it at each step it saw (the same data and seed in every run of one
invocation, so a dense and a sparse run compare at equal tokens); ``hop_failures``, ``hop_timeouts``
and ``failed_steps``: from the nodes' logs over the whole run, the drivers' hops rerouted, those
of them that ran past their deadline, and the steps a driver failed (retried: work thrown away).

**Baseline**: bench/pipeline_baseline.py ``--wan RATE`` with the same model, stages, replicas, batch
and microbatches, run first, in the same session (``--no-baseline`` skips it). Its tokens/s is the
median of its timed blocks; the ratio printed is p2ptrain's over it (the issue's target: >= 1 at
100 Mbit/s). Every process of either side shares this machine's cores, so both are CPU-bound here
well before the links are; the load averages are printed with the figures.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from p2ptrain.base import UserError
from p2ptrain.control import ControlClient
from p2ptrain.data import build_dataset
from p2ptrain.ipfs import EmbeddedStore
from p2ptrain.node import NODE_ARGS
from p2ptrain.testing import emulated_wan, wait_for, wan_node_processes

BENCH = Path(__file__).resolve().parent
# S x R node processes importing torch and libp2p at once on a shared 2-core machine: minutes.
NODE_READY_TIMEOUT_S = 300.0
MESH_TIMEOUT_S = 180.0
CONTROL_TIMEOUT_S = 120.0
POLL_S = 0.5
WARMUP_STEPS = 2  # steps before the clock starts (the first plan, the streams' first dials)
RUN_TIMEOUT_S = 1200.0
SAMPLES = 4096  # random token windows in the data set (shards of it go to the drivers)
NETNS_TIMEOUT_S = 10.0

TASK = """\
name = "bench-pipeline-wan-{pid}"
seed = 0
[model]
name = "transformer_lm"
kwargs = {{ vocab_size = {vocab}, context = {context}, width = {width}, depth = {depth}, heads = {heads} }}
[dataset]
manifest = "{manifest}"
[optimizer]
name = "sgd"
lr = 0.1
[training]
batch_size = {per_driver}
total_steps = {steps}
checkpoint_interval = {steps}
[peers]
min = {members}
max = {members}
[pipeline]
stages = {stages}
microbatch_size = {micro}
activations = "{activations}"
check_fraction = 0.0
{stage_sum}"""
SPARSE = """stage_sum = "sparse"
[compression]
density = {density}
"""


def nodes_cpu_s(workdir: Path) -> float:
    """CPU seconds (user + system) used so far by every process whose command line names ``workdir``
    (the run's node processes), from /proc: what the run costs the machine, which moves far less
    than its wall clock with other work on a shared machine."""
    total, tick = 0, os.sysconf("SC_CLK_TCK")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if str(workdir).encode() not in (proc / "cmdline").read_bytes():
                continue
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / tick


def sent_bytes(wan: Any) -> list[int]:
    """Bytes each peer's interface has sent so far (its namespace's /proc/net/dev)."""
    out = []
    for peer in wan:
        text = peer.run(["cat", "/proc/net/dev"], capture_output=True, text=True, timeout=NETNS_TIMEOUT_S).stdout
        line = next(row for row in text.splitlines() if row.split(":")[0].strip() == peer.iface)
        out.append(int(line.partition(":")[2].split()[8]))
    return out


def call(home: Path, op: str, **params: Any) -> dict[str, Any]:
    return ControlClient(home, timeout=CONTROL_TIMEOUT_S).call(op, **params)


def random_tokens(home: Path, args: argparse.Namespace) -> str:
    """A data set of ``SAMPLES`` windows of random tokens (seed 0) and their next-token labels, stored
    in ``home``: its manifest CID."""
    tokens = np.random.default_rng(0).integers(0, args.vocab, size=(SAMPLES, args.context + 1), dtype=np.int64)
    dtype = np.uint8 if args.vocab <= 256 else np.int32
    manifest, _ = build_dataset(EmbeddedStore(home), "random-tokens", tokens[:, :-1].astype(dtype),
                                tokens[:, 1:].astype(dtype), num_shards=2 * args.replicas, test_fraction=0.01)
    return manifest


def p2ptrain_run(args: argparse.Namespace, stage_sum: str) -> dict[str, Any]:
    members = args.stages * args.replicas
    workdir = Path(tempfile.mkdtemp(prefix="p2ptrain-pipeline-wan-"))
    load = [round(os.getloadavg()[0], 2)]
    try:
        home0 = workdir / "node0"
        home0.mkdir(parents=True, mode=0o700)
        manifest = random_tokens(home0, args)
        with emulated_wan(members, args.rate) as wan, \
                wan_node_processes(wan, workdir, extra_args=NODE_ARGS, ready_timeout=NODE_READY_TIMEOUT_S) as procs:
            wait_for(lambda: min(len(p.status()["peers"]) for p in procs) >= members - 1, MESH_TIMEOUT_S, interval=0.5)
            text = TASK.format(pid=os.getpid(), manifest=manifest, members=members, per_driver=args.batch // args.replicas,
                               vocab=args.vocab, context=args.context, width=args.width, depth=args.depth,
                               heads=args.heads, steps=args.steps, stages=args.stages, micro=args.micro,
                               activations=args.activations,
                               stage_sum=SPARSE.format(density=args.density) if stage_sum == "sparse" else "")
            first = procs[0].home
            published = time.monotonic()
            task_cid = call(first, "task.publish", text=text, join=True)["task_cid"]
            start: tuple[float, int] | None = None
            last: tuple[float, int] | None = None
            cpu: list[float] = []  # the nodes' CPU seconds at start, then at last
            sent: list[list[int]] = []  # each namespace's bytes sent at start, then at last
            losses: dict[int, float] = {}
            status: dict[str, Any] = {}
            while status.get("state") not in ("done", "failed", "cancelled"):
                if time.monotonic() - published > args.run_timeout:
                    raise SystemExit(f"the pipelined run did not finish in {args.run_timeout:.0f} s "
                                     f"(at step {status.get('step')})")
                try:
                    status = call(first, "task.status", task_cid=task_cid)
                except UserError:
                    status = {}
                step, now = int(status.get("step") or 0), time.monotonic()
                if status.get("loss") is not None and step:
                    losses.setdefault(step, round(float(status["loss"]), 6))
                if step >= WARMUP_STEPS and start is None:
                    start = (now, step)
                    cpu, sent = [nodes_cpu_s(workdir)], [sent_bytes(wan)]
                if start is not None and step > (last or start)[1]:
                    last = (now, step)
                    cpu[1:], sent[1:] = [nodes_cpu_s(workdir)], [sent_bytes(wan)]
                time.sleep(POLL_S)
            if status.get("state") != "done":
                raise SystemExit(f"the pipelined run ended {status.get('state')}: {status.get('error')}")
            statuses = [call(p.home, "task.status", task_cid=task_cid) for p in procs]
        hop_failures, hop_timeouts, failed_steps, reasons = logged_failures(workdir, members)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    load.append(round(os.getloadavg()[0], 2))
    if start is None or last is None:
        raise SystemExit("too few steps were seen to time (raise --steps)")
    steps, seconds = last[1] - start[1], last[0] - start[0]
    per_member = [(b - a) / steps for a, b in zip(sent[0], sent[-1], strict=True)]
    stages = statuses[0].get("stages") or []
    return {
        "tokens_per_s": round(steps * args.batch * args.context / seconds, 1),
        "nodes_cpu_s_per_step": round((cpu[-1] - cpu[0]) / steps, 3),
        "timed_steps": steps, "timed_s": round(seconds, 1), "wall_s": round(time.monotonic() - published, 1),
        "replicas_per_stage": [len(s["replicas"]) for s in stages],
        "parameters_per_stage": [s["parameters"] for s in stages],
        "bytes_sent_per_member": round(sum(s["bytes_sent"] for s in statuses) / len(statuses)),
        "stage_sum": stage_sum, "density": args.density if stage_sum == "sparse" else None,
        "sent_bytes_per_step": round(sum(per_member)), "busiest_sent_bytes_per_step": round(max(per_member)),
        "losses": losses,
        "phases_s_per_step": phases(statuses),
        "hop_failures": hop_failures, "hop_timeouts": hop_timeouts, "failed_steps": failed_steps,
        "hop_failure_reasons": reasons,
        "load_average": load,
    }


def logged_failures(workdir: Path, members: int) -> tuple[int, int, int, dict[str, int]]:
    """From the nodes' logs (the whole run, warm-up included): the drivers' hops that failed and were
    rerouted (a deadline passed, a channel closed, a bad answer), those of them that ran past their
    deadline, the steps a driver failed (retried by the run: their work thrown away), and
    {why a hop failed (its first 80 characters): times}."""
    hops = timeouts = steps = 0
    reasons: collections.Counter[str] = collections.Counter()
    for i in range(members):
        log = workdir / f"node{i}" / "logs" / "stderr.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        hops += text.count("; rerouting")
        # A timeout's message is empty: logged "()" before the driver named its type.
        timeouts += text.count("(TooSlowError); rerouting") + text.count(" failed (); rerouting")
        steps += text.count("failed at this driver")
        reasons.update(why[:80] for why in re.findall(r" failed \((.*)\); rerouting", text))
    return hops, timeouts, steps, dict(reasons)


def phases(statuses: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Where a step's time went, from every member's ``task status`` (whole run, failed rounds
    included in compute): for the drivers (stage 0) and the other replicas, the mean per round done of
    compute (a driver: its microbatches forward and back and ``finish``; a replica: nothing until
    the summary, which it joins at once), sync (the stage's gradient sum) and apply (the optimizer).
    The step summary's gather is what a step's wall time leaves after these."""
    out: dict[str, dict[str, float]] = {}
    for role, members in (("drivers", [s for s in statuses if s.get("stage") == 0]),
                          ("replicas", [s for s in statuses if (s.get("stage") or 0) > 0])):
        done = [s for s in members if s.get("rounds_done")]
        if done:
            out[role] = {k: round(sum(s[f"{k}_s"] / s["rounds_done"] for s in done) / len(done), 4)
                         for k in ("compute", "sync", "apply")}
    return out


def baseline_run(args: argparse.Namespace) -> dict[str, Any]:
    argv = [sys.executable, str(BENCH / "pipeline_baseline.py"), "--wan", args.rate, "--json"]
    for name in ("stages", "replicas", "width", "depth", "context", "vocab", "heads", "batch", "micro"):
        argv += [f"--{name}", str(getattr(args, name))]
    for name in ("steps", "reps"):
        if getattr(args, f"baseline_{name}") is not None:
            argv += [f"--{name}", str(getattr(args, f"baseline_{name}"))]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if out.returncode:
        raise SystemExit(f"bench/pipeline_baseline.py failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in [("stages", 4), ("replicas", 2), ("width", 128), ("depth", 8), ("context", 64),
                          ("vocab", 256), ("heads", 4), ("batch", 16), ("micro", 4), ("steps", 24)]:
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--rate", default="100mbit", help="each process's link, both ways (tc rate)")
    parser.add_argument("--activations", default="int8", choices=["fp32", "fp16", "int8"])
    parser.add_argument("--no-baseline", action="store_true", help="skip bench/pipeline_baseline.py")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--stage-sum", default="dense", choices=["dense", "sparse", "both"],
                        help="[pipeline] stage_sum of p2ptrain's run(s): both = a dense run, then a sparse one")
    parser.add_argument("--density", type=float, default=0.01, help="[compression] density of a sparse stage sum")
    parser.add_argument("--run-timeout", type=float, default=RUN_TIMEOUT_S,
                        help="seconds a p2ptrain run may take from its publication; with --stage-sum both a run "
                             "past it is reported with its error and the next run goes on")
    parser.add_argument("--baseline-steps", type=int, help="bench/pipeline_baseline.py --steps (its default if absent)")
    parser.add_argument("--baseline-reps", type=int, help="bench/pipeline_baseline.py --reps (its default if absent)")
    args = parser.parse_args()
    if args.batch % (args.replicas * args.micro):
        parser.error(f"--batch {args.batch} does not split into {args.replicas} drivers x microbatches of {args.micro}")
    began = time.strftime("%H:%M:%S", time.gmtime())
    baseline = None if args.no_baseline else baseline_run(args)
    if baseline is not None:  # each side's figures on stderr as soon as it is done: a later side may fail
        print(json.dumps({"baseline": baseline}), file=sys.stderr, flush=True)
    runs: dict[str, dict[str, Any]] = {}
    for how in ("dense", "sparse") if args.stage_sum == "both" else (args.stage_sum,):
        try:
            runs[how] = p2ptrain_run(args, how)
        except SystemExit as exc:
            if args.stage_sum != "both":
                raise
            runs[how] = {"stage_sum": how, "error": str(exc), "tokens_per_s": 0.0}  # the other run still goes
        print(json.dumps({how: runs[how]}), file=sys.stderr, flush=True)
    ours = next(iter(runs.values()))  # "p2ptrain" and "ratio": the first run's, as before --stage-sum
    result: dict[str, Any] = {
        "rate": args.rate, "stages": args.stages, "replicas": args.replicas, "activations": args.activations,
        "model": {k: getattr(args, k) for k in ("vocab", "context", "width", "depth", "heads")},
        "global_batch": args.batch, "micro": args.micro, "utc": [began, time.strftime("%H:%M:%S", time.gmtime())],
        "p2ptrain": ours,
    }
    if len(runs) > 1:
        result["p2ptrain_sparse"] = runs["sparse"]
    if baseline is not None:
        result["baseline"] = {k: baseline.get(k) for k in ("tokens_per_s", "load_avg_1m", "mode", "s_per_step",
                                                           "losses", "single_losses", "bytes_per_step_measured",
                                                           "parameters")}
        result["ratio"] = round(ours["tokens_per_s"] / baseline["tokens_per_s"], 3)
        if len(runs) > 1:
            result["ratio_sparse"] = round(runs["sparse"]["tokens_per_s"] / baseline["tokens_per_s"], 3)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{args.stages} stages x {args.replicas} replicas at {args.rate}, {args.activations} activations, "
          f"global batch {args.batch} x {args.context} tokens")
    for how, run in runs.items():
        if "error" in run:
            print(f"p2ptrain, {how} stage sum: {run['error']}")
            continue
        print(f"p2ptrain, {how} stage sum: {run['tokens_per_s']} tokens/s over {run['timed_steps']} steps "
              f"({run['timed_s']} s), {run['sent_bytes_per_step']:,} B sent a step, load {run['load_average']}; "
              f"{run['hop_failures']} hops rerouted ({run['hop_timeouts']} past their deadline), "
              f"{run['failed_steps']} driver steps failed")
    if baseline is not None:
        print(f"baseline (GPipe over gloo): {baseline['tokens_per_s']} tokens/s, load {baseline.get('load_avg_1m')}")
        print(f"ratio: {result['ratio']}" + (f", sparse: {result['ratio_sparse']}" if len(runs) > 1 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
