"""The sdist and the wheel hold what the installed package reads, and the package reads it from where it
is installed.

Every other test imports p2ptrain from the checkout (an editable install), where a data file missing
from the wheel, or a path computed from the repository root, still works. A user who runs
``pip install p2ptrain`` has neither. So this builds the sdist once, from a copy of the files git
tracks under p2ptrain/ and docs/ (plus pyproject.toml and README.md), and the wheel from that sdist,
as ``python -m build`` does (so a file the sdist leaves out is missing from the wheel too), and checks
the wheel's list against the tracked files; then it installs the wheel with pip into a folder outside
the checkout and runs the package from there (its ``p2ptrain`` script too), in a fresh interpreter
whose working directory is not the repository. (The slower check that installs the wheel
into a venv and trains from a user's folder is run by hand: docs/testing.md, "The wheel".)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tracked(*folders: str) -> list[str]:
    """The files under ``folders`` as git tracks them (a link, such as p2ptrain/docs, as one name);
    where the tree is no git checkout (an exported source tree, a CI that copies files), every file
    and link under them but Python's caches."""
    try:
        out = subprocess.run(["git", "ls-files", *(f"{f}/" for f in folders)], cwd=ROOT, capture_output=True,
                             text=True, check=True, timeout=30)
    except (OSError, subprocess.CalledProcessError):
        found: list[str] = []
        for folder in folders:
            for top, dirs, files in os.walk(ROOT / folder):  # does not enter a linked folder: the link is a name
                names = [*files, *(d for d in dirs if (Path(top) / d).is_symlink())]
                found += [str((Path(top) / n).relative_to(ROOT)) for n in names if "__pycache__" not in top]
        return sorted(found)
    return sorted(out.stdout.split())


def _package_files() -> list[str]:
    """What an installed package must hold: the tracked files under p2ptrain/, a linked folder (the
    pages, p2ptrain/docs -> ../docs) by the files in it."""
    files: list[str] = []
    for name in _tracked("p2ptrain"):
        if (ROOT / name).is_dir():
            files += sorted(f"{name}/{p.name}" for p in (ROOT / name).iterdir() if p.is_file())
        else:
            files.append(name)
    return files


def _build(hook: str, source: Path, out: Path) -> Path:
    """Run setuptools' PEP 517 ``hook`` (build_sdist, build_wheel) in ``source``, as ``python -m build``
    does without isolation: the venv's setuptools, nothing downloaded. Returns what it built."""
    subprocess.run([sys.executable, "-c", f"from setuptools import build_meta; print(build_meta.{hook}({str(out)!r}))"],
                   cwd=source, check=True, capture_output=True, timeout=120)
    (built,) = out.glob("p2ptrain-*")
    return built


