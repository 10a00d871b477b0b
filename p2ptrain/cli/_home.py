"""The home a command works on, and the options that say where its content comes from: the one
spelling of each for every command (a home given as ``--home`` or taken from ``$P2PTRAIN_HOME`` or
``~/.p2ptrain``; a running node of that home, else a temporary node through ``--bootstrap``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from p2ptrain.base import default_home

HOME_HELP = "node home whose store (and running node, if any) to use (default: $P2PTRAIN_HOME or ~/.p2ptrain)"


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
