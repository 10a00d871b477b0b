"""HOST:PORT, the one parser behind ``node start --metrics`` and ``model serve --listen``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from p2ptrain.base import AddressError, format_host_port, parse_host_port

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    return names | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}


@pytest.mark.parametrize("text, default, expected", [
    ("127.0.0.1:8080", None, ("127.0.0.1", 8080)),
    ("0.0.0.0:0", None, ("0.0.0.0", 0)),
    ("localhost:65535", None, ("localhost", 65535)),
    ("[::1]:9464", None, ("::1", 9464)),
    ("::1:9464", None, ("::1", 9464)),
    ("9464", "127.0.0.1", ("127.0.0.1", 9464)),
    (":9464", "127.0.0.1", ("127.0.0.1", 9464)),
])
def test_host_and_port_are_read(text: str, default: str | None, expected: tuple[str, int]) -> None:
    assert parse_host_port(text, default_host=default) == expected


@pytest.mark.parametrize("text, default", [
    ("9464", None),  # a host is required unless the caller has a default
    (":9464", None),
    ("127.0.0.1", None),
    ("localhost:http", "127.0.0.1"),
    ("localhost:65536", "127.0.0.1"),
    ("localhost:-1", "127.0.0.1"),
    ("localhost: 80", "127.0.0.1"),
    ("localhost:", "127.0.0.1"),
    ("localhost:٣", "127.0.0.1"),  # a non-ASCII digit is not a port
    ("", "127.0.0.1"),
])
def test_anything_else_is_one_address_error(text: str, default: str | None) -> None:
    with pytest.raises(AddressError):
        parse_host_port(text, default_host=default)


def test_an_ipv6_host_is_bracketed_for_a_bind_option() -> None:
    assert format_host_port("::1", 8080) == "[::1]:8080"
    assert format_host_port("127.0.0.1", 0) == "127.0.0.1:0"
    assert format_host_port(*parse_host_port("[::1]:0")) == "[::1]:0"


def test_it_is_a_leaf_and_both_flags_use_it() -> None:
    assert not [m for m in imported_modules(ROOT / "p2ptrain" / "base/_hostport.py") if m.startswith("p2ptrain")]
    for user in ("services/_metrics.py", "serve/_server.py"):
        assert {"p2ptrain.base", "p2ptrain.base._hostport"} & imported_modules(ROOT / "p2ptrain" / user), user
