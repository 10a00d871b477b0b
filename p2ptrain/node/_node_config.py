"""A node's settings: ``<home>/config.toml`` (written on first start, edited by hand while the node
is stopped), read strictly (one :class:`~p2ptrain.base.UserError` line naming the file and the
setting), and the home folder it lives in.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from p2ptrain.base import UserError
from p2ptrain.mesh import DEFAULT_SILENCE_HEARTBEATS
from p2ptrain.net import (
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


@dataclass(frozen=True)
class Setting:
    """How a node setting is given besides ``config.toml`` (key: the field's name): its flag of
    ``node start`` and ``config show``, its ``P2PTRAIN_<NAME>`` variable, and its bounds."""

    flag: str  # "--no-x" for a setting that is on by default: the flag turns it off
    help: str
    check: Callable[[Any], str | None]  # why a value is refused (one phrase), or None
    metavar: str | None = None
    repeat: str = "extend"  # a list's flag: "extend" (--flag A B) or "append" (--flag A --flag B)


def setting(default: Any = MISSING, *, factory: Callable[[], Any] | None = None, **how: Any) -> Any:
    """A :class:`NodeConfig` field: its default (or ``factory``) and its :class:`Setting`."""
    meta = {"setting": Setting(**how)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _addresses(value: Any) -> str | None:
    if not isinstance(value, list) or not all(isinstance(a, str) and len(a) <= MAX_CONFIG_ADDR_LEN for a in value):
        return f"must be a list of multiaddr strings (each at most {MAX_CONFIG_ADDR_LEN} characters)"
    if len(value) > MAX_CONFIG_ADDRS:
        return f"lists {len(value)} addresses; at most {MAX_CONFIG_ADDRS}"
    return None


def _boolean(value: Any) -> str | None:
    return None if isinstance(value, bool) else "must be true or false"


def _interval(value: Any) -> str | None:
    if type(value) not in (int, float) or not 0 < value <= MAX_HEARTBEAT_INTERVAL_S:
        return f"must be a number of seconds above 0 and at most {MAX_HEARTBEAT_INTERVAL_S:g}"
    return None


def _silence(value: Any) -> str | None:
    if type(value) is not int or not 1 <= value <= MAX_SILENCE_HEARTBEATS:
        return f"must be a whole number from 1 to {MAX_SILENCE_HEARTBEATS}"
    return None


def _within(bounds: tuple[int, int]) -> Callable[[Any], str | None]:
    return lambda value: bound_problem(value, bounds)


@dataclass(frozen=True)
class NodeConfig:
    """The settings of a node; stored in ``<home>/config.toml``.

    Each field is one setting, declared once: its ``config.toml`` key is the field's name, its
    environment variable ``P2PTRAIN_<NAME>``, and its :class:`Setting` (from :func:`setting`) gives
    the flag, the help and the bounds. ``node start``'s flags, ``config show`` and the checks of the
    file, the variables and the flags all come from here (:mod:`p2ptrain.cli.config`).
    """

    listen: list[str] = setting(
        factory=lambda: list(DEFAULT_LISTEN), flag="--listen", metavar="MULTIADDR", repeat="append", check=_addresses,
        help="address to listen on, e.g. /ip4/127.0.0.1/tcp/4001 (repeatable; default /ip4/127.0.0.1/tcp/0)")
    bootstrap: list[str] = setting(
        factory=list, flag="--bootstrap", metavar="MULTIADDR", check=_addresses,
        help="peers to connect to first, each ending in /p2p/<peer id> (copy them from `node status --json`, "
        "key \"addrs\")")
    mdns: bool = setting(False, flag="--mdns", check=_boolean,
                         help="also find peers on the local network by mDNS (binds all interfaces)")
    dht: bool = setting(True, flag="--no-dht", check=_boolean, help="do not run Kad-DHT peer routing")
    heartbeat_interval: float = setting(1.0, flag="--heartbeat", metavar="SECONDS", check=_interval,
                                        help="heartbeat interval (default 1.0)")
    silence_heartbeats: int = setting(
        DEFAULT_SILENCE_HEARTBEATS, flag="--silence-heartbeats", metavar="N", check=_silence,
        help=f"a peer silent this many heartbeat intervals is gone (default {DEFAULT_SILENCE_HEARTBEATS}, "
        f"from 1 to {MAX_SILENCE_HEARTBEATS})")
    relay_service: bool = setting(
        False, flag="--relay-service", check=_boolean,
        help="relay connections for peers behind NAT (within per-reservation limits; see `p2ptrain docs nat`); "
        "useful on a node others can dial")
    # What a relay allows each reservation (used with relay_service; p2ptrain.net._relay says why these bounds).
    relay_max_reservations: int = setting(
        RELAY_MAX_RESERVATIONS, flag="--relay-max-reservations", metavar="N", check=_within(RELAY_RESERVATIONS_RANGE),
        help="with --relay-service: peers that may hold a reservation at once; more are refused "
        "(default 32, from 1 to 4096)")
    relay_max_circuit_duration: int = setting(
        RELAY_MAX_CIRCUIT_S, flag="--relay-max-circuit-duration", metavar="SECONDS", check=_within(RELAY_CIRCUIT_S_RANGE),
        help="with --relay-service: a relayed connection is reset after this long and the peers "
        "redial (default 3600, from 10 to 604800)")
    relay_max_circuit_bytes: int = setting(
        RELAY_MAX_CIRCUIT_BYTES, flag="--relay-max-circuit-bytes", metavar="BYTES",
        check=_within(RELAY_CIRCUIT_BYTES_RANGE),
        help="with --relay-service: bytes one relayed connection may carry both ways, then it is "
        "reset and redialed (default 8589934592 = 8 GiB, from 1048576 to 1099511627776)")

    @classmethod
    def load(cls, home: Path) -> NodeConfig | None:
        """The stored config, or None if the home has none yet; a :class:`UserError` naming the
        file and the setting for anything else (too big, not TOML, unknown or mistyped settings)."""
        path = Path(home) / CONFIG_FILE
        if not path.exists():
            return None
        return cls.parse(path)

    @classmethod
    def of_home(cls, home: Path) -> NodeConfig:
        """The home's stored config, else the defaults."""
        return cls.load(home) or cls()

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

    def check(self) -> None:
        """A :class:`UserError` naming the first setting out of bounds (a config built in code)."""
        for name in self.__dataclass_fields__:
            problem = config_problem(name, getattr(self, name))
            if problem:
                raise UserError(f"node setting {name} {problem}")

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


def settings() -> dict[str, Setting]:
    """Every node setting by name (the fields of :class:`NodeConfig`, in order)."""
    return {f.name: f.metadata["setting"] for f in fields(NodeConfig)}


def env_variable(name: str) -> str:
    """The environment variable of setting ``name``."""
    return f"P2PTRAIN_{name.upper()}"


def config_problem(name: str, value: Any) -> str | None:
    """Why ``value`` is not acceptable for setting ``name``, or None."""
    how = settings().get(name)
    return None if how is None else how.check(value)


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
