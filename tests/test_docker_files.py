"""docker/: the compose files, the scripts and the Dockerfile agree with each other and with the CLI.

Building and running the image takes minutes (docs/deploy.md has the run); this checks, in well
under a second, what breaks silently when one of them changes: a command or flag the scripts use
that the parser no longer accepts, an image name that build.sh does not build, an entry point the
image does not contain, a COPY of a file that moved.
"""

import json
import re
import shlex
from pathlib import Path

import pytest

from p2ptrain.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
COMPOSE_FILES = [DOCKER / "compose.yaml", DOCKER / "compose.kubo.yaml"]
SCRIPTS = sorted(DOCKER.glob("*.sh"))
# What a shell variable or command substitution stands for when a script's command is parsed: a
# valid CID, so that CID-typed arguments accept it (every other argument takes any string).
PLACEHOLDER = "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o"


def _flow_list(text: str, key: str) -> list[list[str]]:
    """Every ``key: [ ... ]`` of a compose file (written as flow lists, which are JSON)."""
    return [json.loads(m) for m in re.findall(rf"^\s*{key}:\s*(\[.*\])\s*$", text, re.M)]


def _parses(argv: list[str]) -> None:
    try:
        build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"the CLI refuses: p2ptrain {shlex.join(argv)}")


def _script_commands(path: Path) -> list[str]:
    """The ``p2ptrain ...`` invocations in a shell script, variables replaced: each runs up to a
    shell operator or the ``)`` that closes the ``$(`` around it."""
    found = []
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        for m in re.finditer(r"(?:^|[\s(])p2ptrain ", line):
            depth, end = 0, m.end()
            while end < len(line):
                ch = line[end]
                if ch == "(":
                    depth += 1
                elif ch == ")":
                    depth -= 1
                    if depth < 0:
                        break
                elif depth == 0 and (ch in "|>;" or line.startswith("&&", end)):
                    break
                end += 1
            found.append(_substitute(line[m.end():end].strip()))
    return found


def _substitute(line: str) -> str:
    """``"$@"`` dropped (the caller adds what it holds); ``$(...)`` and ``$VAR`` made PLACEHOLDER."""
    line = line.replace('"$@"', "")
    while (start := line.find("$(")) >= 0:  # innermost last: count parentheses to the matching one
        depth, end = 0, start + 1
        for end in range(start + 1, len(line)):
            depth += {"(": 1, ")": -1}.get(line[end], 0)
            if depth == 0:
                break
        line = line[:start] + PLACEHOLDER + line[end + 1:]
    return re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", PLACEHOLDER, line)


def test_every_compose_service_runs_the_image_build_sh_builds():
    image = re.search(r'IMAGE="\$\{P2PTRAIN_IMAGE:-([^}]+)\}"', (DOCKER / "build.sh").read_text()).group(1)
    for path in COMPOSE_FILES:
        images = set(re.findall(r"^\s*image:\s*(\S+)", path.read_text(), re.M)) - {"ipfs/kubo:v0.32.1"}
        assert images == {image}, path.name


def test_the_compose_commands_are_node_start_flags():
    for path in COMPOSE_FILES:
        commands = _flow_list(path.read_text(), "command")
        assert commands, path.name
        for args in commands:
            if args[0] == "daemon":  # Kubo's
                continue
            # entrypoint.sh puts --home and --listen in front, --bootstrap behind
            _parses(["node", "start", "--home", "/h", "--listen", "/ip4/127.0.0.1/tcp/4001", *args,
                     "--bootstrap", f"/ip4/127.0.0.1/tcp/4001/p2p/{PLACEHOLDER}"])


def test_every_p2ptrain_command_in_the_scripts_parses():
    seen = 0
    for path in SCRIPTS:
        for command in _script_commands(path):
            argv = shlex.split(command)
            if argv[:2] == ["node", "start"]:  # entrypoint.sh's "$@": its own flags, then the compose's command
                argv += ["--home", "/h", "--listen", "/ip4/127.0.0.1/tcp/4001", "--accept-tasks"]
            _parses(argv)
            seen += 1
    assert seen >= 10  # entrypoint, publish and fetch each run several


def test_the_entry_points_exist_in_the_image():
    dockerfile = (DOCKER / "Dockerfile").read_text()
    copied: list[str] = []
    for sources in re.findall(r"^COPY (?!--from)(.+) \S+$", dockerfile, re.M):
        for source in sources.split():
            assert (ROOT / source).exists(), f"Dockerfile copies {source}, which is not in the repository"
            copied.append(source)
    # .dockerignore shuts out everything (a repository's .venv alone is GBs of build context) but
    # what is let back in: each COPY source must be.
    allowed = {line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.startswith("!")}
    for source in (c.rstrip("/") for c in copied):
        assert any(source == a or source.startswith(a + "/") for a in allowed), \
            f".dockerignore keeps {source} out of the build context"
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", dockerfile, re.M).group(1))[0]
    for path in COMPOSE_FILES:
        entrypoints = [e[0] for e in _flow_list(path.read_text(), "entrypoint")]
        for used in [entrypoint, *entrypoints]:
            name = Path(used).name
            assert used == f"/usr/local/bin/{name}" and f"docker/{name}" in copied, (path.name, used)
            assert (DOCKER / name).stat().st_mode & 0o111, f"docker/{name} is not executable"


def test_the_image_installs_the_serve_extra():
    """``model serve`` runs from the image: the package is installed with its ``serve`` extra, and the
    build's import check imports hypercorn (an extra that is gone fails the build, not a user)."""
    dockerfile = (DOCKER / "Dockerfile").read_text()
    installs = re.findall(r"pip install [^\n]*-c constraints\.txt (\S+)", dockerfile)
    assert installs[-1] == '".[serve]"', installs  # the last install is the package's own
    assert re.search(r"python -c \"import [^\"]*\bhypercorn\b", dockerfile)



def test_the_links_in_what_the_build_copies_resolve_in_the_build():
    """A link inside a folder the build stage COPYs to the same place (``COPY p2ptrain ./p2ptrain``)
    points at something the build copies too: COPY keeps links as links, and p2ptrain/docs (a link
    to ../docs, the pages of ``p2ptrain docs``) pointed nowhere in the image, whose package then
    held no page (the build's import check now says so too)."""
    dockerfile = (DOCKER / "Dockerfile").read_text()
    mirrored = [source for source, dest in re.findall(r"^COPY (?!--from)(\S+) \./(\S+)$", dockerfile, re.M)
                if source.rstrip("/") == dest.rstrip("/")]
    assert "p2ptrain" in mirrored, mirrored
    links = [path for source in mirrored if (ROOT / source).is_dir()
             for path in (ROOT / source).rglob("*") if path.is_symlink() and "__pycache__" not in path.parts]
    assert ROOT / "p2ptrain" / "docs" in links, links  # (the case that broke; others may come)
    for link in links:
        target = link.resolve().relative_to(ROOT).as_posix()
        assert any(target == s.rstrip("/") or target.startswith(s.rstrip("/") + "/") for s in mirrored), \
            f"{link.relative_to(ROOT)} links to {target}, which the Dockerfile does not COPY beside it"
