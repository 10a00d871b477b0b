"""A replica that stalls its answers just under the driver's hop deadline (red team's H1): what it
costs a pipelined run's steps, with the runtime's deadlines (run/_stages.py: floor HOP_TIMEOUT_S,
first HOP_INITIAL_S, ceiling HOP_CEILING_S).

    .venv/bin/python bench/stage_staller.py [--steps 12] [--micro 8] [--json]

Four libp2p hosts on 127.0.0.1 in this process (``p2ptrain.testing.connected_hosts``): one driver of
a two-stage ``transformer_lm`` and three replicas of stage 1. Each step drives ``--micro``
microbatches (four in flight, as the runtime) and ends with ``Driver.finish`` (HOLDINGS asked of
every replica of the ring). One replica is the *staller*, by mode:

- ``none``: honest (the baseline, same run);
- ``holdings``: answers its hops at once, and each HOLDINGS just under the deadline the driver gives
  it (which it can compute: the floor, or three times its own hop times);
- ``hops``: answers its first step at once (so its deadline stays the floor), then every request just
  under the deadline the driver gives it.

Printed per mode: steps per second over the steps after the first, the ratio to ``none``, the driver's
timeouts, and the replicas the driver accused of stalling (``stragglers``, pipeline/_stragglers.py),
which the bench then leaves out of the next steps' wiring and HOLDINGS as the runtime's next plan
does (one driver: its accusation convicts). Each mode alternates with the baseline in one run. Run
against a version without ``Driver.stragglers``, nothing is accused and nothing left out.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
import torch.nn.functional as F
import trio

from p2ptrain.models import build_model
from p2ptrain.net import Channel
from p2ptrain.pipeline import Driver, HopDeadlines, partition, StageReplica, Wiring
from p2ptrain.run._spans import HOP_TIMEOUT_S
from p2ptrain.run._stages import HOP_CEILING_S, HOP_INITIAL_S, IN_FLIGHT
from p2ptrain.testing import connected_hosts
from p2ptrain.wire.activations import decode_frame, Kind

LM = {"vocab_size": 50, "context": 8, "width": 16, "depth": 2, "heads": 2}
MARGIN = 0.9  # the staller answers after this share of its deadline


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class Staller(StageReplica):
    """A replica of stage 1 that waits ``MARGIN`` of the driver's deadline before it answers what
    its mode says (the driver's deadlines are read here: the best an attacker can estimate)."""

    def __init__(self, *args, mode: str, deadlines: HopDeadlines, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.mode, self.deadlines = mode, deadlines

    async def handle(self, channel: Channel, data: bytes) -> bool:
        kind = decode_frame(data).kind
        stall = (self.mode == "holdings" and kind == Kind.HOLDINGS) or (self.mode == "hops" and self.step > 1)
        if stall:
            size = 0 if kind == Kind.HOLDINGS else len(data)
            await trio.sleep(MARGIN * self.deadlines.deadline(1, self.host.get_id(), size))
        return await super().handle(channel, data)


async def run_mode(mode: str, steps: int, micro: int) -> dict[str, object]:
    torch.manual_seed(0)
    model = build_model("transformer_lm", LM, seed=3)
    s0, s1 = partition(model, 2)
    async with connected_hosts(4) as hosts:
        driver_id = hosts[0].id
        deadlines = HopDeadlines(HOP_TIMEOUT_S, ceiling=max(HOP_TIMEOUT_S, HOP_CEILING_S),
                                 initial=max(HOP_TIMEOUT_S, HOP_INITIAL_S))
        replicas = [StageReplica(h.host, partition(build_model("transformer_lm", LM, seed=3), 2)[1], lm_loss,
                                 senders=[driver_id]) for h in hosts[1:3]]
        staller_cls = Staller if mode != "none" else None
        last = partition(build_model("transformer_lm", LM, seed=3), 2)[1]
        replicas.append(Staller(hosts[3].host, last, lm_loss, senders=[driver_id], mode=mode, deadlines=deadlines)
                        if staller_cls else StageReplica(hosts[3].host, last, lm_loss, senders=[driver_id]))
        for r in replicas:
            r.serve()
        wiring = Wiring({1: [h.id for h in hosts[1:]]}, random.Random(1))
        driver = Driver(hosts[0].host, s0, lm_loss, wiring, cut=[s0, s1], hop_timeout=HOP_TIMEOUT_S, deadlines=deadlines)
        times: list[float] = []
        evicted: list[str] = []
        g = torch.Generator().manual_seed(7)
        for step in range(1, steps + 1):
            began = time.perf_counter()
            driver.new_step(step)
            for r in replicas:
                r.new_step(step)
            t = torch.randint(0, LM["vocab_size"], (2 * micro, LM["context"] + 1), generator=g)
            limiter = trio.CapacityLimiter(IN_FLIGHT)

            async def one(i: int) -> None:
                async with limiter:
                    await driver.microbatch(i, t[2 * i : 2 * i + 2, :-1], t[2 * i : 2 * i + 2, 1:], 1 / micro)

            async with trio.open_nursery() as nursery:
                for i in range(micro):
                    nursery.start_soon(one, i)
            await driver.finish()
            times.append(time.perf_counter() - began)
            if getattr(driver, "stragglers", None):
                # What the runtime does next with one driver (its accusation convicts): a plan
                # without the straggler (a new wiring; the driver's deadlines and judgement kept).
                gone = set(driver.stragglers)
                evicted += [str(p)[-6:] for p in gone]
                driver.stragglers.clear()
                replicas = [r for r in replicas if r.host.get_id() not in gone]
                driver.wiring = Wiring({1: [r.host.get_id() for r in replicas]}, random.Random(step))
        measured = times[1:]
        return {"mode": mode, "steps_per_s": len(measured) / sum(measured), "step_s": [round(s, 3) for s in times],
                "timeouts": driver.timeouts, "stragglers": evicted, "staller": str(hosts[3].id)[-6:]}


async def main(args: argparse.Namespace) -> None:
    results = []
    for mode in ("holdings", "hops"):
        base = await run_mode("none", args.steps, args.micro)
        got = await run_mode(mode, args.steps, args.micro)
        got["ratio"] = got["steps_per_s"] / base["steps_per_s"]  # type: ignore[operator]
        results += [base, got]
    if args.json:
        print(json.dumps(results))
        return
    for r in results:
        ratio = f"  x{r['ratio']:.3f} of the baseline" if "ratio" in r else ""
        print(f"{r['mode']:>9}: {r['steps_per_s']:.2f} steps/s{ratio}; timeouts {r['timeouts']}; "
              f"stragglers {r['stragglers']} (staller …{r['staller']}); step seconds {r['step_s']}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    trio.run(main, parser.parse_args())
