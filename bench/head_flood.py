"""What a flood of forged heads or of head requests costs (issue 27).

    PYTHONPATH=$PWD .venv/bin/python bench/head_flood.py [--window 10] [--repeat 3] [--json]
    PYTHONPATH=$PWD .venv/bin/python bench/head_flood.py --idle [--window 10]

A hostile peer (bench/hostile.py) sends forged heads of a run's task (signed by itself, v999, 1,024
members: ~57 KB each) at 131/s, or head requests for it at 2,600/s: the rates of issue 27. Each
flood is a process of its own (``--attack``: a fresh identity, its own connections, its messages
signed before the flood starts), so what one flood leaves behind in the attacker (a node may hold a
flooder's writes back, and a closed libp2p host keeps threads) does not weigh on the next phase;
``sent`` says what it got out, ``attacker_cpu_pct`` what it used.

Default: three real `p2ptrain node start` processes on loopback train the digits task of
bench/chaos.py (one thread each); one phase after another in the same run, ``--repeat`` times:
nothing, heads, nothing, requests; then nothing once more. Each phase lasts ``--window`` seconds;
steps/s is the top step the members report over the phase, and a flood's cost its steps/s against
the mean of the quiet phases on either side (the median over the repeats is reported), and
``adjusted_ratios``: against what the quiet phases predict for the neighbours' CPU of the same
seconds (:func:`load_adjusted`; ``quiet`` lists the quiet phases' own, the precision).

``--idle``: one node process that trains nothing, and the CPU it spends (% of one core) while idle,
under each flood, idle again: what the flood itself costs a node, free of the run's own noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

import chaos
import hostile
import hostile_bounds
from p2ptrain.control import ops as control_ops
from p2ptrain.wire import TASKS_TOPIC

RATES = {"heads": hostile_bounds.HEAD_FLOOD_RATE, "requests": hostile_bounds.HEAD_REQUEST_RATE}
# --idle: a task nobody runs (the messages are the same whatever task they name)
IDLE_TASK = "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o"
ATTACKER_READY_S = 300.0  # start, connect, sign a window's messages: seconds on a loaded box


def proc_cpu_s(pid: int) -> float:
    """CPU seconds process ``pid`` has used (user + system), from /proc (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_cpu_s() -> float:
    """CPU seconds the whole machine has been busy (all CPUs: user, nice, system, irq, softirq,
    steal), from /proc/stat: with the nodes' own, what the rest of a shared machine used."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    return sum(int(fields[i]) for i in (0, 1, 2, 5, 6, 7)) / os.sysconf("SC_CLK_TCK")


async def attack(kind: str, task_cid: str, seconds: float, targets: list[str]) -> None:
    """``--attack``: connect to ``targets``, sign ``seconds`` of ``kind``, print ``ready``, wait for a
    line on stdin, flood, print what was sent (one JSON line)."""
    async with hostile.hostile_peer() as peer:
        ids = [await peer.connect(addr) for addr in targets]
        await peer.wait_in_topic(TASKS_TOPIC, ids)
        count = int(RATES[kind] * seconds)
        make = hostile_bounds.head_flood if kind == "heads" else hostile_bounds.head_request_flood
        msgs = make(peer, task_cid, count)
        print("ready", flush=True)
        await trio.to_thread.run_sync(sys.stdin.readline)
        sent = await hostile.send_paced(peer, msgs, RATES[kind], seconds)
        print(json.dumps({**sent, "bytes_each": len(msgs[0].data)}), flush=True)
    os._exit(0)  # a closed host leaves threads behind: do not wait for them


async def flood_phase(cluster: chaos.Cluster, kind: str, task_cid: str, seconds: float, training: bool
                      ) -> dict[str, Any]:
    """One flood by a fresh attacker process, measured like a quiet phase."""
    cmd = [sys.executable, __file__, "--attack", kind, "--task", task_cid, "--window", str(seconds),
           *[p.addr for p in cluster.procs]]
    log = cluster.base / "attacker.log"
    proc = chaos.piped(cmd, stdin=True, log=log)
    line = ""
    try:
        assert proc.stdin is not None and proc.stdout is not None
        out, into = proc.stdout, proc.stdin
        with trio.move_on_after(ATTACKER_READY_S):
            line = await trio.to_thread.run_sync(out.readline, abandon_on_cancel=True)
        if line.strip() != "ready":
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise RuntimeError(f"the attacker did not start in {ATTACKER_READY_S:g} s: {line!r}\n{tail}")
        cpu0 = proc_cpu_s(proc.pid)

        async def go() -> Any:
            print(f"[head_flood {time.strftime('%H:%M:%S')}] {kind} flood starts", file=sys.stderr, flush=True)
            into.write("go\n")
            into.flush()
            return json.loads(await trio.to_thread.run_sync(out.readline, abandon_on_cancel=True))

        measured = await phase(cluster, seconds, go, training)
        measured["attacker_cpu_pct"] = round(100 * (proc_cpu_s(proc.pid) - cpu0) / seconds, 1)
        measured["others_cpu_pct"] = round(measured["others_cpu_pct"] - measured["attacker_cpu_pct"], 1)
        return measured
    finally:
        proc.kill()
        await trio.to_thread.run_sync(proc.wait)


async def phase(cluster: chaos.Cluster, seconds: float, flood: Any = None, training: bool = True) -> dict[str, Any]:
    """Steps/s over ``seconds`` (while ``flood()`` runs, if given), the nodes' CPU (% of one
    core, summed) and the rest of the machine's (``others_cpu_pct``: the neighbours on a shared
    machine, and the bench; a flood phase takes the attacker's out)."""
    cpu0, started = sum(chaos.cpu_s(p) or 0 for p in cluster.procs), trio.current_time()
    machine0 = machine_cpu_s()
    if training:
        rate, sent = await chaos.steps_per_s(cluster, seconds, flood)
    else:
        rate, sent = 0.0, await flood() if flood is not None else await trio.sleep(seconds)
    elapsed = trio.current_time() - started
    cpu1, machine1 = sum(chaos.cpu_s(p) or 0 for p in cluster.procs), machine_cpu_s()
    return {"sent": sent, "steps_per_s": round(rate, 2), "nodes_cpu_pct": round(100 * (cpu1 - cpu0) / elapsed, 1),
            "others_cpu_pct": round(100 * (machine1 - machine0 - (cpu1 - cpu0)) / elapsed, 1)}


