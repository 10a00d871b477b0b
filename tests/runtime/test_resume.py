"""A run survives losing every member: restarted on their homes, the members resume from their last
confirmed record (issue 32). Real loopback peers in this process (``p2ptrain.testing.local_peers``),
stopped and started again on the same homes; the SIGKILL of real processes is
tests/runtime/test_whole_run_restart.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import trio

from p2ptrain.run import RunDir
from p2ptrain.run._ballots_file import load_voted_through
from p2ptrain.testing import LocalPeers, local_peers, publish_digits_task
from p2ptrain.protocol import Chain, read_chain, sign_record
from p2ptrain.protocol._lineage import entry_bytes
from p2ptrain.wire import ConfirmedRecord

pytestmark = pytest.mark.usefixtures("quick_timers")  # tests/conftest.py: the protocol's idle waits shortened

# Three peers start, a run of a few dozen rounds twice: well under two minutes alone.
DEADLINE_S = 240.0
# One condition (a checkpoint, every member done): rounds of this model take milliseconds.
STEP_S = 90.0


def chain_bytes(peers: LocalPeers, index: int, task_cid: str) -> bytes:
    return (peers[index].node.home / "tasks" / task_cid / "chain.jsonl").read_bytes()


def verified(data: bytes, task_cid: str) -> Chain:
    return read_chain(task_cid, data)


async def run_to_the_end(peers: LocalPeers, task_cid: str) -> list[dict[str, Any]]:
    def done() -> list[dict[str, Any]] | None:
        statuses = [peers.status(i, task_cid) for i in range(len(peers))]
        return statuses if all(s.get("state") == "done" for s in statuses) else None

    return await peers.wait_until(done, STEP_S, what="every member done")


@pytest.mark.timeout(300)  # the suite's bound, declared: tests/conftest.py deals it among the first (~30 s or more alone)
async def test_members_stopped_together_resume_from_their_last_record_and_end_where_an_unstopped_run_ends(
    tmp_path: Path,
) -> None:
    with trio.fail_after(DEADLINE_S):
        async with local_peers(3, tmp_path) as peers:
            # The same task twice but for its name: the same seed, data, model and rounds.
            # Stopped at v3 (step 12), three checkpoints before the end; no one else can join
            # (peers.max 3), so the first plan needs no grace for joiners.
            stopped = await publish_digits_task(peers[0], name="stopped", total_steps=24, checkpoint_interval=4,
                                                min_peers=3, max_peers=3)
            unstopped = await publish_digits_task(peers[0], name="unstopped", total_steps=24, checkpoint_interval=4,
                                                  min_peers=3, max_peers=3)
            await peers.join_all(unstopped)
            reference = await run_to_the_end(peers, unstopped)

            await peers.join_all(stopped)

            await peers.wait_version(stopped, 3, STEP_S, range(3), what="every member at model v3")
            for i in range(3):
                await peers.stop_peer(i)
            before = [chain_bytes(peers, i, stopped) for i in range(3)]
            voted = [load_voted_through(RunDir.of(peers[i].node.home, stopped)) for i in range(3)]
            for i in range(3):
                await peers.restart_peer(i, see_all=False)
            await peers.wait_connected()
            await peers.join_all(stopped)
            final = await run_to_the_end(peers, stopped)

            heads = [verified(b, stopped) for b in before]
            longest = max(heads, key=lambda c: c.version)
            for i, status in enumerate(final):
                assert status["resumed_from"] is not None
                # Every member resumed at the longest chain any of them held, not at step 0.
                assert status["resumed_from"] == {"version": longest.version,
                                                  "step": longest.records[-1].record.step}
                after = chain_bytes(peers, i, stopped)
                assert after.startswith(before[i]), "a record of the chain before the stop was lost or changed"
                assert verified(after, stopped).to_bytes() == after
            assert {s["latest_model_cid"] for s in final} == {reference[0]["latest_model_cid"]}
            # Each home kept where it voted (run/_ballots_file.py), through the stop: the terms of
            # the resumed run come after the last record's, whose coordinator voted for itself.
            voted_after = [load_voted_through(RunDir.of(peers[i].node.home, stopped)) for i in range(3)]
            terms = [v for v in voted if v is not None]
            terms_after = [v for v in voted_after if v is not None]
            assert len(terms) == len(terms_after) == 3
            assert max(terms) >= longest.records[-1].record.term
            assert all(a >= b for a, b in zip(terms_after, terms))
            assert max(terms_after) > longest.records[-1].record.term


async def test_a_chain_file_whose_last_record_forks_is_refused_and_kept_as_it_was(tmp_path: Path) -> None:
    """The last line of a member's chain.jsonl is a record of its version that does not follow the
    record before it: that member's run is refused with the fork named (its file untouched, also
    while the others go on), and the others resume without it."""
    with trio.fail_after(DEADLINE_S):
        async with local_peers(3, tmp_path) as peers:
            task_cid = await publish_digits_task(peers[0], total_steps=400, checkpoint_interval=4, min_peers=2,
                                                 max_peers=3)
            await peers.join_all(task_cid)

            await peers.wait_version(task_cid, 3, STEP_S, range(3), what="every member at model v3")
            for i in range(3):
                await peers.stop_peer(i)
            chain = verified(chain_bytes(peers, 2, task_cid), task_cid)
            last = chain.records[-1].record
            forked = sign_record(replace(last, parent=chain.initial_cid), peers[2].node.key_pair, chain.records[-1].votes)
            line = entry_bytes(ConfirmedRecord(signed=forked, attestations=chain.proofs[-1]))
            damaged = chain.to_bytes().splitlines(keepends=True)[:-1] + [line + b"\n"]
            path = peers[2].node.home / "tasks" / task_cid / "chain.jsonl"
            path.write_bytes(b"".join(damaged))
            kept = path.read_bytes()
            versions = [verified(chain_bytes(peers, i, task_cid), task_cid).version for i in (0, 1)]

            for i in range(3):
                await peers.restart_peer(i, see_all=False)
            await peers.wait_connected()
            await peers.join_all(task_cid)

            def refused() -> dict[str, Any] | None:
                status = peers.status(2, task_cid)
                return status if status.get("state") == "failed" else None

            status = await peers.wait_until(refused, STEP_S, what="the member with the forked file refused")
            assert "fork" in status["error"] and "chain.jsonl" in status["error"], status["error"]
            assert status["rounds_done"] == 0

            def others_moved_on() -> list[dict[str, Any]] | None:
                statuses = [peers.status(i, task_cid) for i in (0, 1)]
                return statuses if all(s.get("version", 0) > max(versions) for s in statuses) else None

            await peers.wait_until(others_moved_on, STEP_S, what="the other two past their chains' head")
            assert path.read_bytes() == kept


@pytest.mark.timeout(300)  # the suite's bound, declared: tests/conftest.py deals it among the first (~30 s or more alone)
async def test_a_member_restarted_while_the_run_goes_on_resumes_its_chain_then_catches_up(tmp_path: Path) -> None:
    """Only one member stops: the others train on. Started again on its home, it resumes from its
    own chain (not step 0), loads the head the run has reached (heard while it resumed, or from the
    coordinator it learns from the run's plans) and is planned again; its chain.jsonl keeps every
    record it had."""
    with trio.fail_after(DEADLINE_S):
        async with local_peers(3, tmp_path) as peers:
            task_cid = await publish_digits_task(peers[0], total_steps=100_000, checkpoint_interval=4, min_peers=2,
                                                 max_peers=3)
            await peers.join_all(task_cid)

            await peers.wait_version(task_cid, 2, STEP_S, range(3), what="every member at model v2")
            await peers.stop_peer(2)
            before = chain_bytes(peers, 2, task_cid)
            held = verified(before, task_cid)

            def moved_on() -> dict[str, Any] | None:
                status = peers.status(0, task_cid)
                return status if status["version"] >= held.version + 2 else None

            await peers.wait_until(moved_on, STEP_S, what="the other two two checkpoints further")
            await peers.restart_peer(2)
            await peers[2].tasks.join(task_cid)

            def back() -> dict[str, Any] | None:
                status, other = peers.status(2, task_cid), peers.status(0, task_cid)
                return status if peers[2].node.peer_id.to_base58() in other["members"] \
                    and status.get("rounds_done", 0) > 0 else None

            status = await peers.wait_until(back, STEP_S, what="the restarted member planned again")
            # From its own chain, or from the head the run had reached if a member answered first.
            assert status["resumed_from"] is not None and status["resumed_from"]["version"] >= held.version
            assert status["version"] > held.version + 1
            assert chain_bytes(peers, 2, task_cid).startswith(before)
