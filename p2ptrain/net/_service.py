"""Run a py-libp2p ``Service`` (pubsub, its router, the DHT) inside a trio block.

py-libp2p's own ``background_trio_service`` stops the service in an unshielded ``finally``: when
the block is left because of a cancellation, the stop is cancelled at once and the service's tasks
are torn down mid-flight, which is where 'Nursery is closed to new arrivals' and leaked sockets
come from. Here the stop is shielded and bounded, so leaving the block always stops the service
in order, and whatever is still running after ``STOP_GRACE_S`` is cancelled in one go.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
from libp2p.tools.anyio_service.trio_manager import TrioManager

logger = logging.getLogger(__name__)

STOP_GRACE_S = 0.5


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
                with trio.move_on_after(STOP_GRACE_S):
                    await manager.stop()
                if not manager.is_finished:
                    # The manager cancels its tasks one at a time, each awaited (seconds for
                    # pubsub on a busy machine); past the grace period, cancel the rest at once.
                    logger.debug("%s still stopping after %.1f s; cancelling its tasks", name, STOP_GRACE_S)
                    nursery.cancel_scope.cancel()
