"""``p2ptrain config show``: a node's effective settings, and where each came from.

A setting comes from, first to last: a flag of ``node start``, a ``P2PTRAIN_*`` environment variable,
the home's ``config.toml`` (written by the first start, edited by hand), the built-in default.
:func:`resolve` is the one place that order lives: ``node start`` builds its node from it and
``config show`` prints it, so what is shown is what a start with the same flags and environment
would run with.
"""

from __future__ import annotations

import argparse
import json
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2ptrain.errors import UserError

# The one spelling of where a home is when --home is not given (identity.default_home decides it).
HOME_DEFAULT = "$P2PTRAIN_HOME or ~/.p2ptrain"


def home_help(what: str) -> str:
    """A ``--home`` help text: what the home is for here, and the default."""
    return f"{what} (default: {HOME_DEFAULT})"


# config.toml settings that the environment may set: (setting, variable, how its text is read).
ENV_SETTINGS: tuple[tuple[str, str, str], ...] = (
    ("listen", "P2PTRAIN_LISTEN", "list"),
    ("bootstrap", "P2PTRAIN_BOOTSTRAP", "list"),
    ("mdns", "P2PTRAIN_MDNS", "bool"),
    ("dht", "P2PTRAIN_DHT", "bool"),
    ("heartbeat_interval", "P2PTRAIN_HEARTBEAT_INTERVAL", "float"),
    ("silence_heartbeats", "P2PTRAIN_SILENCE_HEARTBEATS", "int"),
    ("relay_service", "P2PTRAIN_RELAY_SERVICE", "bool"),
    ("relay_max_reservations", "P2PTRAIN_RELAY_MAX_RESERVATIONS", "int"),
    ("relay_max_circuit_duration", "P2PTRAIN_RELAY_MAX_CIRCUIT_DURATION", "int"),
    ("relay_max_circuit_bytes", "P2PTRAIN_RELAY_MAX_CIRCUIT_BYTES", "int"),
)
# Flags of ``node start`` that set a config.toml setting (the argparse dest of each).
FLAG_OF = {"listen": "--listen", "bootstrap": "--bootstrap", "mdns": "--mdns", "dht": "--no-dht",
           "heartbeat_interval": "--heartbeat", "relay_service": "--relay-service",
           "relay_max_reservations": "--relay-max-reservations",
           "relay_max_circuit_duration": "--relay-max-circuit-duration",
           "relay_max_circuit_bytes": "--relay-max-circuit-bytes"}
