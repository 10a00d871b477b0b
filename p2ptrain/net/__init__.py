"""libp2p transport: hosts that speak Noise only, our yamux, pubsub settings, framed stream
channels, reachability (AutoNAT) and circuit relays. Imports only ``base``.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from p2ptrain.net._multiaddrs import not_a_multiaddr as not_a_multiaddr
    from p2ptrain.net._ports import check_listen as check_listen
    from p2ptrain.net._host import advertised_addrs as advertised_addrs, make_host as make_host, noise_only as noise_only
    from p2ptrain.net._pubsub import (
        close_host as close_host,
        make_pubsub as make_pubsub,
        PubsubMessageTooLarge as PubsubMessageTooLarge,
        publish_bytes as publish_bytes,
        running_pubsub as running_pubsub,
    )
    from p2ptrain.net._reachability import Reachability as Reachability, STATUSES as STATUSES
    from p2ptrain.net._relay import (
        has_direct_connection as has_direct_connection,
        is_circuit as is_circuit,
        over_relay as over_relay,
        relay_limits as relay_limits,
        Relaying as Relaying,
    )
    from p2ptrain.net._relay_limits import (
        bound_problem as bound_problem,
        RELAY_CIRCUIT_BYTES_RANGE as RELAY_CIRCUIT_BYTES_RANGE,
        RELAY_CIRCUIT_S_RANGE as RELAY_CIRCUIT_S_RANGE,
        RELAY_MAX_CIRCUIT_BYTES as RELAY_MAX_CIRCUIT_BYTES,
        RELAY_MAX_CIRCUIT_S as RELAY_MAX_CIRCUIT_S,
        RELAY_MAX_RESERVATIONS as RELAY_MAX_RESERVATIONS,
        RELAY_RESERVATIONS_RANGE as RELAY_RESERVATIONS_RANGE,
    )
    from p2ptrain.net._service import running_service as running_service
    from p2ptrain.net._streams import (
        Channel as Channel,
        ChannelClosed as ChannelClosed,
        ChannelError as ChannelError,
        MessageTooLarge as MessageTooLarge,
        open_channel as open_channel,
        serve_channels as serve_channels,
    )
    from p2ptrain.net._stream_guard import StreamGuard as StreamGuard
else:
    from p2ptrain._exports import lazy_exports

    __getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
