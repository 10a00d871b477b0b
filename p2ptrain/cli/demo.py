"""``p2ptrain demo``: the whole mission on one machine, over loopback, with the embedded store.

It starts N peer processes (``p2ptrain node start``), adds scikit-learn's digits as a sharded
dataset, publishes a task (an MLP, top-k sparsified gradients with error feedback), shows the run
live, and when the last model is confirmed, fetches it by CID into a fresh home through the mesh and
reports its test accuracy and loss there; the run is drawn (``task report``) to
p2ptrain-demo-report.png. Nothing is mocked: these are the same processes, messages and
bytes as on a real network.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from p2ptrain.base import UserError, fmt_bytes
from p2ptrain.control import TaskStatus, ops as control_ops
from p2ptrain.task import TASK_TEMPLATE

MESH_TIMEOUT_S = 60.0
POLL_S = 0.5
# Where the demo draws its run (task report), in the folder it was started from.
DEFAULT_REPORT = "p2ptrain-demo-report.png"
# Width of the live line beside the progress bar: the longest usual line ("model v6  loss 0.123  test
# acc 0.880  peers 4  sent 215.1 KiB"), so the bar does not jump as numbers grow or notes go.
STATUS_WIDTH = 64


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = sub.add_parser(
        "demo", help="train on N local peers over loopback, then fetch the model by CID",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--peers", type=int, default=4, help="peer processes to start (default 4)")
    demo.add_argument("--steps", type=int, default=150, help="optimizer steps (rounds) to train (default 150)")
    demo.add_argument("--density", type=float, default=0.01, help="top-k density of the all-reduce (default 0.01)")
    demo.add_argument("--checkpoint-interval", type=int, default=25, help="rounds between published models (default 25)")
    demo.add_argument("--timeout", type=float, default=900.0, help="give up after this many seconds (default 900)")
    demo.add_argument("--workdir", type=Path, default=None, metavar="DIR",
                      help="keep the peers' homes and logs in this (new or empty) folder, and say so at the end "
                      "(default: a temporary folder, removed when the demo ends)")
    demo.add_argument("--report", type=Path, default=Path(DEFAULT_REPORT), metavar="FILE",
                      help=f"draw the run to FILE.png or FILE.html at the end (default {DEFAULT_REPORT}; "
                      "needs matplotlib: pip install 'p2ptrain[report]')")
    demo.add_argument("--no-report", dest="report", action="store_const", const=None, help="draw no report")
    demo.add_argument("--json", action="store_true", help="print one JSON summary object at the end")
    demo.set_defaults(func=cmd_demo)


class Cluster:
    """N ``p2ptrain node start`` processes on loopback (:class:`p2ptrain.node.NodeProcess`), each
    with its own home; all bootstrap from the first."""

    def __init__(self, workdir: Path, n: int) -> None:
        self.workdir = workdir
        self.homes = [workdir / f"peer{i + 1}" for i in range(n)]
        self.procs: list[Any] = []  # local_nodes.NodeProcess

    def call(self, home: Path, op: str, **params: Any) -> dict[str, Any]:
        from p2ptrain.control import ControlClient

        return ControlClient(home, timeout=120.0).call(op, **params)

    def start(self, ready_timeout: float) -> list[str]:
        """Start every peer; return once each sees all the others. Returns the first peer's address."""
        from p2ptrain.node import NODE_ARGS, NodeProcess, free_port

        self.procs = [NodeProcess(h, free_port(), extra_args=NODE_ARGS) for h in self.homes]
        bootstrap = [self.procs[0].addr]
        for proc in self.procs[1:]:
            proc.bootstrap = bootstrap
        for proc in self.procs:
            proc.start()
        try:
            for proc in self.procs:
                proc.wait_ready(ready_timeout)
        except (RuntimeError, TimeoutError) as exc:
            raise UserError(f"a peer did not start: {exc}") from None
        mesh_deadline = time.monotonic() + MESH_TIMEOUT_S
        while True:
            seen = [len(self.call(h, control_ops.STATUS)["peers"]) for h in self.homes]
            if min(seen) >= len(self.homes) - 1:
                return bootstrap
            if time.monotonic() > mesh_deadline:
                raise UserError(f"the mesh did not form in {MESH_TIMEOUT_S:.0f} s (peers seen: {seen})")
            time.sleep(0.2)

    def stop(self) -> None:
        for proc in self.procs:  # SIGTERM them all first, so they stop in parallel
            if proc.proc is not None and proc.proc.poll() is None:
                proc.proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.terminate()
            except subprocess.TimeoutExpired:
                pass  # terminate() has SIGKILLed it


