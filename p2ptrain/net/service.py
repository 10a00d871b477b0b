"""Run a py-libp2p ``Service`` (pubsub, its router, the DHT) inside a trio block.

py-libp2p's own ``background_trio_service`` stops the service in an unshielded ``finally``: when
the block is left because of a cancellation, the stop is cancelled at once and the service's tasks
are torn down mid-flight, which is where 'Nursery is closed to new arrivals' and leaked sockets
come from. Here the stop is shielded and bounded, so leaving the block always stops the service
in order, and a service that hangs is cancelled after ``STOP_TIMEOUT_S``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
from libp2p.tools.anyio_service.trio_manager import TrioManager

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 5.0


@asynccontextmanager
async def running_service(service: object, name: str) -> AsyncIterator[TrioManager]:
    """Run ``service`` for the duration of the block; stop it in order on the way out."""
    async with trio.open_nursery() as nursery:
        manager = TrioManager(service)  # type: ignore[arg-type]
        service._manager = manager  # type: ignore[attr-defined]
        nursery.start_soon(manager.run, name=f"service:{name}")
        await manager.wait_started()
        try:
            yield manager
        finally:
            with trio.CancelScope(shield=True):
                with trio.move_on_after(STOP_TIMEOUT_S) as scope:
                    await manager.stop()
                if scope.cancelled_caught:
                    logger.warning("%s did not stop in %.0f s; cancelling it", name, STOP_TIMEOUT_S)
                    nursery.cancel_scope.cancel()
