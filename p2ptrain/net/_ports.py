"""A listen address whose TCP port is taken is refused before a node starts on it.

py-libp2p opens its TCP listeners with SO_REUSEPORT (for hole punching), so a second node given
the port of a running one binds it too: both start, both print the same address, and the kernel
deals incoming connections between them, so a peer dialing ``/ip4/.../tcp/4001/p2p/<first>`` may
reach the second and fail its handshake. A plain socket (SO_REUSEADDR only, as any server binds)
cannot share a port with a listener, so binding one for a moment says whether the port is free,
and why not (in use, an address this machine does not have) in the operating system's words.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Sequence

from p2ptrain.base import ArgumentError


def check_listen(addrs: Sequence[str]) -> None:
    """:class:`~p2ptrain.base.ArgumentError` naming the first of ``addrs`` (multiaddrs, the
    ``listen`` setting) whose TCP port cannot be bound here; addresses on port 0 (any free port)
    and other transports pass."""
    from multiaddr import Multiaddr

    for text in addrs:
        try:
            addr = Multiaddr(text)
            protocols = {p.name for p in addr.protocols()}
            if "tcp" not in protocols or not protocols & {"ip4", "ip6"}:
                continue
            family = socket.AF_INET6 if "ip6" in protocols else socket.AF_INET
            host = addr.value_for_protocol("ip6" if family == socket.AF_INET6 else "ip4")
            port = int(addr.value_for_protocol("tcp"))
        except Exception:  # a malformed address: the node's own parser says why, in its words
            continue
        if port == 0:
            continue
        probe = socket.socket(family, socket.SOCK_STREAM)
        try:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
        except OSError as exc:
            why = ("another node or program listens there (give another port, or 0 for any free one)"
                   if exc.errno == errno.EADDRINUSE else exc.strerror)
            raise ArgumentError("{listen:{addr}}: cannot listen on port {port} of {host}: {why}", addr=text, port=port,
                                host=host, why=why) from None
        finally:
            probe.close()
