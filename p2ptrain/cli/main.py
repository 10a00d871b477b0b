"""Entry point of the ``p2ptrain`` command: parse, dispatch, and turn user errors into one line."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from typing import NoReturn

from p2ptrain import __version__
from p2ptrain.base import UserError, command_line_words, first_leaf

# Declared errors of decoders below the CLI that are not UserErrors (module, class): what they say
# is the whole story for a user (a CID not held, a block that fails its hash, a malformed file), so
# they are printed as one line like a UserError. Looked up in sys.modules when an error arrives: if a
# module was never imported, nothing it declares can have been raised, and the CLI imports nothing
# heavy just to be ready for it.
DECLARED_ERRORS: list[tuple[str, str]] = [
    ("p2ptrain.ipfs._store", "ContentUnavailable"),
    ("p2ptrain.ipfs._unixfs", "DagError"),
    ("p2ptrain.ipfs._cid", "BlockMismatch"),
    ("p2ptrain.ipfs._cid", "InvalidCID"),
    ("p2ptrain.ipfs._dagpb", "DecodeError"),
    ("p2ptrain.ipfs._blockstore", "PinFileError"),
    ("p2ptrain.base._safetensors_header", "TensorFileError"),
    ("p2ptrain.base.boundedjson", "JSONBoundsError"),
    ("p2ptrain.protocol.signing", "SignatureError"),
]

# Each module registers one command group with ``add_parser(subparsers)``.
GROUPS: list[str] = [
    "node",
    "ipfs",
    "repo",
    "dataset",
    "task",
    "model",
    "demo",
    "config",
    "docs",
]


class Parser(argparse.ArgumentParser):
    """argparse's parser, saying a refused *value* in one line: ``p2ptrain model fetch: error:
    argument --latest: 'bafy...' is not a valid CID: ...``, exit status 2. argparse printed the
    command's usage first (five lines for ``model fetch``) above a mistyped CID or number, where the
    usage says nothing the line does not; a missing or unknown argument keeps its usage. Every
    subcommand's parser is one of these (add_subparsers makes its parsers of the parent's class)."""

    def error(self, message: str) -> NoReturn:
        # argparse calls error() from its handler of the ArgumentError it raised while handling
        # the exception of an argument's type= (ArgumentTypeError, ValueError, TypeError).
        raised = sys.exc_info()[1]
        if isinstance(raised, argparse.ArgumentError) and isinstance(
                raised.__context__, (argparse.ArgumentTypeError, ValueError, TypeError)):
            self.exit(2, f"{self.prog}: error: {message}\n")
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
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
    _plain_help(parser)
    return parser


def _plain_help(parser: argparse.ArgumentParser) -> None:
    """Help text for a terminal: descriptions taken from docstrings lose their reStructuredText
    (double backquotes become one, a role such as :class: is dropped), here and in every subparser."""
    def plain(text: str | None) -> str | None:
        return None if text is None else re.sub(r":\w+:`", "`", text).replace("``", "`")

    parser.description = plain(parser.description)
    for action in parser._actions:
        action.help = plain(action.help)
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                choice.help = plain(choice.help)
            for sub in action.choices.values():
                _plain_help(sub)


def setup_logging(verbosity: int, log_format: str = "text") -> None:
    """Log to stderr at the level -v / -vv / $P2PTRAIN_LOG ask for, as text or one JSON object a line."""
    from p2ptrain.base import formatter

    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(verbosity, 2)]
    if os.environ.get("P2PTRAIN_LOG"):
        level = getattr(logging, os.environ["P2PTRAIN_LOG"].upper(), level)
    handler = logging.StreamHandler()
    handler.setFormatter(formatter(log_format))
    logging.basicConfig(level=level, handlers=[handler])
    if level > logging.DEBUG:
        # py-libp2p logs expected connection churn at WARNING/ERROR; keep it out of the user's way.
        logging.getLogger("libp2p").setLevel(max(level, logging.ERROR))


def declared_errors() -> tuple[type[BaseException], ...]:
    """UserError and the DECLARED_ERRORS of modules loaded so far: each printed as one line."""
    found: list[type[BaseException]] = [UserError]
    for module_name, name in DECLARED_ERRORS:
        module = sys.modules.get(module_name)
        if module is not None:
            found.append(getattr(module, name))
    return tuple(found)


def one_line(exc: BaseException) -> str:
    """``p2ptrain: error: <message>`` on one line, whatever the message holds; an argument it names
    is named by its flag (``--bootstrap``, where a Python caller reads ``bootstrap=``)."""
    message = " ".join(command_line_words(exc).split()) or type(exc).__name__
    return f"p2ptrain: error: {message}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    setup_logging(args.verbose, getattr(args, "log_format", None) or os.environ.get("P2PTRAIN_LOG_FORMAT") or "text")
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # here, where a closed pipe is caught below, not at the interpreter's exit
        return status
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`... | head`): it has what it wanted, and a traceback would only
        # bury its output. stdout goes to /dev/null so the exit's own flush does not fail again;
        # 141 is what a shell reports for a writer that SIGPIPE ended (128 + 13).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141
    except BaseExceptionGroup as group:
        # trio wraps an error raised inside a nursery; a user error stays one line all the same.
        declared, rest = group.split(declared_errors())
        if declared is None or rest is not None:
            raise
        print(one_line(first_leaf(declared)), file=sys.stderr)
        return 1
    except Exception as exc:
        if not isinstance(exc, declared_errors()):
            raise
        print(one_line(exc), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
