"""Runs of a module defined in tests/api/member_script.py (not in the registry), each member a
separate process from its own loop (``p2ptrain.Optimizer``): a member killed mid-run and a late
joiner, whose run's model then loads by CID into a fresh instance in a fresh process; a hostile
member that sends x100 gradients against ``robust="clip"``."""

from __future__ import annotations

import json
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p2ptrain.testing import run_forked, task_status_of
from p2ptrain.testing import ScriptMember, last_json, script_members, start_script

# The member processes' idle waits shortened (tests/conftest.py, quick_process_timers): a joiner
# listens 0.75 s for a head instead of 3, a new coordinator's first plan waits 0.5 s for joiners instead of 2.
pytestmark = pytest.mark.usefixtures("quick_process_timers")

SCRIPT = Path(__file__).with_name("member_script.py")
# Three or four processes import torch and libp2p, meet, train 160 steps: about a minute alone,
# several on a loaded 2-core machine.
RUN_S = 420.0
# The killed-member run's length: enough for >= 0.9 and a span of the survivors and the joiner.
STEPS = 300


def _started(proc: subprocess.Popen[str], timeout: float) -> str:
    """The run CID the member prints once it takes part (bounded)."""
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        line = proc.stdout.readline() if ready else ""
        if line.startswith('{"started"'):
            return str(json.loads(line)["run_cid"])
        if not line and proc.poll() is not None:
            raise AssertionError(f"member exited with {proc.returncode} before taking part")
    raise AssertionError(f"member did not take part within {timeout:.0f} s")


def _version(member: ScriptMember, run_cid: str) -> int:
    status = task_status_of(member.home, run_cid)
    return int(status["version"]) if status else 0


def _finish(procs: dict[int, subprocess.Popen[str]], members: list[ScriptMember], deadline: float) -> list[dict]:
    results = []
    for i, proc in procs.items():
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"member {i} did not finish:\n{(members[i].home / 'script.log').read_text()[-4000:]}") from None
        assert proc.returncode == 0, (members[i].home / "script.log").read_text()[-4000:]
        results.append(last_json(out))
    return results


@pytest.mark.timeout(RUN_S + 180)  # the run, then the load in a fresh process (at most 120 s)
def test_a_member_killed_mid_run_and_a_late_joiner_and_the_model_cid_loads_in_a_fresh_process(tmp_path: Path) -> None:
    """Four processes start a run; one is SIGKILLed once a model is confirmed and a late joiner joins
    the run under way: the survivors and the joiner end with the same model CID and weights at >= 0.9.
    The run's model, loaded by CID from a member's home into a new DigitsNet in a new process,
    predicts exactly what the members' did. (One run for both: each costs minutes of process
    starts on a loaded 2-core machine.)"""
    members = script_members(4, tmp_path)
    # A few hundred steps: the members rest after each step while the span has fewer than three
    # (from the kill until the late joiner is in), so the run is still under way when it gets in.
    args = ["--steps", str(STEPS), "--checkpoint-every", "20", "--slow-below", "3"]
    go = tmp_path / "late-joiner-go"
    deadline = time.monotonic() + RUN_S
    procs = {i: start_script(SCRIPT, members[i], args) for i in range(3)}
    # Started now (its imports take a while on a loaded machine), it joins once told.
    procs[3] = start_script(SCRIPT, members[3], [*args, "--wait-for", str(go)])
    try:
        run_cid = _started(procs[0], RUN_S / 2)
        while _version(members[0], run_cid) < 1:  # the run is under way: one model confirmed
            assert time.monotonic() < deadline, "no model confirmed"
            time.sleep(0.5)
        procs[2].send_signal(signal.SIGKILL)  # dies without a goodbye
        procs[2].wait(30)
        del procs[2]
        go.touch()  # the late joiner joins the run under way: it loads the run's head by CID
        results = _finish(procs, members, deadline)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert {r["run_cid"] for r in results} == {run_cid}
    assert len({r["model_cid"] for r in results}) == 1, results
    assert len({r["weights"] for r in results}) == 1, "members ended with different weights"
    assert all(r["steps"] == STEPS for r in results)
    assert min(r["accuracy"] for r in results) >= 0.9, results
    for r in results:  # the last span: the survivors and the late joiner, not the killed member
        assert set(r["peers"]) == {members[i].peer_id for i in (0, 1, 3)}, r["peers"]
    # The late joiner's home (it got the model by CID from the others, not by training from step 0).
    cid = results[2]["model_cid"]
    out = run_forked([sys.executable, str(SCRIPT), "--home", str(members[3].home), "--load", cid],
                     capture_output=True, text=True, timeout=120, check=True).stdout
    loaded = last_json(out)
    assert loaded["weights"] == results[2]["weights"]
    assert loaded["predictions"] == results[2]["predictions"]


@pytest.mark.timeout(RUN_S + 60)
def test_a_hostile_member_sending_x100_gradients_is_bounded_by_clip(tmp_path: Path) -> None:
    members = script_members(4, tmp_path)
    # max_peers 4: all four are the run's first members, so its first term and plan need not wait
    # for more (protocol/_election.py, Election._gathered).
    args = ["--steps", "160", "--checkpoint-every", "40", "--robust", "clip", "--max-peers", "4"]
    deadline = time.monotonic() + RUN_S
    procs = {i: start_script(SCRIPT, members[i], args + (["--scale", "100"] if i == 3 else []))
             for i in range(4)}
    try:
        results = _finish(procs, members, deadline)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    honest = results[:3]
    assert len({r["weights"] for r in results}) == 1
    assert min(r["accuracy"] for r in honest) >= 0.9, results
