"""How much of each peer's pubsub input is read: its message rate, and pauses for a flooder.

Pubsub (net/_pubsub.py) asks these as it reads a peer's RPCs, before any signature check: every
message checked costs ~0.8 ms of CPU, which training peers share with their local steps. A pure
state machine: the caller passes the time (trio's clock in the node, any clock in a test).
"""

from __future__ import annotations

import math
from collections.abc import Hashable

from p2ptrain.base import refilled

# Gossipsub's own rate limit only gates what we *forward*: every message is handed to our
# subscriptions (after an Ed25519 check, ~0.8 ms of CPU a message all told) first. So each peer's
# inbound messages are also limited as they are read, before any check: a token bucket of this rate
# and burst (a coordinator's burst of round messages is tens; our burst test sends 400).
MAX_INBOUND_MESSAGES_PER_PEER_PER_S = 1000.0
INBOUND_BURST = 2000
# A peer whose *own* messages the inbound gate keeps refusing (over their type's rate per sender,
# mesh.rates) is flooding: past this many refusals (a token bucket: rate, burst), each RPC of its
# that brings more is followed by a pause in which its stream is not read, so what it sends
# waits in its yamux window (bounded) instead of costing our event loop. An honest peer's own
# messages stay within their rates, and a relay's refusals (messages of others) do not count.
# A refusal counts one per started FLOODER_UNIT_BYTES of the message (reading, decrypting and
# parsing cost what the bytes cost: 100 refused 57 KB heads were 5.7 MB read before the first
# pause). The pause is FLOODER_PAUSE_S and doubles, up to FLOODER_MAX_PAUSE_S, each time the peer
# is paused again within FLOODER_FORGET_S of its last pause ending: a flooder that keeps on is read
# once every 8 s, not once a second (each read is a whole RPC: up to 1 MiB of forged heads).
FLOODER_REFUSALS_PER_S = 10.0
FLOODER_BURST = 100
FLOODER_UNIT_BYTES = 4096
FLOODER_PAUSE_S = 1.0
FLOODER_MAX_PAUSE_S = 8.0
FLOODER_FORGET_S = 2 * FLOODER_MAX_PAUSE_S


def refusal_units(message_bytes: int) -> int:
    """What one refused message of ``message_bytes`` counts toward its sender's allowance."""
    return max(1, -(-message_bytes // FLOODER_UNIT_BYTES))


class InboundLimits:
    """Per peer: a token bucket of messages read, a bucket of its own messages refused, and when a
    flooder is read again. An entry lives while the peer's stream is read (:meth:`forget` after)."""

    def __init__(self) -> None:
        # Read when made, so a test may set the module's rates first.
        self.rate, self.burst = MAX_INBOUND_MESSAGES_PER_PEER_PER_S, float(INBOUND_BURST)
        self._inbound: dict[Hashable, tuple[float, float]] = {}  # peer -> (tokens, time of last refill)
        self._refusals: dict[Hashable, tuple[float, float]] = {}
        self._paused_until: dict[Hashable, float] = {}
        self._last_pause: dict[Hashable, tuple[float, float]] = {}  # peer -> (seconds, when it ended)

    def admit(self, peer: Hashable, count: int, now: float) -> int:
        """How many of ``count`` messages just read from ``peer`` its bucket allows (taken)."""
        return _take(self._inbound, peer, count, now, self.rate, self.burst)

    def refused(self, peer: Hashable, units: int, now: float) -> float | None:
        """``units`` (:func:`refusal_units`) of ``peer``'s own messages were refused: past its
        allowance, the pause before its stream is read again (FLOODER_PAUSE_S, twice its last
        pause if that ended less than FLOODER_FORGET_S ago); None while within it."""
        if _take(self._refusals, peer, units, now, FLOODER_REFUSALS_PER_S, FLOODER_BURST) >= units:
            return None
        last, ended = self._last_pause.get(peer, (0.0, -math.inf))
        pause = min(FLOODER_MAX_PAUSE_S, 2 * last) if now - ended < FLOODER_FORGET_S else FLOODER_PAUSE_S
        self._paused_until[peer] = now + pause
        self._last_pause[peer] = (pause, now + pause)
        return pause

    def take_pause(self, peer: Hashable) -> float | None:
        """The time until which ``peer``'s stream is not read, once (None: read it now)."""
        return self._paused_until.pop(peer, None)

    def forget(self, peer: Hashable) -> None:
        """``peer``'s stream ended: its buckets and pauses go (one entry per connected peer at most)."""
        for held in (self._inbound, self._refusals, self._paused_until, self._last_pause):
            held.pop(peer, None)


def _take(buckets: dict[Hashable, tuple[float, float]], peer: Hashable, count: int, now: float, rate: float,
          burst: float) -> int:
    """How many of ``count`` tokens ``peer``'s bucket in ``buckets`` gives at ``now`` (that many taken)."""
    tokens, then = buckets.get(peer, (float(burst), now))
    tokens = refilled(tokens, then, now, rate, burst)
    taken = min(count, int(tokens))
    buckets[peer] = (tokens - taken, now)
    return taken
