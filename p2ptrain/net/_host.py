"""Build libp2p hosts that accept Noise and nothing else, and dial nobody on their own.

py-libp2p's default host also accepts ``/plaintext/2.0.0``, secio and TLS (whose client-certificate
check has a known bypass). Peers we train with must be authenticated and encrypted, so the only
security transport offered or accepted here is Noise; the muxer is yamux.

Its swarm also runs a background dialer (``AutoConnector``): at start, every 10 s while the host
has fewer than 50 connections (always, on our meshes) and after every disconnect, it dials peers
of the peerstore it is not connected to, up to 150, 16 at a time. The peerstore holds addresses
that DHT answers and heartbeats named, so that dialer went around every bound of
:mod:`p2ptrain.mesh._discovery` (kept peers, dials at once, the backoff of a peer never reached:
issue 13) and redialed peers the mesh had given up. On our hosts it is never started: discovery is
the one thing that dials (lookups of the DHT dial the peers they ask, as they must).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import libp2p
from libp2p.abc import IHost
from libp2p.network.auto_connector import AutoConnector
from libp2p.network.swarm import Swarm
from libp2p.crypto.keys import KeyPair
from libp2p.custom_types import TProtocol
from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from multiaddr import Multiaddr
from multiaddr.utils import get_thin_waist_addresses

from p2ptrain.net import _muxer as muxer
from p2ptrain.net._noise import NoiseTransport as FastNoiseTransport


def noise_only(key_pair: KeyPair, transport: type[NoiseTransport] = NoiseTransport) -> dict[TProtocol, Any]:
    """The security options that offer and accept Noise alone (py-libp2p's class by default)."""
    noise_key = create_new_x25519_key_pair().private_key
    return {NOISE_PROTOCOL_ID: transport(key_pair, noise_privkey=noise_key)}


class _NoAutoConnector(AutoConnector):
    """py-libp2p's background dialer, never started (the module docstring says why): its periodic
    task and the swarm's trigger after a disconnect both return at once on a stopped one."""

    async def start(self) -> None:
        """Stay stopped."""


def make_host(key_pair: KeyPair, listen_addrs: Sequence[str | Multiaddr]) -> IHost:
    """A TCP host with our identity, Noise-only security and yamux; start it with ``host.run(...)``.

    Noise and yamux are our bulk-transfer subclasses (p2ptrain.net._noise, p2ptrain.net._muxer):
    same wire formats, so stock libp2p peers interoperate; see docs/streams.md.
    """
    addrs = [Multiaddr(str(a)) for a in listen_addrs]
    host = libp2p.new_host(
        key_pair=key_pair,
        sec_opt=noise_only(key_pair, FastNoiseTransport),
        muxer_opt=muxer.muxer_options(),
        listen_addrs=addrs,
    )
    muxer.install(host)
    network = host.get_network()
    assert isinstance(network, Swarm), type(network)
    network.auto_connector = _NoAutoConnector(network, network.connection_config.auto_connect_interval)
    return host


WILDCARDS = ("/ip4/0.0.0.0/", "/ip6/::/")


def advertised_addrs(addrs: Sequence[Multiaddr]) -> list[Multiaddr]:
    """The host's listen addresses as others can dial them: a wildcard listen address
    (``/ip4/0.0.0.0``, ``/ip6/::``) becomes this machine's interface addresses (loopback and
    link-local left out, as py-libp2p's ``get_thin_waist_addresses`` does), or loopback when it has
    no other. Advertised as is, ``0.0.0.0`` sent every peer of another machine dialling itself: a
    three-machine run whose members listened on 0.0.0.0 never formed its ring (docs/deploy.md)."""
    out: list[Multiaddr] = []
    for addr in addrs:
        text = str(addr)
        if not text.startswith(WILDCARDS):
            out.append(addr)
            continue
        concrete = get_thin_waist_addresses(addr) or [Multiaddr(text.replace("/ip4/0.0.0.0/", "/ip4/127.0.0.1/", 1)
                                                                .replace("/ip6/::/", "/ip6/::1/", 1))]
        out.extend(a for a in concrete if a not in out)
    return out
