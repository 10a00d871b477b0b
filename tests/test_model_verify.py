"""`p2ptrain model verify`: a real run's lineage checks out from the task down (exit 0), and each way
of breaking a chain a member keeps is named, record by record (exit 1). Three loopback peers in this
process train a small digits task; the checks read a member's home after they stopped."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import trio

from p2ptrain.cli.verify import verify
from p2ptrain.testing import local_peers, publish_digits_task, run_forked
from p2ptrain.protocol._lineage import entry_bytes
from p2ptrain.protocol import entry_from_bytes, sign_record

pytestmark = pytest.mark.usefixtures("quick_timers")  # tests/conftest.py: the protocol's idle waits shortened

RUN_S = 180.0  # three peers start, train 9 rounds with 3 checkpoints, on a loaded 2-core box


async def _trained(tmp_path: Path) -> tuple[Path, str, dict[str, object]]:
    """A member's home after a 3-member run of 9 steps (3 records), the task, and the peers' keys."""
    with trio.fail_after(RUN_S):
        async with local_peers(3, tmp_path) as peers:
            task_cid = await publish_digits_task(peers[0], total_steps=9, checkpoint_interval=3, min_peers=3,
                                                 max_peers=3)  # all three are in: term 0 need not wait for more
            await peers.join_all(task_cid)

            def done() -> bool:
                return all(peers.status(i, task_cid).get("state") == "done" for i in range(3))

            await peers.wait_until(done, RUN_S, what="the run done on every member")
            keys = {p.node.peer_id.to_base58(): p.node.key_pair for p in peers}
            return peers[1].node.home, task_cid, keys


async def test_an_honest_lineage_verifies_and_every_break_is_named(tmp_path: Path) -> None:
    home, task_cid, keys = await _trained(tmp_path)

    def check() -> list[str]:
        report = verify(home, model_cid=None, task_cid=task_cid, bootstrap=[], evaluate=False)
        return report.problems

    honest = await trio.to_thread.run_sync(
        lambda: verify(home, model_cid=None, task_cid=task_cid, bootstrap=[], evaluate=True))
    assert honest.problems == [] and (honest.version, honest.records) == (3, 3)
    assert honest.eval is not None and honest.eval["recomputed"]["accuracy"] == honest.eval["recorded"]["accuracy"]

    path = home / "tasks" / task_cid / "chain.jsonl"
    original = path.read_bytes()
    entries = [entry_from_bytes(line) for line in original.splitlines()]

    def write(version: int, entry: object) -> None:
        lines = [entry_bytes(e) for e in entries]
        lines[version - 1] = entry_bytes(entry)  # type: ignore[arg-type]
        path.write_bytes(b"\n".join(lines) + b"\n")

    def resigned(entry: object, **change: object) -> object:
        """``entry`` with its record changed and signed again by its own coordinator's key."""
        record = dataclasses.replace(entry.signed.record, **change)  # type: ignore[attr-defined]
        signed = sign_record(record, keys[record.coordinator], entry.signed.votes)  # type: ignore[attr-defined]
        return dataclasses.replace(entry, signed=signed)  # type: ignore[type-var]

    v2 = entries[1]
    r2 = v2.signed.record
    cases = {
        # A forged record: its metrics changed after it was signed.
        "bad signature": dataclasses.replace(
            v2, signed=dataclasses.replace(v2.signed, record=dataclasses.replace(r2, metrics={"accuracy": 1.0}))),
        # One attestation where a quorum (2 of 3) is needed.
        "1 of its 3 members attested it, a quorum is 2": dataclasses.replace(v2, attestations=v2.attestations[:1]),
        # Its coordinator re-signs it naming only itself: its votes and attestations no longer fit.
        "a quorum is": resigned(v2, members=(r2.coordinator,)),
        # Its coordinator re-signs it with another parent.
        "is not the model before it": resigned(v2, parent=entries[0].signed.record.parent),
    }
    for why, entry in cases.items():
        write(2, entry)
        problems = await trio.to_thread.run_sync(check)
        assert problems and all(p.startswith("record v2") for p in problems), (why, problems)
        assert any(why in p for p in problems), (why, problems)
    # The command itself: exit 1 and one BREAK line per problem; exit 0 once the file is whole again.
    cmd = [sys.executable, "-m", "p2ptrain.cli.main", "model", "verify", "--latest", task_cid, "--home", str(home)]
    broken = await trio.to_thread.run_sync(lambda: run_forked(cmd, capture_output=True, text=True, timeout=120))
    assert broken.returncode == 1, broken.stderr
    assert [line for line in broken.stdout.splitlines() if line.startswith("BREAK record v2")]
    path.write_bytes(original)
    ok = await trio.to_thread.run_sync(
        lambda: run_forked(cmd + ["--json"], capture_output=True, text=True, timeout=120))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    summary = json.loads(ok.stdout)
    assert summary["ok"] and summary["version"] == 3 and summary["problems"] == []
