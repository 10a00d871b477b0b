"""A member whose CPU kernels round differently from the others' (torch's scalar ``DEFAULT`` kernels
among vectorized ones: ``ATEN_CPU_CAPABILITY=default``, what a CPU without AVX2 gets) on real
``p2ptrain node start`` processes.

Its optimizer steps give other bits than the quorum's from the same averaged gradient
(training/_arithmetic.py), so it can never attest a checkpoint. Before, it went on training from
weights of its own, silently, and ended "done" naming a model it did not hold. Now it says why at
each checkpoint, loads the confirmed state by CID, and ends holding the run's model.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from p2ptrain.control import ControlClient, ops as control_ops
from p2ptrain.node import free_port
from p2ptrain.task import TASK_TEMPLATE
from p2ptrain.testing import NodeProcess, run_cli as cli, run_node_processes, task_status_of, wait_for

STEPS, CHECKPOINT = 60, 20
ARGS = ["--device", "cpu", "--threads", "1"]
SCALAR = {"ATEN_CPU_CAPABILITY": "default"}  # torch's scalar CPU kernels, as on a CPU without AVX2


def _run_digits(started: list[NodeProcess], members: int) -> str:
    """The demo task on sklearn's digits, published by the first process with ``peers.min`` =
    ``members`` (every span has every member) and joined by the others; its CID."""
    home = started[0].home
    manifest = cli("dataset", "add", "sklearn:digits", "--shards", "8", "--home", str(home)).splitlines()[-1]
    text = TASK_TEMPLATE.format(manifest=manifest, steps=STEPS, checkpoint=CHECKPOINT, density=0.05, peers=members)
    task_cid = ControlClient(home, timeout=120).call(control_ops.TASK_PUBLISH, join=True,
                                                     text=text.replace("min = 2\n", f"min = {members}\n"))["task_cid"]
    for p in started[1:]:
        ControlClient(p.home, timeout=60).call(control_ops.TASK_JOIN, task_cid=task_cid)
    return str(task_cid)


@pytest.mark.timeout(300)
def test_a_member_that_rounds_differently_says_so_and_loads_each_confirmed_state(tmp_path: Path) -> None:
    procs = [NodeProcess(tmp_path / f"node{i}", free_port(), extra_args=ARGS) for i in range(2)]
    odd = NodeProcess(tmp_path / "scalar", free_port(), extra_args=ARGS, env=SCALAR)
    with run_node_processes([*procs, odd]) as started:
        # min = 3: every span has the scalar member (it stops advertising while it loads a confirmed state).
        task_cid = _run_digits(started, 3)
        final = wait_for(lambda: (s := [task_status_of(p.home, task_cid) for p in started])
                         and all(x and x["state"] == "done" for x in s) and s, timeout=240, interval=0.5)
        log = (odd.home / "logs" / "stderr.log").read_text(errors="replace")
    assert len({s["latest_model_cid"] for s in final}) == 1, final
    normal, scalar = final[:2], final[2]
    assert all("own_state_differs" not in s["rejected"] for s in normal), [s["rejected"] for s in normal]
    assert scalar["rejected"].get("own_state_differs", 0) >= 1, scalar["rejected"]
    assert "is not the confirmed model" in log and "this member: torch" in log, log[-4000:]
    assert "with DEFAULT kernels; its coordinator" in log, log[-4000:]
    # It ends holding the run's last checkpoint: loaded by CID, not its own weights at that step.
    last_load = [line for line in log.splitlines() if "resynced to model" in line][-1]
    assert final[0]["latest_model_cid"] in last_load and f"at step {STEPS}" in last_load, last_load


@pytest.mark.timeout(300)
def test_members_split_between_two_arithmetics_are_told_why_no_checkpoint_is_confirmed(tmp_path: Path) -> None:
    """Two members with vectorized kernels and two with scalar ones: each pair attests its own bits,
    neither is a quorum of four, so no checkpoint can be confirmed. Before, each rejected record
    said only that it fell short; now every member logs which members computed which model, with
    the arithmetic each advertises, and counts it (``attestations_split``)."""
    procs = [NodeProcess(tmp_path / f"node{i}", free_port(), extra_args=ARGS, env=SCALAR if i >= 2 else None)
             for i in range(4)]
    with run_node_processes(procs) as started:
        task_cid = _run_digits(started, 4)
        statuses = wait_for(lambda: (s := [task_status_of(p.home, task_cid) for p in started])
                            and all(x and x["rejected"].get("attestations_split") for x in s) and s,
                            timeout=240, interval=0.5)
        logs = [(p.home / "logs" / "stderr.log").read_text(errors="replace") for p in started]
    assert all(s["version"] == 0 for s in statuses), [s["version"] for s in statuses]  # nothing confirmed
    for log in logs:
        line = next(line for line in log.splitlines() if "computed 2 different models" in line)
        # Rejected as soon as no quorum can be reached: the record's coordinator and the attesters heard
        # by then, each with its arithmetic: scalar members and vectorized ones, on two models.
        assert line.count("with DEFAULT kernels)") >= 1 and line.count("kernels)") > line.count("DEFAULT kernels)"), line
