"""A plan member flooding one replica with EVALs (every member of a plan is admitted for EVAL, at
any step): what it costs a driver's steps, and whether the driver then judges the flooded, honest
replica a straggler (pipeline/_stragglers.py; docs/security.md, "Pipelined tasks").

    .venv/bin/python bench/eval_flood.py [--batch 2048] [--steps 8]

Five libp2p hosts on 127.0.0.1 in this process (``p2ptrain.testing.connected_hosts``): one driver of
a two-stage ``transformer_lm`` (16 wide, 8 tokens), three replicas of stage 1, and an evaluator
that the replicas admit for EVAL only, which keeps 8 channels to one replica, each sending EVALs of
``--batch`` samples as fast as they are answered (reopened when the replica resets one: an EVAL
that names a step the replica has left is refused). Printed: the driver's step seconds without the
flood and with it (same run), the EVALs answered and refused, and the stragglers the driver found.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
import torch.nn.functional as F
import trio

from p2ptrain.models import build_model
from p2ptrain.net import ChannelError, open_channel
from p2ptrain.pipeline import Driver, HopDeadlines, partition, PROTOCOL, StageReplica, Wiring
from p2ptrain.run import HOP_TIMEOUT_S
from p2ptrain.testing import connected_hosts
from p2ptrain.wire.activations import encode_frame, Frame, Kind

LM = {"vocab_size": 50, "context": 8, "width": 16, "depth": 2, "heads": 2}
CHANNELS = 8  # what a replica takes from one peer at once (MAX_STREAMS_PER_PEER)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def stages() -> list[torch.nn.Module]:
    return list(partition(build_model("transformer_lm", LM, seed=5), 2))


async def run(flood: bool, batch: int, steps: int) -> None:
    s0, s1 = stages()
    async with connected_hosts(5) as hosts:
        driver_id, evaluator = hosts[0].id, hosts[4]
        replicas = [StageReplica(h.host, stages()[1], lm_loss, senders=[driver_id], evaluators=[evaluator.id])
                    for h in hosts[1:4]]
        for r in replicas:
            r.serve()
        target = replicas[2]
        driver = Driver(hosts[0].host, s0, lm_loss, Wiring({1: [h.id for h in hosts[1:4]]}, random.Random(1)),
                        cut=[s0, s1], hop_timeout=HOP_TIMEOUT_S, deadlines=HopDeadlines(HOP_TIMEOUT_S, ceiling=60.0))

        async def flooder() -> None:
            x = torch.randn(batch, LM["context"], LM["width"])
            y = torch.randint(0, LM["vocab_size"], (batch, LM["context"]))
            while True:
                try:
                    async with await open_channel(evaluator.host, target.host.get_id(), PROTOCOL) as channel:
                        while True:
                            await channel.send(encode_frame(Frame(Kind.EVAL, target.weights_step, 0, 1, 0.0, (x, y))))
                            await channel.recv(1 << 26)
                except ChannelError:
                    pass  # reset by the replica (an EVAL of a step it has left): open another

        seconds = []
        g = torch.Generator().manual_seed(7)
        async with trio.open_nursery() as nursery:
            if flood:
                for _ in range(CHANNELS):
                    nursery.start_soon(flooder)
            for step in range(1, steps + 1):
                began = time.perf_counter()
                driver.new_step(step)
                for r in replicas:
                    r.new_step(step)
                    r.weights_step = step
                t = torch.randint(0, LM["vocab_size"], (16, LM["context"] + 1), generator=g)
                limiter = trio.CapacityLimiter(4)

                async def one(k: int) -> None:
                    async with limiter:
                        await driver.microbatch(k, t[2 * k : 2 * k + 2, :-1], t[2 * k : 2 * k + 2, 1:], 1 / 8)

                async with trio.open_nursery() as hops:
                    for k in range(8):
                        hops.start_soon(one, k)
                await driver.finish()
                seconds.append(round(time.perf_counter() - began, 3))
            nursery.cancel_scope.cancel()
        print(f"flood {'on ' if flood else 'off'}: step seconds {seconds}; EVALs answered {target.evaluations}, "
              f"refused {dict(target.refused)}; stragglers {[str(p)[-6:] for p in driver.stragglers]} "
              f"(flooded …{str(target.host.get_id())[-6:]})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    for flood in (False, True):
        trio.run(run, flood, args.batch, args.steps)


if __name__ == "__main__":
    main()
