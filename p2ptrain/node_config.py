"""A node's settings: ``<home>/config.toml`` (written on first start, edited by hand while the node
is stopped), read strictly (one :class:`~p2ptrain.errors.UserError` line naming the file and the
setting), and the home folder it lives in.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from p2ptrain.errors import UserError
from p2ptrain.mesh.membership import DEFAULT_SILENCE_HEARTBEATS
from p2ptrain.net.relay import (
    RELAY_CIRCUIT_BYTES_RANGE,
    RELAY_CIRCUIT_S_RANGE,
    RELAY_MAX_CIRCUIT_BYTES,
    RELAY_MAX_CIRCUIT_S,
    RELAY_MAX_RESERVATIONS,
    RELAY_RESERVATIONS_RANGE,
    bound_problem,
)

CONFIG_FILE = "config.toml"
DEFAULT_LISTEN = ("/ip4/127.0.0.1/tcp/0",)
# config.toml is written by us and edited by hand: a few hundred bytes. The bounds below refuse a
# file that is clearly not one (or a typo such as heartbeat_interval = 1e400) with one clear line.
MAX_CONFIG_BYTES = 64 * 1024
MAX_CONFIG_ADDRS = 64
MAX_CONFIG_ADDR_LEN = 1024
MAX_HEARTBEAT_INTERVAL_S = 60.0
MAX_SILENCE_HEARTBEATS = 1000


@dataclass
class NodeConfig:
    """The settings of a node; stored in ``<home>/config.toml``."""

    listen: list[str] = field(default_factory=lambda: list(DEFAULT_LISTEN))
    bootstrap: list[str] = field(default_factory=list)
    mdns: bool = False
    dht: bool = True
    heartbeat_interval: float = 1.0
    silence_heartbeats: int = DEFAULT_SILENCE_HEARTBEATS
    relay_service: bool = False  # relay connections for peers behind NAT (docs/nat.md)
    # What a relay allows each reservation (used with relay_service; p2ptrain.net.relay)
    relay_max_reservations: int = RELAY_MAX_RESERVATIONS
    relay_max_circuit_duration: int = RELAY_MAX_CIRCUIT_S  # seconds
    relay_max_circuit_bytes: int = RELAY_MAX_CIRCUIT_BYTES

    @classmethod
    def load(cls, home: Path) -> NodeConfig | None:
        """The stored config, or None if the home has none yet; a :class:`UserError` naming the
        file and the setting for anything else (too big, not TOML, unknown or mistyped settings)."""
        path = Path(home) / CONFIG_FILE
        if not path.exists():
            return None
        return cls.parse(path)

    @classmethod
    def parse(cls, path: Path) -> NodeConfig:
        """Read and check ``path``; every problem is one :class:`UserError` line."""
        try:
            with path.open("rb") as f:
                raw = f.read(MAX_CONFIG_BYTES + 1)
        except OSError as exc:
            raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
        if len(raw) > MAX_CONFIG_BYTES:
            raise UserError(f"{path} is over {MAX_CONFIG_BYTES} bytes; it is not a node config")
        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as exc:  # TOMLDecodeError, UnicodeDecodeError, 5,000-digit ints
            raise UserError(f"{path} is not valid TOML: {exc}") from None
        node = data.get("node", {})
        if not isinstance(node, dict):
            raise UserError(f"{path}: [node] must be a table")
        known = set(cls.__dataclass_fields__)
        unknown = set(node) - known
        if unknown:
            raise UserError(f"{path}: unknown setting(s) {sorted(unknown)[:8]}; known: {sorted(known)}")
        for name, value in node.items():
            problem = config_problem(name, value)
            if problem:
                raise UserError(f"{path}: {name} {problem}")
        return cls(**node)

    def to_toml(self) -> str:
        def value(v: Any) -> str:
            if isinstance(v, bool):
                return "true" if v else "false"
            if isinstance(v, (int, float)):
                return repr(v)
            if isinstance(v, list):
                return "[" + ", ".join(value(x) for x in v) + "]"
            return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'

        lines = ["# p2ptrain node settings (written on first start; edit while the node is stopped)", "[node]"]
        lines += [f"{name} = {value(getattr(self, name))}" for name in self.__dataclass_fields__]
        return "\n".join(lines) + "\n"


# Whole-number settings and their bounds (the relay's: p2ptrain.net.relay says why these).
_RANGES = {
    "relay_max_reservations": RELAY_RESERVATIONS_RANGE,
    "relay_max_circuit_duration": RELAY_CIRCUIT_S_RANGE,
    "relay_max_circuit_bytes": RELAY_CIRCUIT_BYTES_RANGE,
}


def config_problem(name: str, value: Any) -> str | None:
    """Why ``value`` is not acceptable for setting ``name``, or None."""
    if name in ("listen", "bootstrap"):
        if not isinstance(value, list) or not all(isinstance(a, str) and len(a) <= MAX_CONFIG_ADDR_LEN for a in value):
            return f"must be a list of multiaddr strings (each at most {MAX_CONFIG_ADDR_LEN} characters)"
        if len(value) > MAX_CONFIG_ADDRS:
            return f"lists {len(value)} addresses; at most {MAX_CONFIG_ADDRS}"
    elif name in ("mdns", "dht", "relay_service"):
        if not isinstance(value, bool):
            return "must be true or false"
    elif name == "heartbeat_interval":
        if type(value) not in (int, float) or not 0 < value <= MAX_HEARTBEAT_INTERVAL_S:
            return f"must be a number of seconds above 0 and at most {MAX_HEARTBEAT_INTERVAL_S:g}"
    elif name in _RANGES:
        return bound_problem(value, _RANGES[name])
    elif name == "silence_heartbeats":
        if type(value) is not int or not 1 <= value <= MAX_SILENCE_HEARTBEATS:
            return f"must be a whole number from 1 to {MAX_SILENCE_HEARTBEATS}"
    return None


def prepare_home(home: Path) -> None:
    """Create the home (0700) and its folders; refuse a home that others can read."""
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = home.stat()
    if st.st_uid != os.getuid():
        raise UserError(f"{home} belongs to another user")
    if st.st_mode & 0o077:
        os.chmod(home, 0o700)  # ours: tighten it, the control socket and key live here
    for sub in ("blocks", "logs"):
        (home / sub).mkdir(exist_ok=True, mode=0o700)
