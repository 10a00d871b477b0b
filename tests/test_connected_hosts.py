"""p2ptrain.testing.connected_hosts, the public helper for multi-peer tests of one protocol."""

from __future__ import annotations

import trio

from p2ptrain.testing import connected_hosts

DEADLINE = 30


async def test_every_pair_is_connected_and_kill_stops_one_host_with_its_services():
    stopped = trio.Event()

    async def service(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started("up")
        try:
            await trio.sleep_forever()
        finally:
            stopped.set()

    with trio.fail_after(DEADLINE):
        async with connected_hosts(3) as peers:
            for i, a in enumerate(peers):
                for b in peers[i + 1:]:
                    assert b.id in a.host.get_connected_peers()
            assert await peers[2].start(service) == "up"
            peers[2].kill()
            await stopped.wait()
            # The others still talk to each other.
            assert peers[1].id in peers[0].host.get_connected_peers()


async def test_unconnected_hosts_know_nobody():
    with trio.fail_after(DEADLINE):
        async with connected_hosts(2, connected=False) as peers:
            assert [p.host.get_connected_peers() for p in peers] == [[], []]
