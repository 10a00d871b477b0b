"""The mesh: verified message routing, heartbeat membership, peer discovery, content routing (DHT),
relay reservations, per-sender rates of the message types a flood makes expensive. Imports ``base``,
``wire`` and ``net``.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from p2ptrain.mesh._discovery import Discovery as Discovery, parse_bootstrap as parse_bootstrap
    from p2ptrain.mesh._liveness import DEFAULT_SILENCE_HEARTBEATS as DEFAULT_SILENCE_HEARTBEATS
    from p2ptrain.mesh._membership import Membership as Membership
    from p2ptrain.mesh._providers import (
        ContentRouting as ContentRouting,
        derived_key as derived_key,
        MAX_PROVIDERS_PER_QUERY as MAX_PROVIDERS_PER_QUERY,
    )
    from p2ptrain.mesh._rates import Rate as Rate
    from p2ptrain.mesh._relays import keep_reservations as keep_reservations
    from p2ptrain.mesh._router import M as M, MessageRouter as MessageRouter
else:
    from p2ptrain._exports import lazy_exports

    __getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
