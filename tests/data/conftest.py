"""Shared fixtures for the dataset tests: ``p2ptrain dataset ...`` run in this process (the real
parser and command, output captured), and a snapshot of the files under a home (what "nothing was
written" is checked against).

Tests run with ``--import-mode=importlib``, so helpers reach test modules as fixtures."""

from pathlib import Path

import pytest

from p2ptrain.cli.main import main


@pytest.fixture
def dataset_cli(capsys):
    """``run(*args, home=HOME) -> (exit code, stdout stripped, stderr)`` of ``p2ptrain dataset ARGS``."""

    def run(*args: str, home: Path) -> tuple[int, str, str]:
        code = main(["dataset", *args, "--home", str(home)])
        out, err = capsys.readouterr()
        return code, out.strip(), err

    return run


@pytest.fixture
def home_files():
    """``snapshot(home) -> {relative path: size}`` of every file under ``home`` (empty if absent)."""

    def snapshot(home: Path) -> dict[str, int]:
        if not home.exists():
            return {}
        return {str(p.relative_to(home)): p.stat().st_size for p in home.rglob("*") if p.is_file()}

    return snapshot
