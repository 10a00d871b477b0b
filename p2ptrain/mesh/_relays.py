"""A private node keeps slots on relays, so that peers who cannot dial it reach it through them.

Policy: while our reachability is ``private``, hold reservations on up to :data:`RELAYS_WANTED`
connected peers whose heartbeats say ``public`` (a relay must be dialable by everyone); a peer that
refuses (it was not started with ``--relay-service``) is not asked again for
:data:`REFUSED_RETRY_S`. A relay we lost the connection to is dropped from what we advertise. Each
change is heartbeated at once (``on_change``): our heartbeat's addresses are how others learn the
circuit address.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from p2ptrain.mesh._discovery import dialable
from p2ptrain.mesh._membership import Membership
from p2ptrain.net import Reachability, Relaying

logger = logging.getLogger(__name__)

# Two relays: one can restart or leave mid-run without cutting us off.
RELAYS_WANTED = 2
# How often the reservations are looked at again (new public peers, lost relays).
CHECK_INTERVAL_S = 2.0
# A peer that refused a reservation (no relay service, or full) is asked again after this.
REFUSED_RETRY_S = 60.0


async def keep_reservations(host: IHost, relaying: Relaying, reachability: Reachability, membership: Membership,
                            on_change: Callable[[], None], *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Run for the node's lifetime (see the module)."""
    refused: dict[ID, float] = {}
    task_status.started()
    while True:
        before = dict(relaying.reserved)
        for relay in list(relaying.reserved):
            if not host.get_network().get_connections(relay):
                del relaying.reserved[relay]
        if reachability.status == "private" and len(relaying.reserved) < RELAYS_WANTED:
            now = trio.current_time()
            for record in membership.alive():
                if len(relaying.reserved) >= RELAYS_WANTED:
                    break
                peer = record.peer_id
                if (record.reachability != "public" or peer in relaying.reserved
                        or refused.get(peer, -REFUSED_RETRY_S) + REFUSED_RETRY_S > now
                        or not host.get_network().get_connections(peer)):
                    continue
                direct = [a for a in dialable(record.addrs, peer) if "/p2p-circuit" not in str(a)]
                if not direct:
                    continue
                if not await relaying.reserve(peer, Multiaddr(f"{direct[0]}/p2p/{peer.to_base58()}")):
                    refused[peer] = now
        if relaying.reserved != before:
            on_change()
        await trio.sleep(CHECK_INTERVAL_S)
