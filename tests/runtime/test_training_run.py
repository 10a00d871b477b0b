"""Whole training runs across real `p2ptrain node start` processes on 127.0.0.1.

Nothing is replaced: the dataset is scikit-learn's digits stored by CID, tasks are announced on
gossipsub, gradients go through the sparse ring all-reduce over Noise-secured libp2p streams, models
are published, attested and fetched by CID. Faults are real too: members are SIGKILLed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from p2ptrain.task import TASK_TEMPLATE, task_from_bytes
from p2ptrain.control import ControlClient, ops as control_ops
from p2ptrain.testing import NodeProcess, node_processes, run_cli as cli, task_status_of, wait_for
from p2ptrain.ipfs import open_store
from p2ptrain.protocol import Chain, ChainRules
from p2ptrain.protocol._lineage import first_parent

# The node processes' idle waits shortened (tests/conftest.py, quick_process_timers): a joiner listens
# 0.75 s for a head instead of 3, a new coordinator's first plan waits 0.5 s for joiners instead of 2.
pytestmark = pytest.mark.usefixtures("quick_process_timers")


def publish(proc: NodeProcess, name: str, steps: int, checkpoint: int) -> tuple[str, str]:
    manifest = cli("dataset", "add", "sklearn:digits", "--shards", "8", "--home", str(proc.home)).splitlines()[-1]
    text = TASK_TEMPLATE.format(manifest=manifest, steps=steps, checkpoint=checkpoint, density=0.01, peers=8)
    text = text.replace('name = "demo-digits-mlp"', f'name = "{name}"')
    task_cid = ControlClient(proc.home, timeout=120).call(control_ops.TASK_PUBLISH, text=text, join=True)["task_cid"]
    return manifest, task_cid


def task_status(proc: NodeProcess, task_cid: str) -> dict | None:
    return task_status_of(proc.home, task_cid)


def verified_chain(proc: NodeProcess, task_cid: str) -> Chain:
    """The member's saved chain, re-verified as an outsider would: signatures, parents, consecutive
    versions, and every record's proof (its signer elected and a quorum of its members attesting)
    under the task's own rules."""
    status = task_status(proc, task_cid)
    assert status is not None
    data = (proc.home / "tasks" / task_cid / "chain.jsonl").read_bytes()
    task = task_from_bytes(open_store(proc.home).cat(task_cid))
    return Chain.from_bytes(task_cid, first_parent(data), data, ChainRules.of(task, task_cid))


# Long enough for every event below to happen before the end, and no longer: each step after the
# last event is CPU of two processes (the steps after the coordinator's death were ~60% of the
# test's CPU at 1,200). In six runs at load 4-15 the coordinator was killed at step 160-200, the
# late joiner admitted at ~120; 600 leaves 400 steps for a slower box or the joiner's quarantine
# (10 s of rounds without it at ~10-25 steps/s).
STEPS = 600


