"""What a refused address should have been: ``HOST:PORT`` (what most servers take, and what a
newcomer types first) written as the multiaddr libp2p takes.

py-libp2p's parser says of ``10.0.0.1:4001`` only "Invalid MultiAddr '10.0.0.1:4001': unknown
protocol: 10.0.0.1:4001 (string: 10.0.0.1:4001)", which names no form that would do.
"""

from __future__ import annotations

import ipaddress
import re

from p2ptrain.base import parse_host_port

# A scheme a newcomer may put before HOST:PORT (tcp://, http://), and a trailing slash.
_DECORATION = re.compile(r"^[a-z]+://|/$")


def not_a_multiaddr(text: str, problem: object, peer: bool = False) -> str:
    """Why ``text`` is no multiaddr and how one is written (``peer``: with the ``/p2p/<peer id>``
    part a bootstrap address needs): its own host and port where it is ``HOST:PORT`` with an IPv4
    host (base's one parser of it), else the form, with the parser's ``problem`` (a bad IP address,
    an unknown protocol name)."""
    tail = "/p2p/<peer id>" if peer else ""
    try:
        host, port = parse_host_port(_DECORATION.sub("", text.strip()))
        return f"as a multiaddr it is /ip4/{ipaddress.IPv4Address(host)}/tcp/{port}{tail}"
    except ValueError:  # an AddressError, or a host that is no IPv4 address
        return f"write it as /ip4/HOST/tcp/PORT{tail}, e.g. /ip4/127.0.0.1/tcp/4001{tail} ({problem})"
