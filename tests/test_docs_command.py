"""``p2ptrain docs``, and every pointer to a page that the package gives a user.

A message that said "see docs/nat.md" pointed nowhere for a user who installed the wheel (no docs/
folder, no web site): messages, help texts and the example task files now say ``p2ptrain docs nat``,
which reads the page from the installed package. These tests keep it so: a page named anywhere in the
package must exist, and a user-facing string must name it the way that works installed. (Both fail
on main: there was no ``docs`` command, and 12 messages and help texts and 7 comments of the example
task files said ``docs/X.md``.) That the wheel and sdist hold the pages is tests/test_wheel.py's check.
"""

from __future__ import annotations

import ast
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p2ptrain.cli import docs, reference
from p2ptrain.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "p2ptrain"
# A page as a path (docs/nat.md) and as the command (p2ptrain docs nat); TOPIC, in capitals, is a placeholder.
AS_PATH = re.compile(r"\bdocs/([a-z0-9][a-z0-9_-]*)\.md")
AS_COMMAND = re.compile(r"\bp2ptrain docs ([a-z0-9][a-z0-9_-]*)\b")
# Modules whose strings are for a developer in a checkout, not for a user: the CLI reference's
# --write/--check name the file docs/cli.md they rewrite.
CHECKOUT_TOOLS = {"p2ptrain/cli/reference.py"}


def _package_files() -> list[Path]:
    """The package's modules and example task files (not the pages themselves, p2ptrain/docs/)."""
    return sorted(p for ext in ("*.py", "*.toml") for p in PACKAGE.rglob(ext)
                  if "__pycache__" not in p.parts and p.parent.name != "docs")


def _user_strings(path: Path) -> list[str]:
    """What a module can show a user: its string literals (f-strings' text too) but its docstrings,
    which only --help shows (and the help texts are checked as argparse renders them)."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def test_every_page_the_package_names_exists():
    topics = set(docs.topics())
    assert {"training", "deploy", "nat", "security", "cli"} <= topics, topics
    texts = {str(p.relative_to(ROOT)): p.read_text() for p in _package_files()}
    texts["p2ptrain --help (every command)"] = reference.render(build_parser())
    named = {(where, name) for where, text in texts.items()
             for pattern in (AS_PATH, AS_COMMAND) for name in pattern.findall(text)}
    assert any(where.endswith("_leading.py") for where, _ in named)  # the walk reaches the modules
    assert sorted((where, name) for where, name in named if name not in topics) == []


def test_messages_help_and_example_tasks_name_pages_as_the_command():
    found: list[tuple[str, str]] = []
    for path in _package_files():
        where = str(path.relative_to(ROOT))
        if where in CHECKOUT_TOOLS:
            continue
        texts = _user_strings(path) if path.suffix == ".py" else [path.read_text()]
        found += [(where, m.group()) for text in texts for m in AS_PATH.finditer(text)]
    found += [("--help", m.group()) for m in AS_PATH.finditer(reference.render(build_parser()))]
    assert found == [], "say `p2ptrain docs TOPIC` (a user of the wheel has no docs/ folder)"
    # The rewritten ones are there, in a log line, a help text and an example task file.
    assert "`p2ptrain docs deploy`" in (PACKAGE / "run" / "_leading.py").read_text()
    assert "`p2ptrain docs nat`" in reference.render(build_parser())
    assert "`p2ptrain docs training`" in (PACKAGE / "task" / "examples" / "digits-mlp.toml").read_text()


def test_docs_lists_each_topic_with_its_first_heading(capsys):
    assert main(["docs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    pages = sorted((ROOT / "docs").glob("*.md"))
    assert [line.split()[0] for line in lines] == [p.stem for p in pages]
    nat = next(line for line in lines if line.startswith("nat "))
    assert nat.split(None, 1)[1] == "Peers behind NAT"  # docs/nat.md's first line: "# Peers behind NAT"


def test_docs_topic_prints_the_page_plainly_when_not_a_terminal(capsys):
    assert main(["docs", "nat"]) == 0
    assert capsys.readouterr().out == (ROOT / "docs" / "nat.md").read_text()
    assert main(["docs", "nat", "--path"]) == 0
    assert Path(capsys.readouterr().out.strip()) == (ROOT / "docs" / "nat.md").resolve()
    assert main(["docs", "--path"]) == 0
    assert Path(capsys.readouterr().out.strip()) == (ROOT / "docs").resolve()


def test_an_unknown_topic_is_one_line_naming_the_topics(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["docs", "natt"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("p2ptrain docs: error: argument TOPIC: no topic 'natt'; "), err
    assert ", ".join(docs.topics()) in err


def test_docs_topic_goes_through_the_pager_on_a_terminal(tmp_path):
    """On a terminal the page goes to $PAGER (here one that copies it to a file), none of it to the
    terminal itself."""
    main_fd, term_fd = pty.openpty()
    env = {**os.environ, "PAGER": f"cat > {tmp_path / 'paged'}", "TERM": "xterm", "P2PTRAIN_HOME": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "p2ptrain.cli.main", "docs", "nat"], stdin=term_fd,
                            stdout=term_fd, stderr=subprocess.PIPE, env=env, cwd=tmp_path)
    os.close(term_fd)
    shown = b""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # read the terminal until the process closes it (EIO)
        if select.select([main_fd], [], [], 1.0)[0]:
            try:
                chunk = os.read(main_fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            shown += chunk
    os.close(main_fd)
    assert proc.wait(timeout=30) == 0, proc.stderr.read() if proc.stderr else ""
    assert (tmp_path / "paged").read_text() == (ROOT / "docs" / "nat.md").read_text()
    assert b"Peers behind NAT" not in shown, shown[:200]