def cmd_demo(args: argparse.Namespace) -> int:
    if args.peers < 2:
        raise UserError("--peers must be at least 2")
    keep = args.workdir is not None
    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="p2ptrain-demo-"))).absolute()
    if keep and workdir.exists() and any(workdir.iterdir()):
        raise UserError(f"--workdir {workdir} is not empty")
    workdir.mkdir(parents=True, exist_ok=True)
    say = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    cluster = Cluster(workdir, args.peers)
    started = time.monotonic()
    try:
        summary = _run(args, cluster, workdir, say)
    finally:
        cluster.stop()
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    summary["seconds"] = round(time.monotonic() - started, 1)
    if args.json:
        print(json.dumps(summary))
    else:
        if keep:
            say(f"homes and logs of the peers kept in {workdir}")
        if summary.get("report"):
            say(f"report of the run: {summary['report']}")
        say(f"done in {summary['seconds']:.0f} s: model {summary['model_cid']}, fetched by CID on a fresh home: "
            f"test accuracy {summary['accuracy']:.3f}, test loss {summary['loss']:.4f}"
            + ("" if summary.get("train_loss") is None else f"; final training loss {summary['train_loss']:.4f}"))
    return 0 if summary["agree"] else 1


def _run(args: argparse.Namespace, cluster: Cluster, workdir: Path, say: Any) -> dict[str, Any]:
    from p2ptrain.data import build_dataset, load_source
    from p2ptrain.ipfs import EmbeddedStore

    deadline = time.monotonic() + args.timeout
    first = cluster.homes[0]
    first.mkdir(mode=0o700, parents=True)
    say(f"[1/5] adding scikit-learn digits as 8 shards to {first.name}'s store")
    name, features, labels = load_source("sklearn:digits")
    manifest_cid, _ = build_dataset(EmbeddedStore(first), name, features, labels, num_shards=8)
    say(f"      dataset manifest {manifest_cid}")

    where = f"homes and logs in {workdir}" if args.workdir is not None else "pass --workdir DIR to keep their logs"
    say(f"[2/5] starting {args.peers} peers on loopback ({where})")
    bootstrap = cluster.start(ready_timeout=max(1.0, deadline - time.monotonic()))
    say(f"      mesh formed: every peer sees the other {args.peers - 1}")

    say("[3/5] publishing the task (MLP, Adam, top-k density %g with error feedback)" % args.density)
    text = TASK_TEMPLATE.format(manifest=manifest_cid, steps=args.steps, checkpoint=args.checkpoint_interval,
                                density=args.density, peers=args.peers)
    task_cid = cluster.call(first, control_ops.TASK_PUBLISH, text=text)["task_cid"]
    say(f"      task {task_cid}")

    say("[4/5] training")
    final = _follow(cluster, task_cid, args.steps, deadline, quiet=args.json)
    model_cid = final[first.name].latest_model_cid
    if model_cid is None:
        raise UserError("the run ended without a confirmed model")
    per_peer = [
        {"peer": name, "peer_id": cluster.call(h, control_ops.STATUS)["peer_id"], "model_cid": final[name].latest_model_cid,
         "version": final[name].version, "bytes_sent": final[name].bytes_sent}
        for name, h in ((h.name, h) for h in cluster.homes)
    ]
    agree = len({p["model_cid"] for p in per_peer}) == 1
    say(f"      final model {model_cid}; all {args.peers} peers hold it: {'yes' if agree else 'NO'}")

    say("[5/5] fetching the model by CID on a fresh home, through the mesh, and evaluating it")
    accuracy, loss = _fetch_and_evaluate(workdir / "fetcher", model_cid, manifest_cid, bootstrap)
    chain = final[first.name].chain
    report = _draw(args.report, first, task_cid, say)
    return {
        "report": report,
        "model_cid": model_cid,
        "accuracy": accuracy,
        "loss": loss,
        "peers": per_peer,
        "num_peers": args.peers,
        "agree": agree,
        "task_cid": task_cid,
        "manifest_cid": manifest_cid,
        "steps": args.steps,
        "density": args.density,
        "versions": len(chain),
        "coordinator_accuracy": chain[-1].metrics.get("accuracy") if chain else None,
        "train_loss": chain[-1].metrics.get("train_loss") if chain else None,
        "bytes_sent": sum(p["bytes_sent"] for p in per_peer),
    }


