"""A run survives losing every member (issue 32): three real `p2ptrain node start` processes are
SIGKILLed together mid-run and started again with ``--join TASK_CID``; they resume from the last
confirmed record instead of training again from step 0. Nothing is replaced: digits stored by CID,
gossipsub, the sparse all-reduce over libp2p streams, records attested and kept in chain.jsonl."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from p2ptrain.control import ControlClient, ops as control_ops
from p2ptrain.testing import NodeProcess, node_processes, run_cli as cli, task_status_of, wait_for
from p2ptrain.task import TASK_TEMPLATE
from p2ptrain.protocol import Chain, read_chain

# The node processes' idle waits shortened (tests/conftest.py): a resuming member hears an absent
# one for 5 s instead of 20, a joiner waits for a head 0.75 s instead of 3.
pytestmark = pytest.mark.usefixtures("quick_process_timers")

NODE_ARGS = ["--device", "cpu", "--threads", "1"]
# The members are killed at their third checkpoint (step 30) and resume from it: six checkpoints
# are left, so the kill lands mid-run however fast the rounds are (a poll of the three statuses is
# a few rounds). Each step is a round of three processes: ~0.5 s each on this 2-core box at load 20.
STEPS = 90
CHECKPOINT = 10
# A run of STEPS rounds of this MLP by three processes on a loaded 2-core box, or their restart
# (each process imports torch and libp2p; the resumed members hear each other for up to 20 s).
RUN_S = 240.0


def task_text(manifest: str, name: str) -> str:
    """The demo's digits task for exactly three members (so every run's ring is the same three)."""
    text = TASK_TEMPLATE.format(manifest=manifest, steps=STEPS, checkpoint=CHECKPOINT, density=0.01, peers=3)
    return text.replace('name = "demo-digits-mlp"', f'name = "{name}"').replace("min = 2", "min = 3")


def publish(proc: NodeProcess, text: str) -> str:
    return ControlClient(proc.home, timeout=120).call(control_ops.TASK_PUBLISH, text=text)["task_cid"]


def join_all(procs: list[NodeProcess], task_cid: str) -> None:
    for p in procs:
        ControlClient(p.home, timeout=120).call(control_ops.TASK_JOIN, task_cid=task_cid)


def statuses(procs: list[NodeProcess], task_cid: str) -> list[dict[str, Any] | None]:
    return [task_status_of(p.home, task_cid) for p in procs]


def all_done(procs: list[NodeProcess], task_cid: str) -> list[dict[str, Any]]:
    return wait_for(lambda: (s := statuses(procs, task_cid)) and all(x and x["state"] == "done" for x in s) and s,
                    timeout=RUN_S, interval=0.5)


def chain_file(proc: NodeProcess, task_cid: str) -> bytes:
    return (proc.home / "tasks" / task_cid / "chain.jsonl").read_bytes()


def verified(data: bytes, task_cid: str) -> Chain:
    return read_chain(task_cid, data)


def kill_all_at_v3(procs: list[NodeProcess], task_cid: str) -> list[bytes]:
    """SIGKILL every member at once, once each confirmed >= 3 checkpoints; their chain files then."""
    wait_for(lambda: (s := statuses(procs, task_cid)) and all(x and x["version"] >= 3 for x in s),
             timeout=RUN_S, interval=0.1)
    for p in procs:
        p.proc.kill()  # all at once: nobody gets to see another one die
    for p in procs:
        p.wait(10)
    return [chain_file(p, task_cid) for p in procs]


def restart(procs: list[NodeProcess], task_cid: str) -> list[int]:
    """Start every member again with --join; the sizes of their logs before (to read what follows)."""
    offsets = []
    for p in procs:
        p.extra_args = [*NODE_ARGS, "--join", task_cid]
        p.bootstrap = [q.addr for q in procs if q is not p]
        log = p.home / "logs" / "stderr.log"
        offsets.append(log.stat().st_size if log.exists() else 0)
        p.start()
    for p in procs:
        p.wait_ready()
    return offsets


def first_plan_step(procs: list[NodeProcess], offsets: list[int], name: str) -> int:
    """The step the first plan of task ``name`` starts from after the restart (the coordinator's log)."""
    plans = []
    for p, offset in zip(procs, offsets):
        text = (p.home / "logs" / "stderr.log").read_bytes()[offset:].decode(errors="replace")
        plans += re.findall(rf"task {name} \(.*?plan rounds \d+-\d+ \(attempt \d+\) from step (\d+)", text)
    assert plans, "no plan after the restart"
    return int(plans[0])


@pytest.mark.timeout(1500)  # nine process starts and three runs on a shared 2-core box
def test_members_killed_together_resume_from_the_last_confirmed_model_also_with_a_home_lost(tmp_path: Path) -> None:
    with node_processes(3, tmp_path, extra_args=NODE_ARGS) as procs:
        manifest = cli("dataset", "add", "sklearn:digits", "--shards", "8", "--home", str(procs[0].home)).splitlines()[-1]
        # The reference: the same task but for its name, run without a stop.
        unstopped = publish(procs[0], task_text(manifest, "unstopped"))
        join_all(procs, unstopped)
        reference = all_done(procs, unstopped)[0]

        # Killed together after >= 3 confirmed checkpoints, restarted on their homes.
        killed = publish(procs[0], task_text(manifest, "killed"))
        join_all(procs, killed)
        before = kill_all_at_v3(procs, killed)
        longest = max((verified(b, killed) for b in before), key=lambda c: c.version)
        head = {"version": longest.version, "step": longest.records[-1].record.step}
        offsets = restart(procs, killed)
        final = all_done(procs, killed)
        assert first_plan_step(procs, offsets, "killed") == head["step"]
        for p, s, old in zip(procs, final, before):
            assert s["resumed_from"] == head
            after = chain_file(p, killed)
            assert after.startswith(old), "a record of the chain before the kill was lost or changed"
            assert verified(after, killed).records[-1].record.step == STEPS
        # The same bits as the run that was never stopped: data order, top-k choices and error
        # feedback are functions of the step, not of the processes' history.
        assert {s["latest_model_cid"] for s in final} == {reference["latest_model_cid"]}

        # Again, and one member's home is lost with its machine: it starts afresh (a new identity),
        # gets the chain and the model by CID from the others and the run finishes with it.
        lost = publish(procs[0], task_text(manifest, "lost-home"))
        join_all(procs, lost)
        before = kill_all_at_v3(procs, lost)[:2]
        shutil.rmtree(procs[2].home)
        procs[2] = NodeProcess(procs[2].home, procs[2].port)
        longest = max((verified(b, lost) for b in before), key=lambda c: c.version)
        head = {"version": longest.version, "step": longest.records[-1].record.step}
        offsets = restart(procs, lost)
        final = all_done(procs, lost)
        assert first_plan_step(procs, offsets, "lost-home") == head["step"]
        assert [s["resumed_from"] for s in final[:2]] == [head, head] and final[2]["resumed_from"] is None
        for p, old in zip(procs[:2], before):
            assert chain_file(p, lost).startswith(old)
        # The same records everywhere (each line's attestations are the quorum its member counted).
        chains = [verified(chain_file(p, lost), lost).records for p in procs]
        assert chains[1] == chains[0] and chains[2] == chains[0]
        assert any(procs[2].peer_id in r.record.members for r in verified(chain_file(procs[2], lost), lost).records)
