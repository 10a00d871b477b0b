"""Which peers serve which model: the directory behind ``p2ptrain model predict CID`` with no --url.

``p2ptrain model serve`` beside a running node asks it (control op ``serve.announce``, every
SERVED_EVERY_S) to publish a :class:`~p2ptrain.wire.ModelServed` on the tasks topic; every
peer keeps what it hears for SERVED_TTL_S, and ``serve.find`` lists the URLs known for a CID, so
inference spreads across the peers that serve a model as training spreads across members.

Announcements come from anyone, so the table is bounded (models, servers per model, models per
peer), entries expire unless repeated, URLs must be plain http(s)://host:port, and every refusal is
counted (``node status`` → services.serving). An entry is a claim: ``model predict`` checks that
the answer names the CID it asked for (docs/serving.md says what that does not prove).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any
from urllib.parse import urlsplit

import trio

from p2ptrain.base import UserError, count_rejection, short_id
from p2ptrain.ipfs import InvalidCID, parse_cid, requested_cid
from p2ptrain.control import ops as control_ops
from p2ptrain.node import Node
from p2ptrain.wire import ModelServed, Signed, TASKS_TOPIC

logger = logging.getLogger(__name__)

# `model serve` re-announces this often: a new peer learns of a server within this long.
SERVED_EVERY_S = 10.0
# An entry not repeated for this long is dropped: three announcements missed (a stopped server
# leaves the directory within half a minute).
SERVED_TTL_S = 35.0
# Model CIDs listed at once, servers listed per model, models one peer may list: a flood of
# made-up announcements fills these and is refused (counted "full"), memory stays bounded
# (1024 x 32 entries of ~400 B: ~13 MB at worst).
MAX_SERVED_MODELS = 1024
MAX_SERVERS_PER_MODEL = 32
MAX_MODELS_PER_PEER = 8


def check_url(url: str) -> str:
    """``url`` if it is a plain http(s)://host:port[/] URL; ValueError naming the problem otherwise."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ValueError(f"{url[:64]!r} is not a URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise ValueError(f"{url[:64]!r}: a server URL is http(s)://host:port")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"{url[:64]!r}: a server URL has no path, query or credentials")
    return url.rstrip("/")


class ServedModels:
    """The directory: model CID -> peer -> (URL, expiry); ``rejected`` counts refused announcements."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.table: dict[str, dict[str, tuple[str, float]]] = {}
        self.rejected: Counter[str] = Counter()
        self.announced = 0
        node.on(ModelServed, self._on_served)
        node.control.register(control_ops.SERVE_ANNOUNCE, self._announce_op)
        node.control.register(control_ops.SERVE_FIND, self._find_op)
        node.add_status("serving", self.status)

    def _on_served(self, signed: Signed[ModelServed], topic: str) -> None:
        msg = signed.msg
        self.note(signed.sender.to_base58(), msg.model_cid, msg.url)

    def note(self, peer: str, model_cid: str, url: str) -> bool:
        """List ``peer`` as a server of ``model_cid`` at ``url`` for SERVED_TTL_S (False: refused, counted)."""
        try:
            parse_cid(model_cid)
            url = check_url(url)
        except (InvalidCID, ValueError) as exc:
            count_rejection(self.rejected, "bad", logger, logging.INFO, "refused a served-model announcement of %s: %s",
                            short_id(peer), exc)
            return False
        now = trio.current_time()
        self._expire(now)
        servers = self.table.get(model_cid)
        mine = sum(1 for listed in self.table.values() if peer in listed)
        fresh = servers is None or peer not in servers
        if fresh and (mine >= MAX_MODELS_PER_PEER or (servers is None and len(self.table) >= MAX_SERVED_MODELS)
                      or (servers is not None and len(servers) >= MAX_SERVERS_PER_MODEL)):
            count_rejection(self.rejected, "full", logger, logging.INFO, "served-model directory full: dropped %s of %s",
                            model_cid, short_id(peer))
            return False
        self.table.setdefault(model_cid, {})[peer] = (url, now + SERVED_TTL_S)
        return True

    def servers(self, model_cid: str) -> list[dict[str, str]]:
        """The live servers of ``model_cid``: [{"peer", "url"}], freshest first."""
        self._expire(trio.current_time())
        listed = sorted(self.table.get(model_cid, {}).items(), key=lambda item: -item[1][1])
        return [{"peer": peer, "url": url} for peer, (url, _) in listed]

    def _expire(self, now: float) -> None:
        for cid in list(self.table):
            servers = {peer: entry for peer, entry in self.table[cid].items() if entry[1] > now}
            if servers:
                self.table[cid] = servers
            else:
                del self.table[cid]

    def status(self) -> dict[str, Any]:
        return {"models": len(self.table), "announced": self.announced, "rejected": dict(self.rejected)}

    async def _announce_op(self, request: dict[str, Any]) -> dict[str, Any]:
        """``model serve``: list this node as a server of ``model_cid`` at ``url`` and tell the mesh."""
        model_cid, url = str(request.get("model_cid", "")), str(request.get("url", ""))
        try:
            parse_cid(model_cid)
            url = check_url(url)
        except (InvalidCID, ValueError) as exc:
            raise UserError(f"serve.announce: {exc}") from None
        if not self.note(self.node.peer_id.to_base58(), model_cid, url):
            raise UserError("serve.announce: the served-model directory is full")
        await self.node.publish(TASKS_TOPIC, ModelServed(model_cid=model_cid, url=url))
        self.announced += 1
        return {"model_cid": model_cid, "url": url, "every_s": SERVED_EVERY_S}

    async def _find_op(self, request: dict[str, Any]) -> dict[str, Any]:
        """``model predict``: who serves ``model_cid`` (this node's own server included)."""
        model_cid = requested_cid(request.get("model_cid", ""))
        return {"model_cid": model_cid, "servers": self.servers(model_cid)}
