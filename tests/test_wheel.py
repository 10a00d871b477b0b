"""The wheel holds what the installed package reads, and the package reads it from where it is installed.

Every other test imports p2ptrain from the checkout (an editable install), where a data file missing
from the wheel, or a path computed from the repository root, still works. A user who runs
``pip install p2ptrain`` has neither. So this builds the wheel once, from a copy of the files git
tracks under p2ptrain/ (plus pyproject.toml and README.md), and checks its list against them; then
it unpacks the wheel into a folder outside the checkout and runs the package from there, in a fresh
interpreter whose working directory is not the repository. (The slower check that installs the wheel
into a venv and trains from a user's folder is run by hand: docs/testing.md, "The wheel".)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tracked() -> list[str]:
    """The package's files as git tracks them; where the tree is no git checkout (an exported
    source tree, a CI that copies files), every file under p2ptrain/ but Python's caches."""
    try:
        out = subprocess.run(["git", "ls-files", "p2ptrain/"], cwd=ROOT, capture_output=True, text=True, check=True,
                             timeout=30)
    except (OSError, subprocess.CalledProcessError):
        return sorted(str(path.relative_to(ROOT)) for path in (ROOT / "p2ptrain").rglob("*")
                      if path.is_file() and "__pycache__" not in path.parts)
    return sorted(out.stdout.split())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built with the venv's setuptools (no index, no build isolation: nothing downloaded)
    from a copy of the tracked sources, so an untracked file of the checkout cannot make it pass."""
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"
    for name in [*_tracked(), "pyproject.toml", "README.md"]:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / name, src / name)  # copyfile follows links: the content, as a wheel holds it
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(base / "dist"), str(src)], check=True, capture_output=True, timeout=120)
    (built,) = (base / "dist").glob("p2ptrain-*.whl")
    return built


def test_the_wheel_holds_every_file_git_tracks_under_the_package(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [name for name in _tracked() if name not in names]
    assert missing == [], f"tracked but not in the wheel (package data in pyproject.toml?): {missing}"
    # Not only modules: the PEP 561 marker and the example task files (`task example`).
    assert "p2ptrain/py.typed" in names
    assert {"p2ptrain/task/examples/digits-mlp.toml", "p2ptrain/task/examples/stdlib-lm.toml",
            "p2ptrain/task/examples/llama-pipeline.toml"} <= names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "p2ptrain = p2ptrain.cli.main:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def _run(site: Path, cwd: Path, code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter that imports p2ptrain from ``site`` (PYTHONPATH comes before the
    editable install's finder), in ``cwd``."""
    env = {**os.environ, "PYTHONPATH": str(site), "P2PTRAIN_HOME": str(cwd / "home")}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=60)


def test_the_unpacked_wheel_reads_its_data_from_itself_outside_the_checkout(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
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

    written = _run(site, user, "import sys; from p2ptrain.cli.main import main\n"
                   "sys.exit(main(['task', 'example', 'stdlib-lm', '-o', 'lm.toml']))")
    assert written.returncode == 0, written.stderr
    assert (user / "lm.toml").read_text() == (ROOT / "node" / "tasks" / "stdlib-lm.toml").read_text()

    # The CLI reference's --check/--write are for a checkout: installed, they must not read or write
    # a docs/ folder in site-packages (another distribution may own one).
    check = _run(site, user, "import sys; from p2ptrain.cli.reference import main; sys.exit(main(['--check']))")
    assert check.returncode == 2 and "source checkout" in check.stderr, check.stderr
    assert not (site / "docs").exists()
