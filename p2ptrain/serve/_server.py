"""A model server: a :class:`Batcher` behind the HTTP app, run by hypercorn on trio.

Why hypercorn: it is a maintained ASGI server (HTTP/1.1 and HTTP/2, keep-alive, timeouts, request
size limits on headers) with a native trio worker, so the server runs in the same structured
concurrency as the rest of p2ptrain: one nursery holds the listener, the batch loop and the head
follower, and cancelling it stops all three. (uvicorn runs on asyncio only; aiohttp too.)

Open connections are capped (``--max-connections``): the accept loop is ours
(:mod:`p2ptrain.serve._connections`), each connection served by hypercorn's own connection server.

``follow`` (for ``--latest``) is a blocking function that returns the newest confirmed model CID of a
task, made local; it runs in a worker thread every ``follow_every_s``, and a new CID is loaded
(verified against its CID by the store, built from the registry) and swapped in between batches.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import trio

from p2ptrain.base import AddressError, ArgumentError, UserError, format_host_port, parse_host_port
from p2ptrain.ipfs import ContentStore
from p2ptrain.services import SERVED_EVERY_S
from p2ptrain.serve._app import BODY_TIMEOUT_S, ServeApp
from p2ptrain.serve._batcher import Batcher, Loaded
from p2ptrain.serve._connection_limits import MAX_CONNECTIONS, MAX_CONNECTIONS_LIMIT
from p2ptrain.serve._input_spec import UserModel, spec_for
from p2ptrain.protocol import load_model_bytes, read_model_card
from p2ptrain.run import record_naming
from p2ptrain.training import resolve_device as training_device

if TYPE_CHECKING:
    from p2ptrain.serve._connections import CappedListener

logger = logging.getLogger(__name__)

# Samples in one forward, at most (--max-batch): 4096 digits rows are 1 MB of input; more only
# delays the first answers of a batch.
MAX_BATCH_LIMIT = 4096
# How long the batch loop waits for more requests after the first (--max-wait-ms), at most: past a
# second the wait is a stall, not batching.
MAX_WAIT_MS_LIMIT = 1000
# --latest: how often the task's newest confirmed head is looked up (a control call to the running
# node, or a temporary node's head request): checkpoints come every few seconds at the fastest.
LATEST_POLL_S = 5.0
# A connection idle this long between requests is closed (hypercorn keep_alive_timeout), and one
# that sends nothing for READ_TIMEOUT_S is dropped (hypercorn's read_timeout: per read, so it bounds
# a silent client, not a trickling one; a body's whole time is app.BODY_TIMEOUT_S).
KEEP_ALIVE_S = 30
READ_TIMEOUT_S = 30
# Connections waiting to be accepted (listen backlog): the bench's 64 clients and then some.
BACKLOG = 1024


def resolve_device(device: str) -> torch.device:
    """``auto`` (CUDA if available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``; a
    :class:`~p2ptrain.training.DeviceError` (an ArgumentError naming ``device``) otherwise."""
    return training_device(device)


def load_served(store: ContentStore, cid: str, device: torch.device, home: Path | None = None,
                user_model: UserModel | None = None) -> Loaded:
    """The model ``cid`` from ``store`` (every byte verified), built from the registry (or loaded
    into a copy of the user's own instance), on ``device``."""
    from p2ptrain.training import model_file, model_from_bytes
    from p2ptrain.models import file_bytes_bound

    # A registry model's file: one member's (a pipelined run's stages assembled within what their
    # architecture takes); a user's is the size of its instance's own file.
    bound = None if user_model is None else file_bytes_bound(user_model.module.state_dict().values())
    data = model_file(store, cid, max_bytes=bound)
    card = read_model_card(data) or {}
    if user_model is not None:
        module = copy.deepcopy(user_model.module)  # a followed head swaps in beside the one serving
        load_model_bytes(module, data)  # RecordError unless the file fits the instance exactly
        spec = user_model.spec(module)
    else:
        module = model_from_bytes(data)  # RecordError for anything that is not a p2ptrain model
        try:
            spec = spec_for(card)
        except ValueError as exc:
            raise UserError(f"{cid}: {exc}") from None
    info: dict[str, Any] = {"model": card, "parameters": sum(p.numel() for p in module.parameters()),
                            "task_cid": None, "version": None, "step": None, "metrics": None, "attestations": None}
    if home is not None:
        info.update(record_info(home, cid))
    return Loaded(module.to(device).eval(), cid, spec, info, device)


def record_info(home: Path, model_cid: str) -> dict[str, Any]:
    """Task, version, step, metrics and attestations of the confirmed record of ``model_cid`` in the
    chains this home keeps (``tasks/*/chain.jsonl``), or {} if none holds it.

    ``attestations`` counts the signed attestations the chain keeps for the record: a quorum of
    its members, which is what confirmed it.
    """
    entry = record_naming(home, model_cid)
    if entry is None:
        return {}
    record = entry.signed.record
    return {"task_cid": record.task_cid, "version": record.version, "step": record.step,
            "metrics": dict(record.metrics), "members": len(record.members),
            "attestations": len(entry.attestations)}


class Server:
    """Serve ``loaded`` on ``listen`` (host:port; port 0 picks one) until cancelled.

    Embed it in a trio program with ``url = await nursery.start(server.run)``.
    """

    def __init__(
        self, loaded: Loaded, *, listen: str = "127.0.0.1:8080", max_batch: int = 64, max_wait_ms: float = 5.0,
        follow: Callable[[], str] | None = None, store: ContentStore | None = None, home: Path | None = None,
        follow_every_s: float = LATEST_POLL_S, announce: Callable[[str, str], None] | None = None,
        max_connections: int = MAX_CONNECTIONS, body_timeout_s: float = BODY_TIMEOUT_S,
        user_model: UserModel | None = None,
    ) -> None:
        if not 1 <= max_batch <= MAX_BATCH_LIMIT:
            raise ArgumentError("{max_batch} must be 1 to {limit}", limit=MAX_BATCH_LIMIT)
        if not 0 <= max_wait_ms <= MAX_WAIT_MS_LIMIT:
            raise ArgumentError("{max_wait_ms} must be 0 to {limit}", limit=MAX_WAIT_MS_LIMIT)
        if not 1 <= max_connections <= MAX_CONNECTIONS_LIMIT:
            raise ArgumentError("{max_connections} must be 1 to {limit}", limit=MAX_CONNECTIONS_LIMIT)
        try:
            self.bind = format_host_port(*parse_host_port(listen))
        except AddressError:
            raise ArgumentError("{listen:{value!r}}: give HOST:PORT (port 0 to 65535; 0 picks a free one)",
                                value=listen) from None
        if follow is not None and store is None:
            raise ValueError("follow needs the store its CIDs are made local in")
        self.batcher = Batcher(loaded, max_batch, max_wait_ms / 1000)
        self.app = ServeApp(self.batcher, body_timeout_s)
        self.listen, self.follow, self.store, self.home = listen, follow, store, home
        self.follow_every_s = follow_every_s
        self.user_model = user_model  # the user's instance that followed heads load into (a copy each)
        self.follow_failures = 0
        self.announce = announce
        self.max_connections = max_connections
        self._listener: CappedListener | None = None

    @property
    def connections(self) -> int:
        """Connections open now (at most ``max_connections``)."""
        return self._listener.open if self._listener is not None else 0

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        from hypercorn.config import Config

        from p2ptrain.serve._connections import serve_capped  # hypercorn: the optional extra

        config = Config()
        config.bind = [self.bind]
        config.accesslog = None
        config.errorlog = logging.getLogger("hypercorn.error")
        config.keep_alive_timeout = KEEP_ALIVE_S
        config.read_timeout = READ_TIMEOUT_S
        config.backlog = BACKLOG
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.batcher.run)
            url, self._listener = await nursery.start(serve_capped, self.app, config, self.max_connections, self.listen)
            if self.follow is not None:
                nursery.start_soon(self._follow)
            if self.announce is not None:
                nursery.start_soon(self._announce, url)
            task_status.started(url)

    async def _announce(self, url: str) -> None:
        """Tell the mesh we serve the current model, every SERVED_EVERY_S (``announce(cid, url)``
        is blocking: a control call to the home's node); a failure is logged and tried again."""
        assert self.announce is not None
        failures = 0
        while True:
            try:
                await trio.to_thread.run_sync(self.announce, self.batcher.current.cid, url)
            except Exception as exc:  # no node now, or it refused: serving goes on unannounced
                failures += 1  # said once at INFO (a server without a node is normal), then at DEBUG
                if failures & (failures - 1) == 0:
                    logger.log(logging.INFO if failures == 1 else logging.DEBUG,
                               "not announced on the mesh (%d times so far): %s", failures, exc)
            else:
                if failures:
                    logger.info("announced on the mesh at %s", url)
                failures = 0
            await trio.sleep(SERVED_EVERY_S)

    async def _follow(self) -> None:
        """Swap to each new head ``follow`` names; a failed lookup keeps the current model (logged)."""
        assert self.follow is not None and self.store is not None
        while True:
            await trio.sleep(self.follow_every_s)
            try:
                cid = await trio.to_thread.run_sync(self.follow)
                if cid != self.batcher.current.cid:
                    device = self.batcher.current.device
                    loaded = await trio.to_thread.run_sync(load_served, self.store, cid, device, self.home,
                                                          self.user_model)
                    self.batcher.swap(loaded)
            except Exception as exc:  # a head not found or not loadable now: serve on, try again
                self.follow_failures += 1  # logged the 1st, 2nd, 4th, ... time: a stopped node is not a line every 5 s
                n = self.follow_failures
                if n & (n - 1) == 0:
                    logger.warning("following the task's latest model: keeping %s (%d failed lookups so far): %s",
                                   self.batcher.current.cid, n, exc)
