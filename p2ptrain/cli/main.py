"""Entry point of the ``p2ptrain`` command: parse, dispatch, and turn user errors into one line."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from p2ptrain import __version__
from p2ptrain.errors import UserError

# Each module registers one command group with ``add_parser(subparsers)``.
GROUPS: list[str] = [
    "node",
    "ipfs",
    "repo",
    "dataset",
    "task",
    "model",
    "demo",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="p2ptrain",
        description=(
            "Train PyTorch models on a peer-to-peer network: peers join a libp2p mesh, fetch tasks, "
            "models and data by IPFS CID, and average sparsified gradients by ring all-reduce."
        ),
    )
    parser.add_argument("--version", action="version", version=f"p2ptrain {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)"
    )
    sub = parser.add_subparsers(dest="group", metavar="COMMAND")
    for name in GROUPS:
        module = __import__(f"p2ptrain.cli.{name}", fromlist=["add_parser"])
        module.add_parser(sub)
    return parser


def setup_logging(verbosity: int) -> None:
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(verbosity, 2)]
    if os.environ.get("P2PTRAIN_LOG"):
        level = getattr(logging, os.environ["P2PTRAIN_LOG"].upper(), level)
    logging.basicConfig(
        level=level, format="%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    if level > logging.DEBUG:
        # py-libp2p logs expected connection churn at WARNING/ERROR; keep it out of the user's way.
        logging.getLogger("libp2p").setLevel(max(level, logging.ERROR))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    setup_logging(args.verbose)
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"p2ptrain: error: {exc}", file=sys.stderr)
        return 1
    except BaseExceptionGroup as group:
        # trio wraps an error raised inside a nursery; a user error stays one line all the same.
        user_errors, rest = group.split(UserError)
        if user_errors is None or rest is not None:
            raise
        print(f"p2ptrain: error: {_first_leaf(user_errors)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


if __name__ == "__main__":
    sys.exit(main())
