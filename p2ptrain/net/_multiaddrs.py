"""What a refused address should have been: ``HOST:PORT`` (what most servers take, and what a
newcomer types first) written as the multiaddr libp2p takes.

py-libp2p's parser says of ``10.0.0.1:4001`` only "Invalid MultiAddr '10.0.0.1:4001': unknown
protocol: 10.0.0.1:4001 (string: 10.0.0.1:4001)", which names no form that would do.
"""

from __future__ import annotations

import re

# HOST:PORT with an IPv4 host, maybe behind a scheme (tcp://, http://) or before a slash.
_HOST_PORT = re.compile(r"^(?:[a-z]+://)?(\d{1,3}(?:\.\d{1,3}){3}):(\d{1,5})/?$")


def not_a_multiaddr(text: str, problem: object, peer: bool = False) -> str:
    """Why ``text`` is no multiaddr and how one is written (``peer``: with the ``/p2p/<peer id>``
    part a bootstrap address needs): its own host and port where it is ``HOST:PORT``, else the
    form, with the parser's ``problem`` (a bad IP address, an unknown protocol name)."""
    tail = "/p2p/<peer id>" if peer else ""
    found = _HOST_PORT.match(text.strip())
    if found:
        return f"as a multiaddr it is /ip4/{found[1]}/tcp/{found[2]}{tail}"
    return f"write it as /ip4/HOST/tcp/PORT{tail}, e.g. /ip4/127.0.0.1/tcp/4001{tail} ({problem})"
