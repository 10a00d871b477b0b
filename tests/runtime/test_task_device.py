"""Where a member trains is the task's ``[requirements] device`` first, the node's ``--device``
second (``p2ptrain.task.member_device``): a ``cpu`` task, the default, trains on the CPU even on a
node told ``--device cuda``, since its members attest each other's bits and a GPU's kernels round the
optimizer step otherwise. A peer in this process, on loopback."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import trio

from p2ptrain.base import UserError
from p2ptrain.services import TaskOptions
from p2ptrain.testing import local_peers, publish_digits_task

pytestmark = pytest.mark.usefixtures("quick_timers")  # tests/conftest.py: the protocol's idle waits shortened

DEADLINE_S = 60.0


async def test_a_cpu_task_trains_on_the_cpu_whatever_the_nodes_device_and_fp16_there_is_refused(tmp_path: Path) -> None:
    # On a machine without CUDA, a trainer made on the node's "cuda" fails ("CUDA is not
    # available"): that was the run's fate before the task's device was taken.
    async with local_peers(1, tmp_path, task_options=TaskOptions(device="cuda")) as peers:
        peer = peers[0]
        # peers.max 1: the lone member's term 0 ends at once instead of waiting out its timeout.
        task_cid = await publish_digits_task(peer, name="on-cpu", total_steps=4, checkpoint_interval=2, max_peers=1)
        with trio.fail_after(DEADLINE_S):
            run = await peer.tasks.join(task_cid)
            status = await peers.wait_until(lambda: (s := peers.status(0, task_cid)).get("version", 0) >= 1 and s
                                            or s.get("error") and s, DEADLINE_S, what="a confirmed model")
        assert status.get("error") is None, status["error"]
        assert run.shared.trainer is not None and run.shared.trainer.device.type == "cpu"

        # fp16 autocast needs CUDA: a cpu task is refused at the join, in one line, not failed later.
        peer.tasks.options = replace(peer.tasks.options, device="auto", precision="fp16")
        other = await publish_digits_task(peer, name="fp16-on-cpu", total_steps=4, checkpoint_interval=2)
        with pytest.raises(UserError, match="trains on the CPU .*fp16 needs CUDA"):
            await peer.tasks.join(other)
        assert other not in peer.tasks.runs
