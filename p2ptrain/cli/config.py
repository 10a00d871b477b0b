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
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from p2ptrain.base import UserError
from p2ptrain.cli._home_options import NODE_HOME_HELP

if TYPE_CHECKING:
    from p2ptrain.node import NodeConfig

TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class Setting:
    name: str
    value: Any
    source: str  # "flag --listen", "env P2PTRAIN_LISTEN", "file <path>", "default"


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of ``node start`` that override a setting (``config show`` takes them too)."""
    parser.add_argument("--home", type=Path, default=None, help=NODE_HOME_HELP)
    from p2ptrain.node import NodeConfig, settings  # the flags are declared with the settings

    kinds = typing.get_type_hints(NodeConfig)
    for name, how in settings().items():
        kind = kinds[name]
        if kind is bool:
            action = "store_false" if how.flag.startswith("--no-") else "store_true"
            parser.add_argument(how.flag, dest=name, action=action, default=None, help=how.help)
        elif kind == list[str]:
            parser.add_argument(how.flag, dest=name, action=how.repeat, nargs="+" if how.repeat == "extend" else None,
                                metavar=how.metavar, help=how.help)
        else:
            parser.add_argument(how.flag, dest=name, type=kind, metavar=how.metavar, help=how.help)
    parser.add_argument(
        "--metrics", metavar="[HOST:]PORT", default=None,
        help="serve Prometheus metrics over HTTP at this address, e.g. 127.0.0.1:9464 (a bare PORT "
        "listens on 127.0.0.1; default: $P2PTRAIN_METRICS, else no metrics). Names: `p2ptrain docs operating`",
    )
    parser.add_argument(
        "--log-format", choices=("text", "json"), default=None,
        help="log lines on stderr and in <home>/logs/node.log as text, or as one JSON object per line "
        "(keys ts, level, logger, msg) for log shippers (default: $P2PTRAIN_LOG_FORMAT, else text)",
    )


def resolve(args: argparse.Namespace) -> list[Setting]:
    """Every setting of ``node start`` with its value and source (first: ``home``)."""
    from p2ptrain.base import default_home
    from p2ptrain.node import CONFIG_FILE, NodeConfig, env_variable, settings as node_settings

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
    kinds = typing.get_type_hints(NodeConfig)
    settings = [home]
    for name, how in node_settings().items():
        flag_value, variable = getattr(args, name, None), env_variable(name)
        if flag_value is not None:
            problem = how.check(flag_value)
            if problem:
                raise UserError(f"{how.flag}: {name} {problem}")
            settings.append(Setting(name, flag_value, f"flag {how.flag}"))
        elif os.environ.get(variable):
            value = _from_env(variable, os.environ[variable], kinds[name])
            problem = how.check(value)
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


def _from_env(variable: str, text: str, kind: Any) -> Any:
    """A setting of type ``kind`` from an environment variable's text: lists split on commas or spaces."""
    text = text.strip()
    if kind == list[str]:
        return [part for part in text.replace(",", " ").split() if part]
    if kind is bool:
        if text.lower() in TRUE:
            return True
        if text.lower() in FALSE:
            return False
        raise UserError(f"${variable}: {text!r} is not true or false")
    try:
        return int(text) if kind is int else float(text)
    except ValueError:
        raise UserError(f"${variable}: {text!r} is not a number") from None


def values(settings: list[Setting]) -> dict[str, Any]:
    return {s.name: s.value for s in settings}


def node_config(settings: list[Setting]) -> NodeConfig:
    """The node's settings among ``settings`` (what :func:`resolve` found), as the node takes them."""
    from p2ptrain.node import NodeConfig

    names = set(NodeConfig.__dataclass_fields__)
    return NodeConfig(**{s.name: s.value for s in settings if s.name in names})


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
