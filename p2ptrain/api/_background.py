"""A full p2ptrain peer (node, content and task services) on a thread of the user's process.

``p2ptrain.Optimizer`` lives in the user's training loop, which is plain blocking Python; the peer
is trio. So the peer runs its own ``trio.run`` on a background thread, and the user's thread calls
into it with :meth:`BackgroundPeer.call` (``trio.from_thread.run``). Why in-process and not the home's
running node (``p2ptrain node start``): the gradients are the user's tensors, one model-sized vector
per step; crossing a process boundary (the control socket) would copy each one twice more and
serialize it, where in-process the round loop reads the very tensor ``opt.step()`` handed over
(docs/api.md measures what this choice costs per step).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import trio

from p2ptrain.base import UserError, first_leaf
from p2ptrain.node import Node, NodeConfig
from p2ptrain.services import Peer, make_peer

log = logging.getLogger(__name__)

T = TypeVar("T")

# The peer's listeners and services are up within this (imports done, a host started, the control
# socket bound); a slower start is a broken environment, said in one line.
START_TIMEOUT_S = 120.0
# close(): the node stops (its goodbye sent, its runs cancelled) within this, else the thread is left.
STOP_TIMEOUT_S = 30.0


class BackgroundPeer:
    """A peer of ``home`` with ``config``, run by a daemon thread until :meth:`close`."""

    def __init__(self, home: Path, config: NodeConfig, *, metrics_at: tuple[str, int] | None = None) -> None:
        self.home = home
        self._config = config
        self._metrics_at = metrics_at  # (host, port) of a Prometheus endpoint, as node start --metrics
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._nursery: trio.Nursery | None = None
        self.peer: Peer | None = None
        libp2p = logging.getLogger("libp2p")
        if libp2p.level in (logging.NOTSET, logging.WARNING) and not os.environ.get("LIBP2P_DEBUG"):
            # py-libp2p logs expected churn (a DHT stream a peer closed, a redial of a member that
            # left) at WARNING and ERROR, on its own logger (WARNING, no handler, not propagated), so
            # Python's last-resort handler prints it bare on the user's terminal; as `node start`
            # does, keep it out of the way unless the script chose a level or set LIBP2P_DEBUG.
            libp2p.setLevel(logging.CRITICAL)
        self._thread = threading.Thread(target=self._main, name="p2ptrain-peer", daemon=True)
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            raise UserError(f"the p2ptrain peer of {home} did not start within {START_TIMEOUT_S:.0f} s")
        if self._error is not None:
            raise self._error

    def _main(self) -> None:
        try:
            trio.run(self._run)
        except BaseExceptionGroup as group:  # handed to the thread that waits for the start
            user_errors, _ = group.split(UserError)  # a taken port reads as one line in the script
            self._error = first_leaf(user_errors) if user_errors is not None else group
            log.debug("the background peer stopped: %r", group)
        except BaseException as exc:
            self._error = exc
            log.debug("the background peer stopped: %r", exc)
        finally:
            self._ready.set()

    async def _run(self) -> None:
        node = Node(self.home, self._config)
        self.peer = make_peer(node)
        if self._metrics_at is not None:
            from p2ptrain.services import MetricsServer

            node.add_service(MetricsServer(self.peer, *self._metrics_at).run, name="metrics")
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            async with trio.open_nursery() as self._nursery:  # what start_soon runs, ended before the node
                self._ready.set()
                await self._stop.wait()
                self._nursery.cancel_scope.cancel()
            node.stop()

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and self._token is not None

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``await fn(*args)`` in the peer's trio thread and return its result (from the user's thread)."""
        if not self.running:
            raise UserError("the p2ptrain peer of this run is not running (closed, or it failed)")
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run the synchronous ``fn(*args)`` in the peer's trio thread (e.g. to read its state)."""
        if not self.running:
            raise UserError("the p2ptrain peer of this run is not running (closed, or it failed)")
        return trio.from_thread.run_sync(fn, *args, trio_token=self._token)

    def start_soon(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run ``await fn(*args)`` in the peer's trio thread until the peer closes (from any thread
        that is not the peer's own; the peer's own code uses its nursery directly)."""
        assert self._nursery is not None
        nursery = self._nursery
        if threading.current_thread() is self._thread:
            nursery.start_soon(fn, *args)
        else:
            trio.from_thread.run_sync(nursery.start_soon, fn, *args, trio_token=self._token)

    def close(self) -> None:
        """Stop the node (goodbye sent, runs ended) and its thread; idempotent."""
        if self.running and self._stop is not None:
            stop = self._stop
            try:
                trio.from_thread.run_sync(stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join(STOP_TIMEOUT_S)
        if self._thread.is_alive():
            log.warning("the p2ptrain peer of %s did not stop within %.0f s", self.home, STOP_TIMEOUT_S)
