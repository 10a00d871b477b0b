"""A hostile member that signs its attestations with another version in their body (red team
h-attack), on three real peers in this process.

The chain's proof check (``attestation_problem``) skips such an attestation; the tally counted it.
So where it came before the other honest member's, it made a quorum with the record's own
attester, the tally was confirmed, ``Chain.append`` refused the proof and raised out of the
attestation handler (a ``handler-error``), and the record was never confirmed there: the honest
attestation that came next was not looked at (the tally had settled). Here each honest member
gets the hostile attestation first (the other honest member's is held until it was counted). Now
it is refused, and the honest quorum confirms every record.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import trio

from p2ptrain.protocol import signing
from p2ptrain.run import _attesting
from p2ptrain.testing import local_peers, publish_digits_task
from p2ptrain.wire import SignedAttestation

pytestmark = pytest.mark.usefixtures("quick_timers")  # tests/conftest.py: the protocol's idle waits shortened

RUN_S = 150.0


async def test_an_attestation_of_another_version_does_not_stall_the_members(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hostile: list[str] = []
    real_attest, real_on = _attesting.attest, _attesting.Attesting.on_attestation
    seen: dict[str, set[str]] = {}  # member -> ids of the records whose hostile attestation it counted
    held: dict[str, list[tuple[_attesting.Attesting, SignedAttestation]]] = {}  # record id -> held

    def attest(record: Any, model_cid: str, optimizer_cid: str, key_pair: Any) -> SignedAttestation:
        signed = real_attest(record, model_cid, optimizer_cid, key_pair)
        if signing.peer_str(key_pair) not in hostile:
            return signed
        body = replace(signed.attestation, version=signed.attestation.version + 7)
        return SignedAttestation(attestation=body, signature=signing.sign(body, key_pair))

    async def gated(self: _attesting.Attesting, signed: SignedAttestation) -> None:
        me, att = self.run.me, signed.attestation
        if not hostile or me in hostile or att.attester == me:
            await real_on(self, signed)
        elif att.attester in hostile:
            await real_on(self, signed)
            seen.setdefault(me, set()).add(att.record_id)
            for waiting, other in held.pop(f"{me} {att.record_id}", []):
                await real_on(waiting, other)
        elif att.record_id in seen.get(me, set()):
            await real_on(self, signed)
        else:  # the other honest member's: after the hostile one
            held.setdefault(f"{me} {att.record_id}", []).append((self, signed))

    monkeypatch.setattr(_attesting, "attest", attest)
    monkeypatch.setattr(_attesting.Attesting, "on_attestation", gated)
    with trio.fail_after(RUN_S + 30):
        async with local_peers(3, tmp_path) as peers:
            task_cid = await publish_digits_task(peers[0], total_steps=30, checkpoint_interval=10, min_peers=3,
                                                 max_peers=3)
            runs = await peers.join_all(task_cid)
            coordinator = await peers.wait_until(lambda: runs[0].election.coordinator, RUN_S, what="a coordinator")
            hostile.append(next(r.me for r in runs if r.me != coordinator))
            honest = [i for i, r in enumerate(runs) if r.me not in hostile]
            statuses = await peers.wait_done(task_cid, RUN_S, indices=honest)
    chains = [runs[i].require()[1].chain for i in honest]
    assert chains[0].records == chains[1].records
    assert [s.record.step for s in chains[0].records] == [10, 20, 30]
    assert all(hostile[0] not in {a.attestation.attester for a in proof} for proof in chains[0].proofs)
    assert {s["latest_model_cid"] for s in statuses} == {chains[0].records[-1].record.model_cid}
    assert seen, "the hostile member's attestations never came"
