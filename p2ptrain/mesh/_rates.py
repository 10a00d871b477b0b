"""Per-sender rates of the message types a flood of makes expensive: token buckets keyed by
(verified sender, message type), clock-injected.

Why per type and per sender: pubsub's own inbound limit (``net.pubsub``, 1,000 messages a second
per forwarding peer) bounds how fast any peer can make a node check messages, but a check is not
the whole cost. A forged head of a run (issue 27) names a chain to verify and lists up to 1,024
members, and each one a node admits it also relays to its mesh peers: 131 a second took a run from
2.7 to 0.1 steps/s. An honest peer sends a task's head every 2 s (its coordinator) or once a second
when asked (a member of a finished run), and a head request every second or two, so a rate far
above that, per sender, costs honest peers nothing and caps what one identity can make every node
decode, verify and relay.

The buckets are only the bookkeeping; :class:`~p2ptrain.mesh.MessageRouter` decides when to
look (before a message is verified) and when to charge (once its sender is verified).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

from p2ptrain.base import refilled

# (sender, type) buckets kept at once; the least recently used goes first. Forgetting a bucket only
# refills it, so the cap bounds memory (a flood of fresh identities), not any rate: each identity
# is its own sender either way.
MAX_BUCKETS = 4096


@dataclass(frozen=True)
class Rate:
    """``per_s`` messages a second on average, ``burst`` at once. With ``unit_bytes``, a message
    costs one token per started ``unit_bytes`` of its data instead of one: what a node pays to check
    a message (decode, schema, handlers) grows with its size, so a sender of big ones gets fewer."""

    per_s: float
    burst: float
    unit_bytes: int | None = None

    def cost(self, nbytes: int) -> float:
        """Tokens a message of ``nbytes`` data bytes takes."""
        return 1.0 if self.unit_bytes is None else float(max(1, -(-nbytes // self.unit_bytes)))


class SenderRates:
    """Token buckets per (sender, message type) for the types in ``limits`` (type name -> Rate)."""

    def __init__(self, limits: Mapping[str, Rate] | None = None, max_buckets: int = MAX_BUCKETS) -> None:
        self.limits: dict[str, Rate] = dict(limits or {})
        self.max_buckets = max_buckets
        self._buckets: OrderedDict[tuple[bytes, str], tuple[float, float]] = OrderedDict()  # -> (tokens, at)

    def limit(self, kind: str, rate: Rate) -> None:
        self.limits[kind] = rate

    def limited(self, kind: str) -> bool:
        return kind in self.limits

    def _tokens(self, sender: bytes, kind: str, now: float) -> float:
        rate = self.limits[kind]
        tokens, at = self._buckets.get((sender, kind), (rate.burst, now))
        return refilled(tokens, at, now, rate.per_s, rate.burst)

    def has_token(self, sender: bytes, kind: str, now: float, nbytes: int = 0) -> bool:
        """Whether ``sender`` may send one more ``kind`` message of ``nbytes`` now (nothing is charged)."""
        return kind not in self.limits or self._tokens(sender, kind, now) >= self.limits[kind].cost(nbytes)

    def take(self, sender: bytes, kind: str, now: float, nbytes: int = 0) -> bool:
        """Charge one ``kind`` message of ``nbytes`` to ``sender``; False (nothing charged) when it
        has not the tokens."""
        if kind not in self.limits:
            return True
        tokens, cost = self._tokens(sender, kind, now), self.limits[kind].cost(nbytes)
        if tokens < cost:
            return False
        key = (sender, kind)
        self._buckets[key] = (tokens - cost, now)
        self._buckets.move_to_end(key)
        while len(self._buckets) > self.max_buckets:
            self._buckets.popitem(last=False)
        return True
