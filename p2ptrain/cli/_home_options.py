"""The home a command works on, and the options that say where its content comes from: the one
spelling of each for every command (a home given as ``--home`` or taken from ``$P2PTRAIN_HOME`` or
``~/.p2ptrain``; a running node of that home, else a temporary node through ``--bootstrap``). Every
``--home`` help text is made here by :func:`home_help`, so each one ends with the same default."""

from __future__ import annotations

import argparse
from pathlib import Path

from p2ptrain.base import default_home

# The one spelling of where a home is when --home is not given (base.default_home decides it).
HOME_DEFAULT = "$P2PTRAIN_HOME or ~/.p2ptrain"


def home_help(what: str) -> str:
    """A ``--home`` help text: what the home is for here, and the default."""
    return f"{what} (default: {HOME_DEFAULT})"


# The --home of the commands that read a home's store (and ask its node, when one runs).
HOME_HELP = home_help("node home whose store (and running node, if any) to use")
# The --home of the commands that start or inspect the node itself (node start/id/status, config show).
NODE_HOME_HELP = home_help("node home: identity key, config, control socket, blocks, logs")
# The --home of the commands that only talk to the home's running node (task ...).
RUNNING_NODE_HOME_HELP = home_help("home of the running node to use")


def home_of(args: argparse.Namespace) -> Path:
    """``--home`` (``~`` expanded), else the default home."""
    if args.home:
        return Path(args.home).expanduser()
    return default_home()


def source_options(parser: argparse.ArgumentParser) -> None:
    """``--home`` and ``--bootstrap``: where a command finds content it does not hold yet."""
    parser.add_argument("--home", type=Path, default=None, help=HOME_HELP)
    parser.add_argument(
        "--bootstrap", nargs="+", default=[], metavar="MULTIADDR",
        help="with no node running for --home: start a temporary node that joins the mesh here to fetch",
    )
