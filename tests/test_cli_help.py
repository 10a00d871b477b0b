"""The CLI reads well: every command and positional argument says what it is, help text is plain
(no reStructuredText from docstrings), and --home's default is spelled one way everywhere."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from p2ptrain.cli._home_options import HOME_DEFAULT
from p2ptrain.cli.main import build_parser


def _parsers(parser: argparse.ArgumentParser, path: str = "p2ptrain") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                assert helps.get(name), f"{path} {name}: command without help text"
                yield from _parsers(sub, f"{path} {name}")


def test_every_command_and_positional_has_help_and_no_rst() -> None:
    missing, rst, homes = [], [], []
    for path, parser in _parsers(build_parser()):
        if "``" in parser.format_help():
            rst.append(path)
        for action in parser._actions:
            if not action.option_strings and not isinstance(action, argparse._SubParsersAction) and not action.help:
                missing.append(f"{path} {action.dest}")
            if "--home" in action.option_strings and not (action.help or "").endswith(f"(default: {HOME_DEFAULT})"):
                homes.append(f"{path}: {action.help}")
    assert missing == []
    assert rst == []
    assert homes == []
