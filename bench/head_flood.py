"""Steps/s of a training run under a flood of forged heads and of head requests (issue 27).

    PYTHONPATH=$PWD .venv/bin/python bench/head_flood.py [--window 20] [--json]

Three real `p2ptrain node start` processes on loopback train the digits task of bench/chaos.py (one
thread each); a hostile peer (bench/hostile.py) connected to all three then sends, one phase after
another in the same run, ``--repeat`` times: nothing, forged heads of the run's task (signed by
itself, v999, 1,024 members: ~57 KB each) at 131/s, nothing, head requests at 2,600/s; then nothing
once more. Each phase lasts ``--window`` seconds; steps/s is the top step the members report, over
the phase. A flood's cost is its steps/s against the mean of the quiet phases on either side (the
median over the repeats is reported); the nodes' CPU and drop counters say where the time and the
messages went.
"""

from __future__ import annotations

import argparse
import json
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
from p2ptrain.net import control_ops
from p2ptrain.wire.topics import TASKS_TOPIC


async def phase(cluster: chaos.Cluster, seconds: float, attack: Any = None) -> dict[str, Any]:
    """Steps/s over ``seconds`` (while ``attack()`` runs, if given: it is bounded by the same
    seconds), the nodes' CPU (% of one core, summed) and this process's (the attacker's)."""
    out: dict[str, Any] = {}
    first = chaos.top_step(await chaos.statuses(cluster))
    cpu0, own0 = sum(chaos.cpu_s(p) or 0 for p in cluster.procs), time.process_time()
    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        async def run() -> None:
            out["sent"] = await attack()

        if attack is not None:
            nursery.start_soon(run)
        await trio.sleep(seconds)
    elapsed = trio.current_time() - started
    last = chaos.top_step(await chaos.statuses(cluster))
    cpu1, own1 = sum(chaos.cpu_s(p) or 0 for p in cluster.procs), time.process_time()
    out.update(steps_per_s=round((last - first) / elapsed, 2), nodes_cpu_pct=round(100 * (cpu1 - cpu0) / elapsed),
               attacker_cpu_pct=round(100 * (own1 - own0) / elapsed))
    return out


async def counters(cluster: chaos.Cluster) -> dict[str, Any]:
    """What each node's pubsub and router dropped and delivered (node status)."""
    out = {}
    for p in cluster.alive():
        status = await chaos.call(p, control_ops.STATUS)
        messages = (status or {}).get("messages", {})
        out[cluster.name(p)] = {k: messages.get(k) for k in ("dropped", "dropped_below_router", "delivered")}
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="flood-", dir="/tmp") as tmp:
        with chaos.Cluster(Path(tmp), 3, [*chaos.NODE_ARGS]) as cluster:
            await cluster.wait_ready(cluster.procs)
            await chaos.start_training(cluster, join_others=True)
            async with hostile.hostile_peer() as peer:
                ids = [await peer.connect(p.addr) for p in cluster.procs]
                await peer.wait_in_topic(TASKS_TOPIC, ids)
                await trio.sleep(args.window / 2)  # the run settles (first checkpoints)
                w, task, reps = args.window, cluster.task_cid, args.repeat
                rates = hostile_bounds.HEAD_FLOOD_RATE, hostile_bounds.HEAD_REQUEST_RATE
                # Signed before the clock starts: the attacker's CPU does not set the pace.
                heads = hostile_bounds.head_flood(peer, task, int(rates[0] * w * reps))
                requests = hostile_bounds.head_request_flood(peer, task, int(rates[1] * w * reps))
                per = len(heads) // reps, len(requests) // reps
                phases: list[dict[str, Any]] = [{"name": "quiet", **await phase(cluster, w)}]
                for i in range(reps):
                    flood = heads[i * per[0]:(i + 1) * per[0]]
                    phases.append({"name": "heads", **await phase(cluster, w, lambda: hostile.send_paced(peer, flood, rates[0]))})
                    phases.append({"name": "quiet", **await phase(cluster, w)})
                    asks = requests[i * per[1]:(i + 1) * per[1]]
                    phases.append({"name": "requests", **await phase(cluster, w, lambda: hostile.send_paced(peer, asks, rates[1]))})
                    phases.append({"name": "quiet", **await phase(cluster, w)})
                drops = await counters(cluster)
            survived = not cluster.unexpected_exits()
    ratios: dict[str, list[float]] = {"heads": [], "requests": []}
    for i, p in enumerate(phases):
        if p["name"] != "quiet":  # against the mean of the quiet phases on either side
            quiet = (phases[i - 1]["steps_per_s"] + phases[i + 1]["steps_per_s"]) / 2
            ratios[p["name"]].append(round(p["steps_per_s"] / quiet, 3) if quiet else 0.0)
    return {
        "command": " ".join(["bench/head_flood.py", *sys.argv[1:]]),
        "machine": chaos.machine(),
        "ratios": ratios,
        "median_ratio": {k: statistics.median(v) for k, v in ratios.items()},
        "phases": phases,
        "bytes_each": {"heads": len(heads[0].data), "requests": len(requests[0].data)},
        "nodes": drops,
        "survived": survived,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=float, default=20.0, help="seconds per phase (default 20)")
    parser.add_argument("--repeat", type=int, default=3, help="flood phases of each kind, between quiet ones (default 3)")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()
    report = trio.run(main_async, args)
    print(json.dumps(report, indent=None if args.json else 2))
    return 0 if report["survived"] else 1


if __name__ == "__main__":
    sys.exit(main())
