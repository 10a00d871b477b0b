"""Noise is the only security transport our hosts accept: a plaintext dial is refused."""

from __future__ import annotations

import libp2p
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import PeerInfo
from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport
from multiaddr import Multiaddr

from p2ptrain.net import make_host, noise_only

LOOPBACK = Multiaddr("/ip4/127.0.0.1/tcp/0")


async def dial(client, server) -> None:
    async with client.run(listen_addrs=[LOOPBACK]):
        with trio.fail_after(15):
            await client.connect(PeerInfo(server.get_id(), server.get_addrs()))
        assert server.get_id() in client.get_connected_peers()


async def test_plaintext_dial_is_refused_and_noise_dial_is_accepted():
    server = make_host(create_new_key_pair(), [LOOPBACK])
    async with server.run(listen_addrs=[LOOPBACK]):
        plain_key = create_new_key_pair()
        plaintext = libp2p.new_host(
            key_pair=plain_key,
            sec_opt={PLAINTEXT_PROTOCOL_ID: InsecureTransport(plain_key)},
            listen_addrs=[LOOPBACK],
        )
        with pytest.raises(Exception):
            await dial(plaintext, server)
        assert server.get_id() not in plaintext.get_connected_peers()
        assert plaintext.get_id() not in server.get_connected_peers()
        await plaintext.close()

        # The same dial with Noise works, so the refusal above is about security, not reachability.
        noise_key = create_new_key_pair()
        noise = libp2p.new_host(key_pair=noise_key, sec_opt=noise_only(noise_key), listen_addrs=[LOOPBACK])
        await dial(noise, server)
        await noise.close()
