"""Typed, bounded reads of a task file's tables: each check names the dotted field it refuses, in
one :class:`TaskError`, because a task comes from another peer and a typo must not fall back to a
default. :mod:`p2ptrain.task._spec` builds the task spec from these.
"""

from __future__ import annotations

import math
from typing import Any

from p2ptrain.base import UserError
from p2ptrain.ipfs import InvalidCID, parse_cid

# A CID in text form is short; anything longer is not a CID we made.
MAX_CID_LEN = 128
MAX_NAME_LEN = 128
# Integers where a number is expected must be exact in a float: |n| <= 2**53. Larger ones (TOML and
# JSON both carry integers of any size) are refused before any float conversion can overflow.
MAX_NUMBER = 2**53


class TaskError(UserError):
    """A task file or task bytes are invalid; the message starts with the dotted field name."""



def table(data: dict[str, Any], key: str, where: str, required: bool) -> dict[str, Any]:
    value = data.get(key)
    if value is None:
        if required:
            raise TaskError(f"{where}{key}: missing table [{where}{key}]")
        return {}
    if not isinstance(value, dict):
        raise TaskError(f"{where}{key}: must be a table")
    return value


def only(table: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise TaskError(f"{where}{unknown[0]}: unknown field (allowed: {', '.join(sorted(allowed))})")


def text(table: dict[str, Any], key: str, where: str, default: Any = ..., max_len: int = MAX_NAME_LEN) -> Any:
    if key not in table:
        if default is ...:
            raise TaskError(f"{where}{key}: missing")
        return default
    value = table[key]
    if not isinstance(value, str) or not value.strip():
        raise TaskError(f"{where}{key}: must be a non-empty string")
    if len(value) > max_len:
        raise TaskError(f"{where}{key}: longer than {max_len} characters")
    if not value.isprintable():
        # Shown as it is (task list, task status, logs): a newline or a terminal escape in a task
        # fetched by CID would forge a line or rewrite the terminal of whoever reads it.
        raise TaskError(f"{where}{key}: has characters that are not printable")
    return value


def integer(table: dict[str, Any], key: str, where: str, default: Any = ..., lo: int = 0, hi: int = 2**62) -> Any:
    if key not in table:
        if default is ...:
            raise TaskError(f"{where}{key}: missing")
        return default
    value = table[key]
    if type(value) is not int:
        raise TaskError(f"{where}{key}: must be an integer")
    if not lo <= value <= hi:
        raise TaskError(f"{where}{key}: must be between {lo} and {hi}")
    return value


def number(
    table: dict[str, Any],
    key: str,
    where: str,
    default: Any = ...,
    lo: float = 0.0,
    hi: float = math.inf,
    lo_open: bool = False,
) -> Any:
    if key not in table:
        if default is ...:
            raise TaskError(f"{where}{key}: missing")
        return default
    value = table[key]
    if not finite_number(value):
        raise TaskError(f"{where}{key}: must be a finite number")
    if lo_open and value <= lo:
        raise TaskError(f"{where}{key}: must be > {lo:g}")
    if value < lo or value > hi:
        raise TaskError(f"{where}{key}: must be between {lo:g} and {hi:g}")
    return float(value)


def finite_number(value: Any) -> bool:
    """An int within +-MAX_NUMBER or a finite float (bools are not numbers here)."""
    if type(value) is int:
        return -MAX_NUMBER <= value <= MAX_NUMBER
    return type(value) is float and math.isfinite(value)


def boolean(table: dict[str, Any], key: str, where: str, default: bool) -> bool:
    value = table.get(key, default)
    if type(value) is not bool:
        raise TaskError(f"{where}{key}: must be true or false")
    return value


def choice(table: dict[str, Any], key: str, where: str, choices: tuple[str, ...], default: Any = ...) -> Any:
    value = text(table, key, where, default)
    if value not in choices:
        raise TaskError(f"{where}{key}: must be one of {', '.join(choices)} (got {value!r})")
    return value


def cid(table: dict[str, Any], key: str, where: str, default: Any = ...) -> Any:
    value = text(table, key, where, default, max_len=MAX_CID_LEN)
    if value is None:
        return None
    try:
        parse_cid(value)
    except InvalidCID as exc:
        raise TaskError(f"{where}{key}: {exc}") from None
    return value


def peer_ids(table: dict[str, Any], key: str, where: str, max_items: int) -> tuple[str, ...]:
    """A list of distinct peer IDs, each an Ed25519 key's (the only keys that sign here), sorted so
    that the same set has the same bytes whatever order a person wrote it in."""
    from libp2p.crypto.ed25519 import Ed25519PublicKey
    from libp2p.peer.id import ID

    value = table.get(key)
    if not isinstance(value, list) or not value:
        raise TaskError(f"{where}{key}: must be a non-empty list of peer IDs")
    if len(value) > max_items:
        raise TaskError(f"{where}{key}: more than {max_items} peer IDs")
    for i, peer in enumerate(value):
        if not isinstance(peer, str) or len(peer) > MAX_NAME_LEN:
            raise TaskError(f"{where}{key}[{i}]: must be a peer ID")
        try:
            ok = isinstance(ID.from_base58(peer).extract_public_key(), Ed25519PublicKey)
        except Exception:  # base58 and multihash parsing raise many kinds
            ok = False
        if not ok:
            raise TaskError(f"{where}{key}[{i}]: {peer[:64]!r} is not the peer ID of an Ed25519 key")
    if len(set(value)) != len(value):
        raise TaskError(f"{where}{key}: a peer ID is listed twice")
    return tuple(sorted(value))


def kwarg_value(value: Any, where: str, nested_ok: bool = True) -> Any:
    """Model kwargs are JSON scalars or short flat lists of them: nothing that could carry code."""
    if type(value) in (bool, str) or finite_number(value):
        return value
    if nested_ok and isinstance(value, list) and len(value) <= 64:
        return [kwarg_value(v, f"{where}[{i}]", nested_ok=False) for i, v in enumerate(value)]
    raise TaskError(f"{where}: must be a finite number, string, boolean or a short flat list of them")
