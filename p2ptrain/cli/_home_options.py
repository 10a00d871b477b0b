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
# The --home of the commands that take a model by CID (model fetch, eval, export, verify, serve): model_home.
MODEL_HOME_HELP = home_help("node home whose store (and running node, if any) to use; with no --home, a model by CID "
                            "is looked for there and then in the run homes under it (runs/*)")
# The --home of the commands that start or inspect the node itself (node start/id/status, config show).
NODE_HOME_HELP = home_help("node home: identity key, config, control socket, blocks, logs")
# The --home of the commands that only talk to the home's running node (task ...).
RUNNING_NODE_HOME_HELP = home_help("home of the running node to use")


def home_of(args: argparse.Namespace) -> Path:
    """``--home`` (``~`` expanded), else the default home."""
    if args.home:
        return Path(args.home).expanduser()
    return default_home()


def model_home(args: argparse.Namespace, cid: str | None) -> tuple[Path, bool]:
    """The home a command finds the model ``cid`` in (None: no model by CID), and whether the CID is
    nowhere on this machine: ``--home``; else the default home or the first run home under it that
    holds the CID (:func:`p2ptrain.services.home_holding`, as ``load_model`` looks), since a script's
    run keeps its models in ``HOME/runs/<run>``. The flag goes to ``ensure_local`` (``runs_looked``),
    whose error then says that the run homes were looked through too."""
    if args.home or cid is None:
        return home_of(args), False
    from p2ptrain.ipfs import open_store
    from p2ptrain.services import home_holding

    home = home_holding(cid)
    return home, not open_store(home).has(cid)  # nowhere: the default home, which lacks it too


def source_options(parser: argparse.ArgumentParser, home: str = HOME_HELP) -> None:
    """``--home`` (``home``: its help) and ``--bootstrap``: where a command finds content it does
    not hold yet."""
    parser.add_argument("--home", type=Path, default=None, help=home)
    parser.add_argument(
        "--bootstrap", nargs="+", default=[], metavar="MULTIADDR",
        help="with no node running for --home: start a temporary node that joins the mesh here to fetch",
    )
