"""The chaos bench's heartbeat-only Sybils (issue 27): the heartbeats it signs for throwaway
identities are ones an honest node takes, and each identity then advertises the task in that node's
membership view (what `run.advertising()` reads), so the bench's scenario attacks what it says."""

from __future__ import annotations

from pathlib import Path

import trio

from p2ptrain.testing import local_peers
from p2ptrain.wire import MESH_TOPIC

from .test_model_bomb import bounds, hostile

TASK = "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o"


async def test_the_benchs_sybil_heartbeats_advertise_the_task_to_an_honest_node(tmp_path: Path) -> None:
    async with local_peers(1, tmp_path) as peers, hostile.hostile_peer() as peer:
        node = peers[0].node
        with trio.fail_after(60):
            target = await peer.connect(str(node.addrs[0]))
            await peer.wait_in_topic(MESH_TOPIC, [target])
            sent = await bounds.heartbeat_sybils(peer, TASK, identities=3, seconds=1.5)
            ids = set(sent["identities"])

            def advertising() -> set[str]:
                return {r.peer_id.to_base58() for r in node.membership.alive() if TASK in r.tasks}

            while not ids <= advertising():
                await trio.sleep(0.1)
        assert len(ids) == 3 and sent["heartbeats"] >= 3