@pytest.fixture(scope="module")
def sdist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist, built from a copy of the tracked sources (links kept as links), so an untracked file
    of the checkout cannot make it pass."""
    base = tmp_path_factory.mktemp("sdist")
    src = base / "src"
    for name in [*_tracked("p2ptrain", "docs"), "pyproject.toml", "README.md"]:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / name).is_symlink():
            (src / name).symlink_to(os.readlink(ROOT / name))
        else:
            shutil.copyfile(ROOT / name, src / name)
    return _build("build_sdist", src, base / "sdist")


@pytest.fixture(scope="module")
def wheel(sdist: Path) -> Path:
    """The wheel, built from the unpacked sdist (as ``python -m build`` and ``pip install SDIST`` do),
    so a file the sdist leaves out is missing here too."""
    unpacked = sdist.parent.parent / "unpacked"
    with tarfile.open(sdist) as tar:
        tar.extractall(unpacked, filter="data")
    (source,) = unpacked.iterdir()
    return _build("build_wheel", source, sdist.parent.parent / "dist")


def test_the_sdist_holds_the_pages_as_files(sdist: Path) -> None:
    with tarfile.open(sdist) as tar:
        members = {m.name.split("/", 1)[1]: m for m in tar.getmembers() if "/" in m.name}
    pages = sorted(name.removeprefix("docs/") for name in _tracked("docs") if name.endswith(".md"))
    held = sorted(name.rsplit("/", 1)[1] for name, m in members.items()
                  if name.startswith("p2ptrain/docs/") and m.isfile())
    assert held == pages and len(pages) > 10  # files, not a link to a docs/ the sdist does not have


def test_the_wheel_holds_every_file_git_tracks_under_the_package(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [name for name in _package_files() if name not in names]
    assert missing == [], f"tracked but not in the wheel (package data in pyproject.toml?): {missing}"
    # Not only modules: the PEP 561 marker and the example task files (`task example`).
    assert "p2ptrain/py.typed" in names
    assert {"p2ptrain/task/examples/digits-mlp.toml", "p2ptrain/task/examples/stdlib-lm.toml",
            "p2ptrain/task/examples/llama-pipeline.toml"} <= names
    # The pages `p2ptrain docs` reads, which messages and help texts point to.
    assert {"p2ptrain/docs/training.md", "p2ptrain/docs/nat.md", "p2ptrain/docs/cli.md"} <= names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "p2ptrain = p2ptrain.cli.main:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def _run(site: Path, cwd: Path, code: str, script: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter that imports p2ptrain from ``site`` (PYTHONPATH comes before the
    editable install's finder), in ``cwd``; with ``script``, that script with ``code``'s words as its
    arguments."""
    env = {**os.environ, "PYTHONPATH": str(site), "P2PTRAIN_HOME": str(cwd / "home")}
    argv = [str(script), *code.split()] if script else [sys.executable, "-c", code]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def test_installed_by_pip_it_reads_its_data_and_pages_from_itself_outside_the_checkout(wheel: Path,
                                                                                      tmp_path: Path) -> None:
    """Installed by pip (``--target``: the files and the ``p2ptrain`` script, no venv to copy), the
    package reads the example tasks and the pages from where it is installed."""
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target", str(site),
                    str(wheel)], check=True, capture_output=True, timeout=120)
    user = tmp_path / "user"
    user.mkdir()
    probe = _run(site, user, "import json, p2ptrain, p2ptrain.task as t\n"
                 "print(json.dumps({'file': p2ptrain.__file__, 'names': t.example_names(),"
                 " 'digits': t.example_task('digits-mlp')}))")
    assert probe.returncode == 0, probe.stderr
    found = json.loads(probe.stdout)
    assert Path(found["file"]).is_relative_to(site)
    assert found["names"] == ["digits-mlp", "llama-pipeline", "stdlib-lm"]
    assert found["digits"] == (ROOT / "node" / "tasks" / "digits-mlp.toml").read_text()

    # The script pip wrote (the entry point) runs the installed package.
    written = _run(site, user, "task example stdlib-lm -o lm.toml", script=site / "bin" / "p2ptrain")
    assert written.returncode == 0, written.stderr
    assert (user / "lm.toml").read_text() == (ROOT / "node" / "tasks" / "stdlib-lm.toml").read_text()
    listed = _run(site, user, "docs", script=site / "bin" / "p2ptrain")
    assert listed.returncode == 0, listed.stderr
    assert [line.split()[0] for line in listed.stdout.splitlines()] == [
        Path(name).stem for name in _tracked("docs") if name.endswith(".md")]
    where = _run(site, user, "docs nat --path", script=site / "bin" / "p2ptrain")
    assert Path(where.stdout.strip()) == (site / "p2ptrain" / "docs" / "nat.md").resolve(), where.stderr
    assert Path(where.stdout.strip()).read_text() == (ROOT / "docs" / "nat.md").read_text()

    # The CLI reference's --check/--write are for a checkout: installed, they must not read or write
    # a docs/ folder in site-packages (another distribution may own one).
    check = _run(site, user, "import sys; from p2ptrain.cli.reference import main; sys.exit(main(['--check']))")
    assert check.returncode == 2 and "source checkout" in check.stderr, check.stderr
    assert not (site / "docs").exists()
