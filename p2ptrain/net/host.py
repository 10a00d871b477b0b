"""Build libp2p hosts that accept Noise and nothing else.

py-libp2p's default host also accepts ``/plaintext/2.0.0``, secio and TLS (whose client-certificate
check has a known bypass). Peers we train with must be authenticated and encrypted, so the only
security transport offered or accepted here is Noise; the muxer is yamux.
"""

from __future__ import annotations

from collections.abc import Sequence

import libp2p
from libp2p.abc import IHost
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from multiaddr import Multiaddr


def noise_only(key_pair: KeyPair) -> dict:
    """The security options that offer and accept Noise alone."""
    noise_key = create_new_x25519_key_pair().private_key
    return {NOISE_PROTOCOL_ID: NoiseTransport(key_pair, noise_privkey=noise_key)}


def make_host(key_pair: KeyPair, listen_addrs: Sequence[str | Multiaddr]) -> IHost:
    """A TCP host with our identity, Noise-only security and yamux; start it with ``host.run(...)``."""
    addrs = [Multiaddr(str(a)) for a in listen_addrs]
    return libp2p.new_host(
        key_pair=key_pair,
        sec_opt=noise_only(key_pair),
        muxer_preference="YAMUX",
        listen_addrs=addrs,
    )
