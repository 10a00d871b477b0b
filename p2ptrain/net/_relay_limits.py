"""The limits a circuit relay (``--relay-service``) puts on each reservation, and the bounds an
operator may set them within. A leaf: the node's settings (:mod:`p2ptrain.node._node_config`, read by the
CLI before anything heavy is imported) take their defaults and bounds from here, and
:mod:`p2ptrain.net._relay` its limits.
"""

from __future__ import annotations

# Limits a relay (--relay-service) puts on each reservation, all in one place. The first three are
# the defaults of settings an operator may change (node start --relay-max-reservations,
# --relay-max-circuit-duration, --relay-max-circuit-bytes; config.toml relay_max_*), within the
# bounds below; the others are fixed.
# Reservations held at once: a relay serves the private peers of a few training meshes; each
# costs a record and, when used, circuits. A reservation beyond it is refused (RESOURCE_LIMIT_EXCEEDED).
RELAY_MAX_RESERVATIONS = 32
# How long a circuit lives: a training run's connections are long-lived; after this the relay
# resets it and the peers redial (discovery's redial loop). One hour, as py-libp2p's default.
# py-libp2p checks it at each read of the circuit, so an idle circuit ends at its next byte.
RELAY_MAX_CIRCUIT_S = 3600
# Bytes one circuit may carry both ways together: 8 GiB, a few hundred rounds of a 64 MiB dense
# model or thousands of sparse ones, then it is reset and redialed. Bounds what one circuit
# costs the relay's operator.
RELAY_MAX_CIRCUIT_BYTES = 8 * 1024**3
# Circuits at once per reserved peer: a private member of a ring talks to its two neighbours, the
# coordinator, and fetchers; 16 leaves room without letting one peer hold the relay's sockets.
RELAY_MAX_CIRCUITS_PER_PEER = 16
# How long a reservation is valid; py-libp2p's client refreshes it before it lapses.
RELAY_RESERVATION_TTL_S = 3600

# What an operator may set (checked with one clear line by the node's settings, node_config):
# at least 1 reservation (0 would be no service: leave --relay-service off), at most 4096 (each a
# record and up to RELAY_MAX_CIRCUITS_PER_PEER sockets: beyond that one Python process is the limit);
RELAY_RESERVATIONS_RANGE = (1, 4096)
# circuits of 10 s (a round's exchange, and the connection setup, must fit) to 7 days;
RELAY_CIRCUIT_S_RANGE = (10, 7 * 24 * 3600)
# 1 MiB (the Noise handshake, identify and a few control messages fit many times) to 1 TiB.
RELAY_CIRCUIT_BYTES_RANGE = (1024**2, 1024**4)


def bound_problem(value: object, bounds: tuple[int, int]) -> str | None:
    """Why ``value`` is not a whole number within ``bounds`` (one of the ``RELAY_*_RANGE``), or None.
    The one check behind both :func:`relay_limits` and the node's settings (node_config)."""
    low, high = bounds
    if type(value) is not int or not low <= value <= high:
        return f"must be a whole number from {low} to {high}"
    return None