@pytest.mark.timeout(540)
def test_a_run_survives_a_late_joiner_and_killed_members_reaches_90_percent_and_its_model_is_fetched_by_cid(
    tmp_path: Path,
) -> None:
    """One run seen whole (one run, not two: four node processes cost ~35 s of a CI budget each time)."""
    with node_processes(4, tmp_path, extra_args=["--device", "cpu", "--threads", "1"]) as procs:
        members, joiner = procs[:3], procs[3]
        # STEPS (above): long enough in wall time for every event below to happen before the end.
        manifest, task_cid = publish(members[0], "digits-faults", steps=STEPS, checkpoint=20)
        for p in members[1:]:
            ControlClient(p.home, timeout=60).call(control_ops.TASK_JOIN, task_cid=task_cid)
        wait_for(lambda: (s := task_status(members[0], task_cid)) and s["version"] >= 1, timeout=120, interval=0.2)

        # A late joiner loads the confirmed model by CID and is admitted at the next checkpoint.
        ControlClient(joiner.home, timeout=60).call(control_ops.TASK_JOIN, task_cid=task_cid)
        wait_for(lambda: (s := task_status(members[0], task_cid)) and joiner.peer_id in s["members"],
                 timeout=120, interval=0.2)

        # SIGKILL a member that is not the coordinator: the others drop it and go on.
        coordinator = task_status(members[0], task_cid)["coordinator"]
        victim = next(p for p in members if p.peer_id != coordinator)
        alive = [p for p in procs if p is not victim]
        version = task_status(alive[0], task_cid)["version"]
        victim.kill()
        # Until the roster is exactly the three living peers: losing the coordinator then leaves a
        # majority (2 of 3) to elect the next one. (A roster that had just dropped a slow member to
        # two would leave no majority, by design of the quorum.)
        everyone = {p.peer_id for p in alive}
        wait_for(lambda: (s := task_status(alive[0], task_cid)) and s["version"] >= version + 2
                 and set(s["members"]) == everyone, timeout=180, interval=0.2)

        # SIGKILL the coordinator: another is elected in a later term and finishes the run.
        status = task_status(alive[0], task_cid)
        assert status["state"] != "done", f"the run ended before its coordinator was killed: raise STEPS ({STEPS})"
        old_coordinator, old_term = status["coordinator"], status["term"]
        boss = next(p for p in alive if p.peer_id == old_coordinator)
        boss.kill()
        survivors = [p for p in alive if p is not boss]
        final = wait_for(
            lambda: (s := [task_status(p, task_cid) for p in survivors]) and all(x and x["state"] == "done" for x in s) and s,
            timeout=240, interval=1.0,
        )
        assert all(s["term"] > old_term and s["coordinator"] != old_coordinator for s in final)
        # Killed members lose no plan of a living coordinator: none follows a plan after one it missed.
        assert all("missed_plan" not in s["rejected"] for s in final), [s["rejected"] for s in final]
        assert len({s["latest_model_cid"] for s in final}) == 1
        chain = verified_chain(survivors[0], task_cid)  # no fork, no gap, every signature checks
        assert chain.records[-1].record.step == STEPS
        # The same records (each member keeps the quorum of attestations it counted: the proofs may
        # name different members, the records are the same).
        assert verified_chain(survivors[1], task_cid).records == chain.records
        coordinators = [r.record.coordinator for r in chain.records]
        assert old_coordinator in coordinators and len(set(coordinators)) >= 2
        assert any(joiner.peer_id in r.record.members for r in chain.records)
        recorded = chain.records[-1].record.metrics["accuracy"]
        assert recorded >= 0.90

        # A fresh home, no node of its own: fetch by CID through the mesh, then evaluate there.
        model_cid = chain.head_cid
        fresh = tmp_path / "fresh"
        out = tmp_path / "model.safetensors"
        summary = json.loads(cli("model", "fetch", model_cid, "-o", str(out), "--home", str(fresh),
                                 "--bootstrap", survivors[0].addr, "--json"))
        assert summary["model_cid"] == model_cid and out.stat().st_size == summary["bytes"]
        result = json.loads(cli("model", "eval", str(out), "--dataset", manifest, "--home", str(fresh),
                                "--bootstrap", survivors[1].addr, "--json"))
        assert result["accuracy"] == pytest.approx(recorded, abs=1e-9)

        # Finished runs stay findable: every survivor but one that is not the coordinator stops, so
        # no coordinator publishes heads any more; `model fetch --latest` from a fresh home asks, and
        # that member answers with its head (the chain is re-verified by the fetcher).
        keep = next(p for p in survivors if p.peer_id != final[0]["coordinator"])
        for p in survivors:
            if p is not keep:
                p.terminate()
        latest = tmp_path / "latest.safetensors"
        summary = json.loads(cli("model", "fetch", "--latest", task_cid, "-o", str(latest), "--home",
                                 str(tmp_path / "fresh-latest"), "--bootstrap", keep.addr, "--json"))
        assert summary["model_cid"] == model_cid and latest.stat().st_size == summary["bytes"]
