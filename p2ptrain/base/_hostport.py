"""``HOST:PORT`` as a user writes it (``node start --metrics``, ``model serve --listen``): one parser.

A leaf (imports nothing of ours), so the metrics exporter and the model server, which sit in
different rooms, share it. It raises one error, :class:`AddressError`; each caller turns it into a
one-line :class:`~p2ptrain.base.UserError` naming its own flag and an example of its own.
"""

from __future__ import annotations

__all__ = ["AddressError", "format_host_port", "parse_host_port"]


class AddressError(ValueError):
    """Text that is not ``HOST:PORT`` (or ``PORT`` where a default host is given), port 0 to 65535."""


def parse_host_port(text: str, *, default_host: str | None = None) -> tuple[str, int]:
    """``HOST:PORT`` → ``(host, port)``; an IPv6 host may be bracketed (``[::1]:8080`` → ``::1``).

    With ``default_host``, ``PORT`` alone and ``:PORT`` mean that host; without it a host is
    required. The port is decimal digits, 0 to 65535 (0: the system picks a free one).
    """
    host, sep, port_text = text.rpartition(":")
    host = host.strip("[]")
    if not host and default_host is not None:
        host = default_host
    if not host:
        raise AddressError(f"{text!r} names no host")
    if not port_text.isascii() or not port_text.isdigit() or int(port_text) > 65535:
        raise AddressError(f"{text!r}: the port must be a number from 0 to 65535")
    return host, int(port_text)


def format_host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets (``[::1]:8080``), as servers' bind options take it."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
