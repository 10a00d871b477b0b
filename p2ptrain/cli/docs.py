"""``p2ptrain docs [TOPIC]``: the user documentation, read from the installed package.

Messages and help texts point to a page as ``p2ptrain docs TOPIC``: a user who installed the wheel
has no docs/ folder beside them, and the project has no web site. The pages travel as package data:
p2ptrain/docs is a link to the repository's docs/ (one copy, edited where it always was), and the
wheel and sdist hold the files themselves (tests/test_wheel.py checks both).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# The pages: p2ptrain/docs/TOPIC.md, a link to docs/ in a checkout, a folder of files when installed.
DOCS = Path(__file__).resolve().parents[1] / "docs"


def topics() -> list[str]:
    """The topics there are, sorted: each page's file name without ``.md``."""
    return sorted(path.stem for path in DOCS.glob("*.md"))


def heading(topic: str) -> str:
    """The page's first heading (``# ...``), the line that says what it is about."""
    with (DOCS / f"{topic}.md").open(encoding="utf-8") as page:
        for line in page:
            if line.startswith("# "):
                return line[2:].strip()
    return ""


def topic_arg(value: str) -> str:
    """argparse ``type=`` of TOPIC: an unknown one is refused in one line that names them all."""
    names = topics()
    if value not in names:
        raise argparse.ArgumentTypeError(f"no topic {value!r}; the topics: {', '.join(names) or 'none installed'}")
    return value


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    docs = sub.add_parser(
        "docs", help="read the documentation: list the topics, or print one",
        description="Without TOPIC, list the topics, one a line with its first heading; with TOPIC, print "
        "that page (through $PAGER or less when the output is a terminal, plain otherwise).",
    )
    docs.add_argument("topic", nargs="?", type=topic_arg, metavar="TOPIC",
                      help="a topic, as listed (e.g. training)")
    docs.add_argument("--path", action="store_true",
                      help="print where the page is (without TOPIC: the folder of the pages)")
    docs.set_defaults(func=cmd_docs)


def cmd_docs(args: argparse.Namespace) -> int:
    if args.path:
        print((DOCS / f"{args.topic}.md" if args.topic else DOCS).resolve())
    elif args.topic is None:
        names = topics()
        width = max(map(len, names), default=0)
        for name in names:
            print(f"{name:<{width}}  {heading(name)}")
    else:
        text = (DOCS / f"{args.topic}.md").read_text(encoding="utf-8")
        if sys.stdout.isatty():
            import pydoc  # here, not at the top: every command builds this parser, few page (~6 ms)

            pydoc.pager(text)
        else:
            sys.stdout.write(text)
    return 0
