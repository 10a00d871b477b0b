"""A record that one member confirmed in time and its coordinator missed (two members of a digits
run in this process on 127.0.0.1).

The split of a full suite at load ~4: the coordinator's attestation deadline for v1 passed before
the other member's attestation came. That member had both attestations in time and confirmed v1;
the coordinator went on from the model before it and published its next checkpoint as another v1,
which the member refused as a fork, and so every record after it: no checkpoint for as long as the
run lasted. Here the other member's attestation of v1 reaches the coordinator only once it took
up that next v1 (``late``), or never (``lost``). Both fail on main (the run never ends). Now the
coordinator keeps v1 open and confirms it when the attestation comes (protocol/_attestations.py),
or when the member, refusing the sibling, sends it v1 with its proof (run/_attesting.py), and sets
its sibling aside, recording that checkpoint again on v1: one chain, a record at every checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio

from p2ptrain.protocol import _attestations
from p2ptrain.run import _attesting
from p2ptrain.testing import local_peers, publish_digits_task, wait_until
from p2ptrain.wire import SignedAttestation

pytestmark = pytest.mark.usefixtures("quick_timers")  # tests/conftest.py: the protocol's idle waits shortened

DEADLINE_S = 200.0
RUN_S = 150.0
DEADLINE = 4.0  # the attestation deadline (20 s): idle time here, where nothing else delays an attestation


@pytest.mark.parametrize("mode", ["late", "lost"])
async def test_a_record_its_coordinator_missed_the_quorum_of_is_confirmed_after_all(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, mode: str) -> None:
    monkeypatch.setattr(_attestations, "ATTEST_TIMEOUT_S", DEADLINE)
    caplog.set_level(logging.INFO, logger="p2ptrain")
    real = _attesting.Attesting.on_attestation
    held: list[tuple[_attesting.Attesting, SignedAttestation]] = []

    async def delayed(self: _attesting.Attesting, signed: SignedAttestation) -> None:
        run, att = self.run, signed.attestation
        if run.me == run.election.coordinator and att.attester != run.me and att.version == 1 and not held:
            held.append((self, signed))  # the member's first attestation of v1, as the coordinator gets it
            return
        await real(self, signed)

    monkeypatch.setattr(_attesting.Attesting, "on_attestation", delayed)
    with trio.fail_after(DEADLINE_S):
        async with local_peers(2, tmp_path) as peers:
            task_cid = await publish_digits_task(peers[0], total_steps=30, checkpoint_interval=10, min_peers=2,
                                                 max_peers=2)
            runs = await peers.join_all(task_cid)
            attesting, signed = await peers.wait_until(lambda: held[0] if held else None, RUN_S,
                                                       what="the member's attestation of v1 at the coordinator")
            coordinator = attesting.run
            if mode == "late":
                # It comes once the coordinator rejected v1 by its deadline and took up its next v1.
                await wait_until(lambda: (t := coordinator.attestations.tally) is not None
                                 and t.id != signed.attestation.record_id, RUN_S, what="the coordinator's next v1")
                await real(attesting, signed)
            statuses = await peers.wait_done(task_cid, RUN_S)
            chains = [run.require()[1].chain for run in runs]
    assert chains[0].records == chains[1].records
    # v1 the first checkpoint's; its sibling (the coordinator's next v1) recorded again on it as v2.
    assert [s.record.step for s in chains[0].records] == [10, 20, 30], [s.record for s in chains[0].records]
    assert chains[0].records[1].record.parent == chains[0].records[0].record.model_cid
    assert {s["latest_model_cid"] for s in statuses} == {chains[0].records[-1].record.model_cid}
    messages = [r.getMessage() for r in caplog.records]
    assert any("model record v1 (step 10) confirmed late" in m for m in messages), messages
    assert any("model record v1 (step 20) set aside" in m for m in messages), messages
    assert any("recording the checkpoint at step 20 again, as model v2" in m for m in messages), messages
    if mode == "lost":
        assert any("sending it that record and its proof" in m for m in messages), messages
