"""Members whose CPU kernels round differently (torch's scalar ``DEFAULT`` kernels among vectorized
ones: ``ATEN_CPU_CAPABILITY=default``, what a CPU without AVX2 gets) on real ``p2ptrain node start``
processes; and members that compute other bits without saying so, in one process.

Their optimizer steps give other bits than the others' from the same averaged gradient
(base/_arithmetic.py), so they can never attest the others' checkpoint. Before, a scalar member was
planned all the same and loaded the confirmed state at every checkpoint, and two scalar members
among four stalled the run (no quorum on either side). Now the coordinator plans only the run's
class of arithmetic (protocol/_arithmetics.py): the others wait as non-members and say why. A member
that computes other bits while advertising the run's arithmetic (or none) is still planned; its own
check at each confirmed checkpoint (``Attesting._check_own_state``) stays the defence.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from p2ptrain.control import ControlClient, ops as control_ops
from p2ptrain.node import free_port
from p2ptrain.task import TASK_TEMPLATE
from p2ptrain.testing import (
    LocalPeers,
    NodeProcess,
    local_peers,
    publish_digits_task,
    run_cli as cli,
    run_node_processes,
    task_status_of,
    wait_for,
)

STEPS, CHECKPOINT = 60, 20
ARGS = ["--device", "cpu", "--threads", "1"]
SCALAR = {"ATEN_CPU_CAPABILITY": "default"}  # torch's scalar CPU kernels, as on a CPU without AVX2


def _run_digits(started: list[NodeProcess], peers_min: int, peers_max: int) -> str:
    """The demo task on sklearn's digits, published by the first process with ``peers.min`` and
    ``peers.max`` as given, and joined by the others; its CID."""
    home = started[0].home
    manifest = cli("dataset", "add", "sklearn:digits", "--shards", "8", "--home", str(home)).splitlines()[-1]
    text = TASK_TEMPLATE.format(manifest=manifest, steps=STEPS, checkpoint=CHECKPOINT, density=0.05, peers=peers_max)
    task_cid = ControlClient(home, timeout=120).call(control_ops.TASK_PUBLISH, join=True,
                                                     text=text.replace("min = 2\n", f"min = {peers_min}\n"))["task_cid"]
    for p in started[1:]:
        ControlClient(p.home, timeout=60).call(control_ops.TASK_JOIN, task_cid=task_cid)
    return str(task_cid)


def _log(p: NodeProcess) -> str:
    return (p.home / "logs" / "stderr.log").read_text(errors="replace")


def _poll(started: list[NodeProcess], task_cid: str, shown: list[set[str]]) -> list[dict[str, Any]] | None:
    """Every process's status of the task (None while one does not answer), noting in ``shown`` the
    peers each listed as left out once a checkpoint was confirmed in the run (a plan was taken): a
    status lists the live peers as its member sees them now, and before the first plan a peer whose
    torch probe has not run yet advertises no arithmetic, so for a moment its class looks smaller
    than it is. (Not once the member itself holds a checkpoint: one left out loads one only when the
    run ends, and on a loaded machine its last status before that could come after it stopped
    listing; the suite missed the waited pair's view so, twice.)"""
    s = [task_status_of(p.home, task_cid) for p in started]
    if any(x and x["version"] >= 1 for x in s):
        for i, x in enumerate(s):
            if x:
                shown[i] |= {e["peer"] for e in x["arithmetic_left_out"]}
    return s if all(s) else None  # type: ignore[return-value]


def _all_done(s: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The statuses once every process is done: the members, and those left out, which load the
    run's last checkpoint when it ends without them (as a joiner never admitted would)."""
    return s if s and all(x["state"] == "done" for x in s) else None


def _left_out_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "this member is left out of the run's plans" in line]


@pytest.mark.timeout(300)
def test_a_scalar_member_among_three_vectorized_ones_is_left_out_once_and_says_why(tmp_path: Path) -> None:
    """On main the scalar member was planned (peers.min 3 of 4), never matched, and loaded the
    confirmed state at every checkpoint (own_state_differs); now the plans name the three vectorized
    members only, and the scalar one says once why it waits."""
    procs = [NodeProcess(tmp_path / f"node{i}", free_port(), extra_args=ARGS) for i in range(3)]
    odd = NodeProcess(tmp_path / "scalar", free_port(), extra_args=ARGS, env=SCALAR)
    shown: list[set[str]] = [set() for _ in range(4)]
    with run_node_processes([*procs, odd]) as started:
        task_cid = _run_digits(started, 3, 4)
        statuses = wait_for(lambda: _all_done(_poll(started, task_cid, shown)), timeout=240, interval=0.5)
        log = _log(odd)
    final, scalar = statuses[:3], statuses[3]
    # Every process ends holding the run's model, the scalar one loaded by CID.
    assert len({s["latest_model_cid"] for s in statuses}) == 1 and final[0]["version"] >= STEPS // CHECKPOINT, final
    assert all(odd.peer_id not in s["members"] for s in final), [s["members"] for s in final]
    assert all("own_state_differs" not in s["rejected"] for s in final), [s["rejected"] for s in final]
    # The coordinator logged and counted leaving it out; every member shows it left out, and the run's class.
    assert any(s["rejected"].get("arithmetic_left_out") for s in final), [s["rejected"] for s in final]
    assert shown == [{odd.peer_id}] * 4, shown
    assert all("DEFAULT" not in s["arithmetic_run"] for s in final), [s["arithmetic_run"] for s in final]
    assert "own_state_differs" not in scalar["rejected"] and scalar["rejected"]["arithmetic_left_out"] == 1, scalar
    [line] = _left_out_lines(log)  # once, not at every plan
    assert "with DEFAULT kernels, the run's members with torch" in line and "`p2ptrain docs deploy`" in line, line


@pytest.mark.timeout(300)
def test_two_vectorized_and_two_scalar_members_confirm_records_with_one_class(tmp_path: Path) -> None:
    """On main all four were planned, each pair attested its own bits, neither is a quorum of four:
    every record was rejected (attestations_split) and the run stalled at model v0. Now one class
    (the tie goes to the class of the lowest-ranked peer) trains and confirms every checkpoint, and
    the other pair waits, each member saying why once."""
    procs = [NodeProcess(tmp_path / f"node{i}", free_port(), extra_args=ARGS, env=SCALAR if i >= 2 else None)
             for i in range(4)]
    shown: list[set[str]] = [set() for _ in range(4)]
    with run_node_processes(procs) as started:
        task_cid = _run_digits(started, 2, 4)

        statuses = wait_for(lambda: _all_done(_poll(started, task_cid, shown)), timeout=240, interval=0.5)
        logs = [_log(p) for p in started]
    assert all(s["version"] >= STEPS // CHECKPOINT for s in statuses), [s["version"] for s in statuses]
    assert len({s["latest_model_cid"] for s in statuses}) == 1, statuses
    # The members of the last plan, as a member shows them (one left out may show none).
    members = next(set(s["members"]) for p, s in zip(started, statuses, strict=True) if p.peer_id in s["members"])
    trained = [i for i in range(4) if started[i].peer_id in members]
    waited = [i for i in range(4) if i not in trained]
    assert trained in ([0, 1], [2, 3]), trained  # one class: both vectorized or both scalar
    assert not any(s["rejected"].get("attestations_split") for s in statuses), [s["rejected"] for s in statuses]
    for i in waited:
        assert shown[i] == {started[j].peer_id for j in waited}, shown
        [line] = _left_out_lines(logs[i])
        assert line.count("kernels") == 2, line


# A member that computes other bits and does not say so (or says the run's arithmetic): one process,
# one arithmetic, so its optimizer applies the averaged gradient scaled by 1 + 2**-10 (other bits).
SKEW = 1 + 2**-10


async def _skew(peers: LocalPeers, index: int, task_cid: str) -> None:
    """Make peer ``index``'s steps round differently from the others', from its first round on."""
    def trainer() -> Any:
        run = peers[index].tasks.runs.get(task_cid)
        return run.shared.trainer if run is not None else None

    t = await peers.wait_until(trainer, 60, what=f"peer{index}'s trainer")
    apply = t.apply
    t.apply = lambda averaged: apply(averaged * torch.tensor(SKEW, dtype=averaged.dtype))


@pytest.mark.usefixtures("quick_timers")
async def test_a_member_that_rounds_differently_unannounced_says_so_and_loads_each_confirmed_state(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The defence for a member the planner cannot tell apart (it advertises no arithmetic, an older
    version, or lies): planned, its attestations never match, and at each confirmed checkpoint it
    sees that its own state is not the confirmed one, says so, and loads that state by CID. Before
    that check it went on from weights of its own and ended "done" naming a model it did not hold."""
    caplog.set_level(logging.WARNING, logger="p2ptrain.run")
    with trio.fail_after(180):
        async with local_peers(3, tmp_path) as peers:
            task_cid = await publish_digits_task(peers[0], total_steps=12, checkpoint_interval=4, min_peers=3,
                                                 max_peers=3)  # all three join at once: term 0 need not wait
            await peers.join_all(task_cid)
            await _skew(peers, 2, task_cid)
            final = await peers.wait_until(
                lambda: (s := [peers.status(i, task_cid) for i in range(3)]) and all(x.get("state") == "done" for x in s)
                and s, 150, what="all three done")
    assert len({s["latest_model_cid"] for s in final}) == 1, final
    assert all("own_state_differs" not in s["rejected"] for s in final[:2]), [s["rejected"] for s in final]
    assert final[2]["rejected"].get("own_state_differs", 0) >= 1, final[2]["rejected"]
    assert all(s["arithmetic_left_out"] == [] for s in final)  # one arithmetic advertised: nobody left out
    lines = [r.getMessage() for r in caplog.records if "is not the confirmed model" in r.getMessage()]
    assert lines and "this member: torch" in lines[0] and "; its coordinator" in lines[0], lines


@pytest.mark.usefixtures("quick_timers")
async def test_members_split_between_two_unannounced_arithmetics_are_told_why_no_checkpoint_is_confirmed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Two members that compute other bits than the other two, unannounced: each pair attests its
    own bits, neither is a quorum of four, so no checkpoint can be confirmed. Every member logs which
    members computed which model, with the arithmetic each advertises, and counts it
    (``attestations_split``) instead of only saying that the record fell short."""
    caplog.set_level(logging.WARNING, logger="p2ptrain.run")
    with trio.fail_after(180):
        async with local_peers(4, tmp_path) as peers:
            task_cid = await publish_digits_task(peers[0], total_steps=12, checkpoint_interval=4, min_peers=4,
                                                 max_peers=4)  # all four join at once: term 0 need not wait
            await peers.join_all(task_cid)
            for i in (2, 3):
                await _skew(peers, i, task_cid)
            statuses = await peers.wait_until(
                lambda: (s := [peers.status(i, task_cid) for i in range(4)])
                and all(x.get("rejected", {}).get("attestations_split") for x in s) and s, 150,
                what="every member counts a split record")
    assert all(s["version"] == 0 for s in statuses), [s["version"] for s in statuses]  # nothing confirmed
    lines = [r.getMessage() for r in caplog.records if "computed 2 different models" in r.getMessage()]
    assert lines and all("`p2ptrain docs deploy`" in line and line.count(" (") >= 4 for line in lines), lines
