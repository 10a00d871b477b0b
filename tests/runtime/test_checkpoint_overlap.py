"""Overlapping checkpoints (``[training] overlap_checkpoints = true``) on real loopback peers in this
process (``p2ptrain.testing.local_peers``): a span's rounds run while the previous span's
checkpoint is not even stored, and the chain still confirms every checkpoint, each of the state at
its own step.

To make "while" certain rather than likely (a tiny model's checkpoint settles in milliseconds), every
member's store holds the optimizer state of the first checkpoint until some member has completed a
round after it: a slow disk, not a replaced part. Without overlap no such round can come before the
checkpoint is confirmed, so the hold runs out (HOLD_S) and the test fails.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from p2ptrain.data import build_dataset, load_source
from p2ptrain.testing import LocalPeers, local_peers
from p2ptrain.testing._peers import DIGITS_TASK
from p2ptrain.protocol import read_tensors
from p2ptrain.task import load_task, task_bytes

pytestmark = pytest.mark.usefixtures("quick_timers", "no_missed_plan")  # tests/conftest.py: the protocol's idle waits shortened

DEADLINE_S = 120.0  # the whole test: three peers train 3 spans of a tiny MLP (~10 s alone)
STEP_S = 60.0  # one condition: the run's own deadlines are a few seconds
HOLD_S = 10.0  # how long a member's store holds the first checkpoint, waiting for a later round
INTERVAL = 3
TOTAL_STEPS = 3 * INTERVAL


async def _publish(peers: LocalPeers) -> str:
    store = peers[0].content.store

    def build() -> str:
        source, features, labels = load_source("sklearn:digits")
        manifest, _ = build_dataset(store, source, (features / 16.0).astype(np.float32), labels, 4, test_fraction=0.2)
        # peers.max: the peers here, so term 0 ends once all are alive (nobody else could join).
        text = DIGITS_TASK.format(name="overlap", manifest=manifest, total_steps=TOTAL_STEPS,
                                  checkpoint_interval=INTERVAL, min_peers=1, max_peers=len(peers))
        text = text.replace("[training]\n", "[training]\noverlap_checkpoints = true\n")
        cid = store.add_bytes(task_bytes(load_task(text)))
        store.pin_add(cid)
        return cid

    return await trio.to_thread.run_sync(build)


def _optimizer_step(data: bytes) -> int | None:
    """The ``trainer.step`` of optimizer-state bytes; None for anything else the store is given."""
    if b"trainer.step" not in data[:4096]:
        return None
    return int(read_tensors(data)["trainer.step"])


def _hold_first_checkpoint(peers: LocalPeers, task_cid: list[str], later_round: list[bool]) -> None:
    """Each member's store, given the optimizer state at step INTERVAL, waits (in its worker thread)
    until some member's trainer is past that step; ``later_round`` gets whether one was."""

    async def wait_for_a_later_round() -> bool:
        def past() -> bool:
            return any((peers.status(i, task_cid[0]).get("step") or 0) > INTERVAL for i in range(len(peers)))
        try:
            await peers.wait_until(past, HOLD_S, what="a round after the first checkpoint")
        except TimeoutError:
            return False
        return True

    for peer in peers:
        store = peer.content.store
        original = store.add_bytes

        def add_bytes(data: bytes, *args: Any, _original: Any = original, **kwargs: Any) -> str:
            if _optimizer_step(data) == INTERVAL:
                later_round.append(trio.from_thread.run(wait_for_a_later_round))
            return _original(data, *args, **kwargs)

        store.add_bytes = add_bytes  # type: ignore[method-assign]


async def test_a_span_trains_while_the_previous_checkpoint_settles_and_every_checkpoint_is_confirmed(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with local_peers(3, tmp_path) as peers:
            task_cid: list[str] = []
            later_round: list[bool] = []
            task_cid.append(await _publish(peers))
            _hold_first_checkpoint(peers, task_cid, later_round)
            await peers.join_all(task_cid[0])

            def done() -> list[dict[str, Any]] | None:
                statuses = [peers.status(i, task_cid[0]) for i in range(len(peers))]
                for s in statuses:
                    assert s.get("state") != "failed", s.get("error")
                return statuses if all(s.get("state") == "done" for s in statuses) else None

            statuses = await peers.wait_until(done, STEP_S, what="the run done on every member")
            # Every member stored the first checkpoint only after a round of the next span.
            assert later_round == [True] * len(peers), later_round
            chains = {tuple((c["version"], c["step"], c["model_cid"]) for c in s["chain"]) for s in statuses}
            assert len(chains) == 1, chains
            chain = next(iter(chains))
            assert [(v, step) for v, step, _ in chain] == [(1, 3), (2, 6), (3, 9)]
            # Each record names the state at its own step, though stored while the next span ran.
            store = peers[0].content.store
            for record in peers[0].tasks.runs[task_cid[0]].shared.book.chain.records:
                state = store.cat(record.record.optimizer_cid)
                assert _optimizer_step(state) == record.record.step
