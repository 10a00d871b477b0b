"""What a flood of forged heads or of head requests costs (issue 27).

    PYTHONPATH=$PWD .venv/bin/python bench/head_flood.py [--window 20] [--repeat 3] [--json]
    PYTHONPATH=$PWD .venv/bin/python bench/head_flood.py --idle [--window 10]

A hostile peer (bench/hostile.py) sends forged heads of a run's task (signed by itself, v999, 1,024
members: ~57 KB each) at 131/s, or head requests for it at 2,600/s: the rates of issue 27.

Default: three real `p2ptrain node start` processes on loopback train the digits task of
bench/chaos.py (one thread each) with the attacker connected to all three; one phase after another
in the same run, ``--repeat`` times: nothing, heads, nothing, requests; then nothing once more.
Each phase lasts ``--window`` seconds; steps/s is the top step the members report over the phase,
and a flood's cost its steps/s against the mean of the quiet phases on either side (the median
over the repeats is reported), with the nodes' CPU and the attacker's.

``--idle``: one node process that trains nothing, and the CPU it spends (% of one core) while idle,
under each flood, idle again: what the flood itself costs a node, free of the run's own noise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

import chaos
import hostile
import hostile_bounds
from p2ptrain.net import control_ops
from p2ptrain.wire.topics import TASKS_TOPIC

RATES = {"heads": hostile_bounds.HEAD_FLOOD_RATE, "requests": hostile_bounds.HEAD_REQUEST_RATE}
# --idle: a task nobody runs (the messages are the same whatever task they name)
IDLE_TASK = "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o"


def floods(peer: hostile.HostilePeer, task_cid: str, seconds: float, repeat: int) -> dict[str, list[list[Any]]]:
    """Each kind's messages for ``repeat`` floods of ``seconds``, signed before any clock starts
    (the attacker's CPU must not set the pace)."""
    made = {"heads": hostile_bounds.head_flood(peer, task_cid, int(RATES["heads"] * seconds * repeat)),
            "requests": hostile_bounds.head_request_flood(peer, task_cid, int(RATES["requests"] * seconds * repeat))}
    # In order: the replay window takes a sender's sequence numbers as they rise.
    return {kind: [msgs[i * (len(msgs) // repeat):(i + 1) * (len(msgs) // repeat)] for i in range(repeat)]
            for kind, msgs in made.items()}


def sender(peer: hostile.HostilePeer, kind: str, msgs: list[Any]) -> Callable[[], Awaitable[Any]]:
    return lambda: hostile.send_paced(peer, msgs, RATES[kind])


async def phase(cluster: chaos.Cluster, seconds: float, attack: Callable[[], Awaitable[Any]] | None = None,
                training: bool = True) -> dict[str, Any]:
    """Steps/s over ``seconds`` (while ``attack()`` runs, if given), the nodes' CPU (% of one core,
    summed) and this process's (the attacker's)."""
    cpu0, own0, started = sum(chaos.cpu_s(p) or 0 for p in cluster.procs), time.process_time(), trio.current_time()
    if training:
        rate, sent = await chaos.steps_per_s(cluster, seconds, attack)
    else:
        rate, sent = 0.0, await attack() if attack is not None else await trio.sleep(seconds)
    elapsed = trio.current_time() - started
    cpu1, own1 = sum(chaos.cpu_s(p) or 0 for p in cluster.procs), time.process_time()
    return {"sent": sent, "steps_per_s": round(rate, 2), "nodes_cpu_pct": round(100 * (cpu1 - cpu0) / elapsed, 1),
            "attacker_cpu_pct": round(100 * (own1 - own0) / elapsed, 1)}


async def counters(cluster: chaos.Cluster) -> dict[str, Any]:
    """What each node's pubsub and router dropped and delivered (node status)."""
    out = {}
    for p in cluster.alive():
        messages = ((await chaos.call(p, control_ops.STATUS)) or {}).get("messages", {})
        out[cluster.name(p)] = {k: messages.get(k) for k in ("dropped", "dropped_below_router", "delivered")}
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    w, reps = args.window, 1 if args.idle else args.repeat
    with tempfile.TemporaryDirectory(prefix="flood-", dir="/tmp") as tmp:
        with chaos.Cluster(Path(tmp), 1 if args.idle else 3, [*chaos.NODE_ARGS]) as cluster:
            await cluster.wait_ready(cluster.procs)
            if not args.idle:
                await chaos.start_training(cluster, join_others=True)
            async with hostile.hostile_peer() as peer:
                ids = [await peer.connect(p.addr) for p in cluster.procs]
                await peer.wait_in_topic(TASKS_TOPIC, ids)
                made = floods(peer, IDLE_TASK if args.idle else cluster.task_cid, w, reps)
                if not args.idle:
                    await trio.sleep(w / 2)  # the run settles (first checkpoints)
                phases = [{"name": "quiet", **await phase(cluster, w, training=not args.idle)}]
                for i in range(reps):
                    for kind in ("heads", "requests"):
                        attack = sender(peer, kind, made[kind][i])
                        phases.append({"name": kind, **await phase(cluster, w, attack, training=not args.idle)})
                        phases.append({"name": "quiet", **await phase(cluster, w, training=not args.idle)})
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
    out.update(phases=phases, nodes=drops, survived=survived,
               bytes_each={kind: len(made[kind][0][0].data) for kind in made})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=float, default=20.0, help="seconds per phase (default 20)")
    parser.add_argument("--repeat", type=int, default=3, help="floods of each kind, between quiet phases (default 3)")
    parser.add_argument("--idle", action="store_true", help="one idle node: the CPU each flood costs it")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()
    report = trio.run(run, args)
    print(json.dumps(report, indent=None if args.json else 2))
    return 0 if report["survived"] else 1


if __name__ == "__main__":
    sys.exit(main())