async def counters(cluster: chaos.Cluster) -> dict[str, Any]:
    """What each node's pubsub and router dropped and delivered (node status)."""
    out = {}
    for p in cluster.alive():
        messages = ((await chaos.call(p, control_ops.STATUS)) or {}).get("messages", {})
        out[cluster.name(p)] = {k: messages.get(k) for k in ("dropped", "dropped_below_router", "delivered")}
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    w, reps, training = args.window, 1 if args.idle else args.repeat, not args.idle
    with tempfile.TemporaryDirectory(prefix="flood-", dir="/tmp") as tmp:
        if args.keep:  # the nodes' homes and logs stay for a look afterwards
            tmp = tempfile.mkdtemp(prefix="flood-", dir=args.keep)
        with chaos.Cluster(Path(tmp), 1 if args.idle else 3, [*chaos.NODE_ARGS]) as cluster:
            await cluster.wait_ready(cluster.procs)
            task = IDLE_TASK
            if training:
                await chaos.start_training(cluster, join_others=True)
                task = cluster.task_cid
                await trio.sleep(w / 2)  # the run settles (first checkpoints)
            phases = [{"name": "quiet", **await phase(cluster, w, training=training)}]
            for _ in range(reps):
                for kind in ("heads", "requests"):
                    phases.append({"name": kind, **await flood_phase(cluster, kind, task, w, training)})
                    phases.append({"name": "quiet", **await phase(cluster, w, training=training)})
            drops = await counters(cluster)
            survived = not cluster.unexpected_exits()
    out: dict[str, Any] = {"command": " ".join(["bench/head_flood.py", *sys.argv[1:]]), "machine": chaos.machine()}
    if args.idle:
        out["idle_node_cpu_pct"] = {p["name"] if p["name"] != "quiet" else f"quiet_{i // 2}": p["nodes_cpu_pct"]
                                    for i, p in enumerate(phases)}
    else:
        ratios: dict[str, list[float]] = {"heads": [], "requests": []}
        for i, p in enumerate(phases):
            if p["name"] != "quiet":  # against the mean of the quiet phases on either side
                quiet = (phases[i - 1]["steps_per_s"] + phases[i + 1]["steps_per_s"]) / 2
                ratios[p["name"]].append(round(p["steps_per_s"] / quiet, 3) if quiet else 0.0)
        out.update(ratios=ratios, median_ratio={k: statistics.median(v) for k, v in ratios.items()})
        adjusted = load_adjusted(phases)
        if adjusted is not None:
            out.update(adjusted_ratios=adjusted, median_adjusted_ratio={k: statistics.median(v) for k, v in adjusted.items()})
    out.update(phases=phases, nodes=drops, survived=survived)
    return out


def load_adjusted(phases: list[dict[str, Any]]) -> dict[str, list[float]] | None:
    """Each flood's steps/s against what the run's quiet phases predict for the neighbours' CPU
    of its own seconds: a least-squares line of steps/s on ``others_cpu_pct`` through the quiet
    phases. On a shared machine the neighbours move steps/s more than a flood does (quiet phases
    of one run at 5-33 steps/s); the quiet phases' own scatter about the line is the precision.
    None with fewer than 3 quiet phases or no spread in the neighbours' CPU among them."""
    quiet = [(p["others_cpu_pct"], p["steps_per_s"]) for p in phases if p["name"] == "quiet"]
    if len(quiet) < 3:
        return None
    try:
        slope, intercept = statistics.linear_regression(*zip(*quiet))
    except statistics.StatisticsError:
        return None
    out: dict[str, list[float]] = {"quiet": [], "heads": [], "requests": []}
    for p in phases:
        predicted = intercept + slope * p["others_cpu_pct"]
        out[p["name"]].append(round(p["steps_per_s"] / predicted, 3) if predicted > 0 else 0.0)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=float, default=10.0, help="seconds per phase (default 10)")
    parser.add_argument("--repeat", type=int, default=3, help="floods of each kind, between quiet phases (default 3)")
    parser.add_argument("--idle", action="store_true", help="one idle node: the CPU each flood costs it")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--keep", metavar="DIR", help="keep the nodes' homes and logs in a new folder under DIR")
    parser.add_argument("--attack", choices=sorted(RATES), help=argparse.SUPPRESS)  # one flood's process
    parser.add_argument("--task", help=argparse.SUPPRESS)
    parser.add_argument("targets", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.attack:
        trio.run(attack, args.attack, args.task, args.window, args.targets)
        return 0
    report = trio.run(run, args)
    print(json.dumps(report, indent=None if args.json else 2))
    return 0 if report["survived"] else 1


if __name__ == "__main__":
    sys.exit(main())
