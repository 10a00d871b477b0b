"""Can a replica tell, before it answers, that its answer will get a second opinion? (issue 27's
attacker against issue 31's checks; docs/security.md, "Pipelined tasks").

The checked microbatches are drawn from a key no replica knows, but the driver asked its second
opinions *in line* (before this change): a checked microbatch's second FORWARD at a middle stage (and
its CHECK_LOSS at the last) was asked before the microbatch went on. So a middle stage's BACKWARD
came back to the replica that served the FORWARD one or more hops later for a checked microbatch than
for one that is not: the replica times the gap between its FORWARD answer and the BACKWARD, and
alters only the gradients of the microbatches it judges unchecked; it was never outvoted. Now every
microbatch travels alike and the second opinions are asked at ``Driver.finish``
(pipeline/_opinions.py): the liar's test passes every BACKWARD, a checked one's lie is outvoted, its
author named, and the step fails. Real libp2p hosts on 127.0.0.1; each stage-1 replica takes STAGE_S
over a FORWARD (a stand-in for a stage's compute, the same for all three, so the wiring weighs them
alike), which made the extra hop of a checked microbatch stand out whatever the load of the machine.
"""

from __future__ import annotations

import random
import time
from dataclasses import replace

import pytest
import trio

from p2ptrain.pipeline import Driver, is_checked, Outvoted, StageReplica, Wiring
from p2ptrain.testing import connected_hosts
from p2ptrain.wire.activations import Kind

from .test_hostile_stages import DEADLINE_S, lm_loss, stages, tokens

STAGE_S = 0.5  # a stage-1 FORWARD's emulated compute time
KEY = b"timing"


class SlowReplica(StageReplica):
    """An honest stage-1 replica whose FORWARD takes STAGE_S (emulated compute)."""

    def _compute(self, request, sender):
        if request.kind == Kind.FORWARD:
            time.sleep(STAGE_S)  # a worker thread's compute, not a synchronization
        return super()._compute(request, sender)


class TimingLiar(SlowReplica):
    """Alters the input gradient of a BACKWARD only when it came back sooner than a FORWARD of its
    stage takes: no second FORWARD was asked in between, so nobody checks this microbatch. With
    second opinions asked in line a checked one's BACKWARD always came later (the second FORWARD sat
    between), so it was never caught; it lied on the unchecked ones that came back within STAGE_S
    (measured: 0.03-0.33 s at load 10-12 on the 2-core box, against 0.58-1.2 s for checked ones)."""

    answered: dict
    altered: int = 0
    spared: int = 0

    def _compute(self, request, sender):
        answer, grads = super()._compute(request, sender)
        if not hasattr(self, "answered"):
            self.answered = {}
        key = (sender, request.step, request.microbatch)
        if request.kind == Kind.FORWARD:
            self.answered[key] = time.monotonic()
        elif request.kind == Kind.BACKWARD and key in self.answered:
            if time.monotonic() - self.answered[key] < STAGE_S:
                self.altered += 1
                answer = replace(answer, tensors=(answer.tensors[0] * 1.01,))
            else:
                self.spared += 1
        return answer, grads


async def test_a_replica_cannot_tell_from_the_timing_which_of_its_backwards_are_checked():
    ids = list(range(24))
    checked = {mb for mb in ids if is_checked(KEY, 0, mb, 0.5)}
    assert 0 < len(checked) < len(ids)
    async with connected_hosts(5) as hosts:
        driver_id = hosts[0].id
        liar = TimingLiar(hosts[2].host, stages(3)[1], lm_loss, senders=[driver_id])
        replicas = [SlowReplica(hosts[1].host, stages(3)[1], lm_loss, senders=[driver_id]), liar,
                    SlowReplica(hosts[3].host, stages(3)[1], lm_loss, senders=[driver_id]),
                    StageReplica(hosts[4].host, stages(3)[2], lm_loss, senders=[driver_id])]
        for replica in replicas:
            replica.serve()
        wiring = Wiring({1: [h.id for h in hosts[1:4]], 2: [hosts[4].id]}, random.Random(7))
        driver = Driver(hosts[0].host, stages(3)[0], lm_loss, wiring, cut=stages(3), check_fraction=0.5, check_key=KEY)
        x, y = tokens(2 * len(ids))
        with trio.fail_after(DEADLINE_S * 2):
            for k, mb in enumerate(ids):  # one microbatch at a time
                await driver.microbatch(mb, x[2 * k : 2 * k + 2], y[2 * k : 2 * k + 2], 1 / len(ids))
            with pytest.raises(Outvoted):  # its lie went into the step's gradients: the step fails
                await driver.finish()
            await driver.aclose()
        # The property: a replica that alters gradients gets named. On main (second opinions asked
        # in line) the liar altered every unchecked BACKWARD it served and was never outvoted. A
        # liar that never altered anything (the wiring never gave it a BACKWARD it judged safe)
        # fails it too, so the test passes only because a lie was caught.
        assert liar.altered > 0 and hosts[2].id in driver.liars, (liar.altered, liar.spared, dict(driver.liars))
