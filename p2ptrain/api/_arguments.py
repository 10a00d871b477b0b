"""Checks of what a script passes the Python API that the layers below cannot tell apart.

A list of addresses given as one string (``bootstrap="/ip4/…/p2p/…"``) is a sequence of its
characters: each one reached the node as an address, and the script read "node setting bootstrap
lists 80 addresses; at most 64", or "'/' is not a multiaddr", about a list it never wrote.
"""

from __future__ import annotations

from collections.abc import Sequence


def address_list(keyword: str, value: Sequence[str]) -> list[str]:
    """``value`` (the addresses given as ``keyword=``) as a list; a TypeError for one string."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{keyword}= takes a list of addresses, not one string: {keyword}=[{value!r}]")
    return list(value)
