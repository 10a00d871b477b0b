"""``model serve --latest TASK --bootstrap ADDR`` with no node running for the home: one temporary
node for the server's life.

Without a running node, ``--latest`` needs a node of its own to ask the mesh for the task's head
(:class:`~p2ptrain.services.LatestFinder`: asks, then fetches and re-verifies the chain it is
told of) and to fetch the model by Bitswap. ``model fetch --latest`` starts one for the command and
stops it; a server looks up the head every ``LATEST_POLL_S`` (5 s), and a node started per lookup
meant a new host, new connections and a fresh mesh every 5 s. :class:`TemporaryFollower` starts
one node with the server and keeps it, and one finder on it: a lookup only listens for a head newer
than the last one.

The server's follower calls lookups from a worker thread (``Server.follow`` is blocking), so
:meth:`TemporaryFollower.latest_blocking` runs :meth:`~TemporaryFollower.latest` back in the trio
thread where the node lives.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import trio

from p2ptrain.base import UserError
from p2ptrain.ipfs import ContentUnavailable
from p2ptrain.node import Node, NodeConfig
from p2ptrain.services import LatestFinder, MAX_SEEN_HEADS, make_fetcher
from p2ptrain.training import stage_file_cids

__all__ = ["FIRST_LOOKUP_S", "LOOKUP_S", "TemporaryFollower"]

logger = logging.getLogger(__name__)

# The first lookup: the temporary node connects through --bootstrap, a holder answers, the chain is
# fetched and verified within this (model fetch --latest's temporary node has the same 20 s).
FIRST_LOOKUP_S = 20.0
# A later lookup listens this long for a head newer than the last: holders answer a head request
# within a second (each at most once a second per task) and requests go out every 2 s
# (latest.HEAD_REQUEST_EVERY_S), so 5 s is two rounds. Nothing newer: the current head stands.
LOOKUP_S = 5.0
# The model a verified head names is fetched within this (as model fetch's 300 s).
MODEL_FETCH_TIMEOUT_S = 300.0


class TemporaryFollower:
    """One node (the home's identity, a free loopback port, ``bootstrap``) and one head finder for
    ``task_cid``, for as long as :meth:`run` runs; ``lookups`` counts the lookups answered."""

    def __init__(self, home: Path, bootstrap: list[str], task_cid: str, *, lookup_s: float = LOOKUP_S) -> None:
        self.node = Node(home, replace(NodeConfig.of_home(home), listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=bootstrap))
        self.peer = make_fetcher(self.node)
        self.finder = LatestFinder(self.node, self.peer.content, task_cid)
        self.task_cid = task_cid
        self.bootstrap = bootstrap
        self.lookup_s = lookup_s
        self.lookups = 0
        self._token: trio.lowlevel.TrioToken | None = None

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Run the node until cancelled (``started`` once it runs; the first lookup waits for peers)."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.node.run)
            self._token = trio.lowlevel.current_trio_token()
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self.node.stop()

    async def latest(self) -> str:
        """The newest verified head's model CID, made local. UserError when none is known yet."""
        first = self.finder.best is None
        if self.finder.judged >= MAX_SEEN_HEADS // 2:
            self.finder.forget_judged()  # the finder lives as long as the server: keep its memory bounded
        with trio.move_on_after(FIRST_LOOKUP_S if first else self.lookup_s):
            try:
                await self.finder.find()
            except ContentUnavailable as exc:  # the task itself (its rules) could not be had
                raise UserError(f"task {self.task_cid}: {exc}") from None
        cid = self.finder.model_cid
        if cid is None:
            connected = self.node.host is not None and self.node.host.get_connected_peers()
            raise UserError(
                f"no peer told us the latest model of task {self.task_cid} within {FIRST_LOOKUP_S:.0f} s"
                if connected else f"no peer reachable through {self.bootstrap[0]}")
        store = self.peer.content.store
        try:
            if not await trio.to_thread.run_sync(store.has, cid):
                await self.peer.content.fetch(cid, timeout=MODEL_FETCH_TIMEOUT_S)
            # A pipelined run's model: the manifest's stage files too (assembled by load_served).
            for part in await trio.to_thread.run_sync(stage_file_cids, store, cid):
                if not await trio.to_thread.run_sync(store.has, part):
                    await self.peer.content.fetch(part, timeout=MODEL_FETCH_TIMEOUT_S)
        except ContentUnavailable as exc:
            raise UserError(str(exc)) from None
        self.lookups += 1
        return cid

    def latest_blocking(self) -> str:
        """:meth:`latest`, from a worker thread of the trio run the node lives in (the server's
        follower thread, or ``open_model`` run with ``trio.to_thread``)."""
        assert self._token is not None, "run() first"
        return trio.from_thread.run(self.latest, trio_token=self._token)
