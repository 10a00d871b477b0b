"""Replicas placed by measured stage times (``[pipeline] balance = "measured"``) against placement by
parameters, with one stage on slow machines: samples per second of a pipelined step, same run.

    flock /tmp/bench.lock .venv/bin/python bench/measured_balance.py [--members 6] [--slow 0.05] [--steps 8] [--json]

``--members`` libp2p hosts on 127.0.0.1 in this process (``p2ptrain.testing.connected_hosts``), a
3-stage ``transformer_lm`` (its embedding; one block; the other block and the head). Every replica
of stage 1 runs on a "slow machine": each of its FORWARDs and BACKWARDs keeps it busy ``--slow``
seconds before it computes, one request at a time (as a replica of a heterogeneous run takes longer
than its parameters say). Each driver (stage 0) drives ``--micro`` microbatches a step, four in flight (the runtime's
IN_FLIGHT), ends each step with ``Driver.finish``.

1. *By parameters*: the assignment plans settle on by the stages' parameter counts
   (``protocol.assign`` from nothing, then plan after plan until nobody moves): ``--steps`` steps.
2. The drivers' timed entries, as the runtime computes them (``HopDeadlines.stage_micros`` of each
   driver, ``protocol.median_micros``, ``protocol.measured_costs``), then the plans by those costs
   (``assign`` with ``MOVE_MARGIN``, one move a plan) until nobody moves: how many plans that took.
3. *Measured*: that assignment, fresh hosts, ``--steps`` steps.

Printed: each placement's replicas per stage, samples/s over the steps after the first (samples: 2
per microbatch, every driver's), the ratio measured / by parameters, the median times and the plans
it took. A measure of placement only: the cut and the model are the same.

``--recut`` measures ``balance = "recut"`` (docs/pipeline.md, "Re-cutting by measured time") instead:
a 4-block model whose blocks 1 and 2 are slow *layers* (each one's forward and backward take
``--slow`` seconds more, on whichever member computes it: arithmetic the cut by parameters puts all
in stage 1, far over the others' time per parameter), and a third placement, same run: 4. the cut
the same median times give (``protocol.measured_cut``) and the plans by the new stages' costs
(``stage_costs``) from the measured placement, fresh hosts, ``--steps`` steps. Both ratios are
against the placement by parameters. With as many members as stages no placement can help; only
the cut can.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F
import trio

from p2ptrain.models import build_model
from p2ptrain.net import Channel
from p2ptrain.pipeline import Driver, HopDeadlines, partition, partition_at, StageReplica, Wiring
from p2ptrain.protocol import assign, measured_costs, measured_cut, median_micros
from p2ptrain.protocol._recut import stage_costs
from p2ptrain.protocol._stage_costs import MOVE_MARGIN
from p2ptrain.task import load_task, parameter_cut
from p2ptrain.run._spans import HOP_TIMEOUT_S
from p2ptrain.run._stages import HOP_CEILING_S, HOP_INITIAL_S, IN_FLIGHT
from p2ptrain.testing import connected_hosts, slow_layers
from p2ptrain.wire.activations import decode_frame, Kind

LM = {"vocab_size": 50, "context": 8, "width": 16, "depth": 2, "heads": 2}
STAGES = 3
SLOW_BLOCKS = ("blocks.1", "blocks.2")  # under --recut: the slow layers (stage 1 of the cut by parameters; testing.slow_layers)
# Under --recut: the task whose plans the third placement follows (its model is LM at depth 4).
RECUT_TASK = """\
name = "recut-bench"
[model]
name = "transformer_lm"
kwargs = {{ {kwargs} }}
[dataset]
manifest = "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o"
[optimizer]
name = "sgd"
lr = 0.1
[training]
batch_size = 2
total_steps = 100
[peers]
min = 3
[pipeline]
stages = 3
balance = "recut"
"""


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class SlowMachine(StageReplica):
    """A replica of stage 1 on a slow machine: each FORWARD and BACKWARD keeps it busy ``slow``
    seconds first, one request at a time (a machine computes one at a time)."""

    def __init__(self, *args, slow: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.slow, self.busy = slow, trio.Lock()

    async def handle(self, channel: Channel, data: bytes) -> bool:
        frame = decode_frame(data)
        if frame.stage == 1 and frame.kind in (Kind.FORWARD, Kind.BACKWARD):
            async with self.busy:
                await trio.sleep(self.slow)
        return await super().handle(channel, data)


def settle(members: Sequence[str], costs: Sequence[float], margin: float, start: dict | None = None) -> tuple[dict, int]:
    """The assignment plans reach from ``start`` (one move a plan) and how many plans changed it."""
    previous, plans = start, 0
    while (out := assign(members, costs, previous, margin=margin)) != previous:
        previous, plans = out, plans + 1
    return out, plans


async def run_placement(placement: dict[str, int], args: argparse.Namespace,
                        cut: Sequence[int] | None = None) -> tuple[float, list[tuple[int, ...]]]:
    """Samples/s of ``--steps`` steps under ``placement`` ({"m<i>": stage}) and each driver's stage
    times; the model cut at ``cut`` (None: by parameters)."""
    members = sorted(placement)
    async with connected_hosts(len(members)) as hosts:
        ids = {m: h.id for m, h in zip(members, hosts, strict=True)}
        drivers = [m for m in members if placement[m] == 0]
        senders = [ids[m] for m in drivers]
        rings = {s: [ids[m] for m in members if placement[m] == s] for s in range(1, STAGES)}
        replicas, runs = [], []
        for m, h in zip(members, hosts, strict=True):
            model = build_model("transformer_lm", LM, seed=3)
            stages = partition(model, STAGES) if cut is None else partition_at(model, cut)
            if placement[m] == 0:
                deadlines = HopDeadlines(HOP_TIMEOUT_S, ceiling=max(HOP_TIMEOUT_S, HOP_CEILING_S),
                                         initial=max(HOP_TIMEOUT_S, HOP_INITIAL_S))
                wiring = Wiring(rings, random.Random(len(runs)))
                runs.append(Driver(h.host, stages[0], lm_loss, wiring, cut=stages, hop_timeout=HOP_TIMEOUT_S,
                                   deadlines=deadlines))
            else:
                replica = SlowMachine(h.host, stages[placement[m]], lm_loss, senders=senders,
                                      slow=0.0 if args.recut else args.slow)
                replica.serve()
                replicas.append(replica)
        g = torch.Generator().manual_seed(7)
        times = []
        for step in range(1, args.steps + 1):
            began = time.perf_counter()
            for r in replicas:
                r.new_step(step)

            async def drive(rank: int, driver: Driver) -> None:
                driver.new_step(step)
                t = torch.randint(0, LM["vocab_size"], (2 * args.micro, LM["context"] + 1), generator=g)
                limiter = trio.CapacityLimiter(IN_FLIGHT)

                async def one(i: int) -> None:
                    async with limiter:
                        x, y = t[2 * i : 2 * i + 2, :-1], t[2 * i : 2 * i + 2, 1:]
                        await driver.microbatch((rank << 24) | i, x, y, 1 / (args.micro * len(runs)))

                async with trio.open_nursery() as nursery:
                    for i in range(args.micro):
                        nursery.start_soon(one, i)
                await driver.finish()

            async with trio.open_nursery() as nursery:
                for rank, driver in enumerate(runs):
                    nursery.start_soon(drive, rank, driver)
            times.append(time.perf_counter() - began)
        samples = 2 * args.micro * len(runs) * (len(times) - 1)
        return samples / sum(times[1:]), [d.deadlines.stage_micros(STAGES) for d in runs]


async def main(args: argparse.Namespace) -> None:
    if args.recut:
        LM["depth"] = 4
    members = [f"m{i}" for i in range(args.members)]
    parameters = [s.parameter_count() for s in partition(build_model("transformer_lm", LM, seed=3), STAGES)]
    by_parameters, _ = settle(members, parameters, 1.0)
    base, timed = await run_placement(by_parameters, args)
    micros = median_micros(timed, STAGES)
    costs = measured_costs(parameters, micros)
    assert costs is not None, "nothing was measured"
    measured, plans = settle(members, costs, MOVE_MARGIN, by_parameters)
    got, _ = await run_placement(measured, args)
    recut: dict = {}
    if args.recut:
        task = load_task(RECUT_TASK.format(kwargs=", ".join(f"{k} = {v}" for k, v in LM.items())))
        cut = measured_cut(task, parameter_cut(task), micros)
        assert cut is not None, f"the times {micros} move no cut"
        new_costs = stage_costs(task, cut, micros, None)
        assert new_costs is not None
        placed, moves = settle(members, new_costs, MOVE_MARGIN, measured)
        rate, _ = await run_placement(placed, args, cut)
        recut = {"cut": list(cut), "replicas": [sum(1 for s in placed.values() if s == stage) for stage in range(STAGES)],
                 "samples_per_s": round(rate, 2), "plans": moves, "ratio": round(rate / base, 3)}

    def counts(p: dict[str, int]) -> list[int]:
        return [sum(1 for s in p.values() if s == stage) for stage in range(STAGES)]

    result = {"members": args.members, "slow_s": args.slow, "parameters": parameters,
              "by_parameters": {"replicas": counts(by_parameters), "samples_per_s": round(base, 2)},
              "measured": {"replicas": counts(measured), "samples_per_s": round(got, 2), "plans": plans},
              "micros": list(micros), "ratio": round(got / base, 3), **({"recut": recut} if recut else {})}
    if args.json:
        print(json.dumps(result))
        return
    slow = (f"{' and '.join(SLOW_BLOCKS)} slow layers (+{args.slow} s each way)" if args.recut
            else f"stage 1 on slow machines (+{args.slow} s a hop)")
    print(f"stage parameters {parameters}; {slow}; median times {list(micros)} us")
    print(f"by parameters: replicas {counts(by_parameters)}: {base:.1f} samples/s")
    print(f"measured:      replicas {counts(measured)} after {plans} plan(s): {got:.1f} samples/s  x{got / base:.2f}")
    if recut:
        print(f"re-cut {recut['cut']}: replicas {recut['replicas']} after {recut['plans']} more plan(s): "
              f"{recut['samples_per_s']:.1f} samples/s  x{recut['ratio']:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=6)
    parser.add_argument("--slow", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--recut", action="store_true", help='a slow layer, and the cut balance = "recut" moves')
    arguments = parser.parse_args()
    with slow_layers(dict.fromkeys(SLOW_BLOCKS, arguments.slow) if arguments.recut else {}):
        trio.run(main, arguments)