DEST_OF = {"listen": "listen", "bootstrap": "bootstrap", "mdns": "mdns", "dht": "dht", "heartbeat_interval": "heartbeat",
           "relay_service": "relay_service", "relay_max_reservations": "relay_max_reservations",
           "relay_max_circuit_duration": "relay_max_circuit_duration", "relay_max_circuit_bytes": "relay_max_circuit_bytes"}
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class Setting:
    name: str
    value: Any
    source: str  # "flag --listen", "env P2PTRAIN_LISTEN", "file <path>", "default"


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of ``node start`` that override a setting (``config show`` takes them too)."""
    parser.add_argument("--home", type=Path, default=None,
                        help=home_help("node home: identity key, config, control socket, blocks, logs"))
    parser.add_argument(
        "--listen", action="append", metavar="MULTIADDR",
        help="address to listen on, e.g. /ip4/127.0.0.1/tcp/4001 (repeatable; default /ip4/127.0.0.1/tcp/0)",
    )
    parser.add_argument(
        "--bootstrap", nargs="+", action="extend", metavar="MULTIADDR",
        help="peers to connect to first, each ending in /p2p/<peer id> (copy them from `node status --json`, "
        "key \"addrs\")",
    )
    parser.add_argument("--mdns", action="store_true", default=None,
                        help="also find peers on the local network by mDNS (binds all interfaces)")
    parser.add_argument("--no-dht", dest="dht", action="store_false", default=None, help="do not run Kad-DHT peer routing")
    parser.add_argument("--heartbeat", type=float, metavar="SECONDS", help="heartbeat interval (default 1.0)")
    parser.add_argument(
        "--relay-service", dest="relay_service", action="store_true", default=None,
        help="relay connections for peers behind NAT (within per-reservation limits; see docs/nat.md); "
        "useful on a node others can dial",
    )
    parser.add_argument("--relay-max-reservations", type=int, metavar="N",
                        help="with --relay-service: peers that may hold a reservation at once; more are refused "
                        "(default 32, from 1 to 4096)")
    parser.add_argument("--relay-max-circuit-duration", type=int, metavar="SECONDS",
                        help="with --relay-service: a relayed connection is reset after this long and the peers "
                        "redial (default 3600, from 10 to 604800)")
    parser.add_argument("--relay-max-circuit-bytes", type=int, metavar="BYTES",
                        help="with --relay-service: bytes one relayed connection may carry both ways, then it is "
                        "reset and redialed (default 8589934592 = 8 GiB, from 1048576 to 1099511627776)")
    parser.add_argument(
        "--metrics", metavar="[HOST:]PORT", default=None,
        help="serve Prometheus metrics over HTTP at this address, e.g. 127.0.0.1:9464 (a bare PORT "
        "listens on 127.0.0.1; default: $P2PTRAIN_METRICS, else no metrics). Names: docs/operating.md",
    )
    parser.add_argument(
        "--log-format", choices=("text", "json"), default=None,
        help="log lines on stderr and in <home>/logs/node.log as text, or as one JSON object per line "
        "(keys ts, level, logger, msg) for log shippers (default: $P2PTRAIN_LOG_FORMAT, else text)",
    )


def resolve(args: argparse.Namespace) -> list[Setting]:
    """Every setting of ``node start`` with its value and source (first: ``home``)."""
    from p2ptrain.identity import default_home
    from p2ptrain.node_config import CONFIG_FILE, NodeConfig, config_problem

    if args.home:
        home = Setting("home", str(Path(args.home).expanduser().absolute()), "flag --home")
    elif os.environ.get("P2PTRAIN_HOME"):
        home = Setting("home", str(default_home().absolute()), "env P2PTRAIN_HOME")
    else:
        home = Setting("home", str(default_home().absolute()), "default")
    path = Path(home.value) / CONFIG_FILE
    stored = NodeConfig.parse(path) if path.exists() else None  # checked: every problem one line
    in_file = set(tomllib.loads(path.read_text()).get("node", {})) if stored is not None else set()
    defaults = NodeConfig()
    settings = [home]
    for name, variable, kind in ENV_SETTINGS:
        flag_value = getattr(args, DEST_OF[name], None) if name in DEST_OF else None
        if flag_value is not None:
            problem = config_problem(name, flag_value)
            if problem:
                raise UserError(f"{FLAG_OF[name]}: {name} {problem}")
            settings.append(Setting(name, flag_value, f"flag {FLAG_OF[name]}"))
        elif os.environ.get(variable):
            value = _from_env(variable, os.environ[variable], kind)
            problem = config_problem(name, value)
            if problem:
                raise UserError(f"${variable}: {name} {problem}")
            settings.append(Setting(name, value, f"env {variable}"))
        elif stored is not None and name in in_file:
            settings.append(Setting(name, getattr(stored, name), f"file {path}"))
        else:
            settings.append(Setting(name, getattr(defaults, name), "default"))
    settings.append(_flag_env_default("metrics", getattr(args, "metrics", None), "--metrics", "P2PTRAIN_METRICS", None))
    settings.append(_flag_env_default("log_format", getattr(args, "log_format", None), "--log-format",
                                      "P2PTRAIN_LOG_FORMAT", "text"))
    if settings[-1].value not in ("text", "json"):
        raise UserError(f"$P2PTRAIN_LOG_FORMAT: {settings[-1].value!r} is not text or json")
    level, verbose = os.environ.get("P2PTRAIN_LOG"), getattr(args, "verbose", 0)
    if level:  # the environment wins over -v (see cli.main.setup_logging)
        settings.append(Setting("log_level", level.upper(), "env P2PTRAIN_LOG"))
    elif verbose >= 2:
        settings.append(Setting("log_level", "DEBUG", "flag -vv"))
    else:
        settings.append(Setting("log_level", "INFO", "default (node start; -vv: DEBUG)"))
    return settings


def _flag_env_default(name: str, flag_value: Any, flag: str, variable: str, default: Any) -> Setting:
    if flag_value is not None:
        return Setting(name, flag_value, f"flag {flag}")
    if os.environ.get(variable):
        return Setting(name, os.environ[variable], f"env {variable}")
    return Setting(name, default, "default")


def _from_env(variable: str, text: str, kind: str) -> Any:
    """A setting from an environment variable's text: lists split on commas or spaces."""
    text = text.strip()
    if kind == "list":
        return [part for part in text.replace(",", " ").split() if part]
    if kind == "bool":
        if text.lower() in TRUE:
            return True
        if text.lower() in FALSE:
            return False
        raise UserError(f"${variable}: {text!r} is not true or false")
    try:
        return int(text) if kind == "int" else float(text)
    except ValueError:
        raise UserError(f"${variable}: {text!r} is not a number") from None


def values(settings: list[Setting]) -> dict[str, Any]:
    return {s.name: s.value for s in settings}


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    group = sub.add_parser("config", help="show a node's effective settings and where each came from",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cmds = group.add_subparsers(dest="config_cmd", metavar="SUBCOMMAND", required=True)
    show = cmds.add_parser(
        "show", help="the settings `node start` would use with these flags, and where each came from",
        description="Print each setting of `node start` (for this home, environment and flags) with its "
        "source: a flag, a P2PTRAIN_* environment variable, the home's config.toml, or the default. "
        "Needs no running node.",
    )
    add_setting_flags(show)
    show.add_argument("--json", action="store_true",
                      help="print one JSON object: {setting: {\"value\": ..., \"source\": ...}}")
    show.set_defaults(func=cmd_show)


def cmd_show(args: argparse.Namespace) -> int:
    settings = resolve(args)
    if args.json:
        print(json.dumps({s.name: {"value": s.value, "source": s.source} for s in settings}))
        return 0
    width = max(len(s.name) for s in settings)
    for s in settings:
        print(f"{s.name:<{width}}  {_show(s.value):<40}  {s.source}")
    return 0


def _show(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ", ".join(value) or "(none)"
    return str(value)