def _follow(cluster: Cluster, task_cid: str, steps: int, deadline: float, quiet: bool) -> dict[str, TaskStatus]:
    """Show the run live until every peer has the final model confirmed; return each peer's status."""
    from tqdm import tqdm

    live = sys.stderr.isatty() and not quiet
    # Fixed-width fields, so that the bar keeps its width as counts, rate and time left change.
    bar_format = ("{l_bar}{bar}| {n_fmt:>%d}/{total_fmt} [{elapsed}<{remaining:>5}, {rate_fmt:>11}{postfix}]"
                  % len(str(steps)))
    bar = tqdm(total=steps, unit="step", disable=not live, file=sys.stderr, dynamic_ncols=True, bar_format=bar_format,
               postfix="starting ...".ljust(STATUS_WIDTH))
    last_line, last_text = 0.0, ""
    training = False  # the first round is done: the bar's rate counts from here, not from the election
    try:
        while True:
            statuses: dict[str, TaskStatus] = {}
            for home in cluster.homes:
                try:
                    statuses[home.name] = TaskStatus.from_json(
                        cluster.call(home, control_ops.TASK_STATUS, task_cid=task_cid))
                except UserError:
                    continue
            if not statuses:
                raise UserError("no peer answers about the task any more")
            failed = {n: s.error for n, s in statuses.items() if s.state == "failed"}
            if failed:
                raise UserError(f"the task failed on {', '.join(failed)}: {next(iter(failed.values()))}")
            step = max(s.step for s in statuses.values())
            lead = max(statuses.values(), key=lambda s: (s.version, s.step))
            acc = lead.accuracy
            sent = sum(s.bytes_sent for s in statuses.values())
            if step == 0:  # before the first round: say what the peers are doing
                states = sorted({s.state for s in statuses.values()})
                if states == ["training"]:
                    states = ["electing a coordinator" if not lead.coordinator else "coordinator elected"]
                line = f"{', '.join(states)} ..."
            else:
                line = (f"model v{lead.version}  loss {_num(lead.loss)}  test acc {_num(acc)}  "
                        f"peers {len(lead.members)}  sent {fmt_bytes(sent)}")
                if not training:
                    training = True
                    # restart tqdm's clock here, counting from this step: the rate (and the time
                    # left) is of training alone, not of the start and the election before it
                    bar.reset(total=steps)
                    bar.initial = min(step, steps)
            bar.n = min(step, steps)
            bar.set_postfix_str(line.ljust(STATUS_WIDTH), refresh=False)
            bar.refresh()
            text = f"      step {step}/{steps}  {line}"
            if not live and not quiet and time.monotonic() - last_line >= 5.0 and text != last_text:
                last_line, last_text = time.monotonic(), text
                print(text, file=sys.stderr)
            if len(statuses) == len(cluster.homes) and all(s.state == "done" for s in statuses.values()):
                return statuses
            if time.monotonic() > deadline:
                raise UserError(f"the task did not finish in time (step {step} of {steps})")
            time.sleep(POLL_S)
    finally:
        bar.close()


def _draw(output: Path | None, home: Path, task_cid: str, say: Any) -> str | None:
    """Draw the run from the first peer's confirmed chain; the report's path, or None (not asked
    for, or matplotlib missing: the demo's result does not depend on a picture)."""
    if output is None:
        return None
    from p2ptrain.cli.report import load_points, write_report

    try:
        write_report(load_points(home, task_cid), task_cid, output)
    except UserError as exc:
        say(f"      no report: {exc}")
        return None
    return str(output.absolute())


def _fetch_and_evaluate(home: Path, model_cid: str, manifest_cid: str, bootstrap: list[str]) -> tuple[float, float]:
    from p2ptrain.services import ensure_local, split_shards
    from p2ptrain.data import IPFSDataset
    from p2ptrain.ipfs import EmbeddedStore
    from p2ptrain.training import batched, evaluate_batches, load_model

    home.mkdir(mode=0o700)
    ensure_local(home, [model_cid, manifest_cid], bootstrap,
                 then=lambda store: split_shards(store, manifest_cid, "test"))
    store = EmbeddedStore(home)
    module = load_model(model_cid, store=store)
    metrics = evaluate_batches(module, batched(IPFSDataset(manifest_cid, split="test", store=store, shuffle=False), 256))
    return metrics.accuracy, metrics.loss


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:.3f}"

