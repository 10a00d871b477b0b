"""Run N copies of a training script as the members of one run on loopback, as separate processes.

A script that uses ``p2ptrain.Optimizer`` or ``p2ptrain.train`` is one member; a run is the same
script started on several machines, each knowing another's address. To test it on one machine,
:func:`script_members` prepares N members (a home with its identity, a free port, the addresses of
the others) and :func:`run_script` starts the script once per member with the arguments each needs
and collects the last JSON line each printed::

    members = script_members(3, tmp_path)
    results = run_script("examples/custom_loop.py", members, ["--steps", "60"], timeout=300)
    assert len({r["model_cid"] for r in results}) == 1

The script is expected to take ``--home``, ``--listen``, ``--bootstrap`` (zero or more addresses),
``--member`` and ``--members``, as the examples in ``examples/`` do.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2ptrain.base import load_or_create_identity, peer_id_of
from p2ptrain.node import free_port
from p2ptrain.testing._forkserver import ForkedProcess, start_forked

__all__ = ["ScriptMember", "run_script", "script_members", "start_script"]


@dataclass
class ScriptMember:
    """One member of a run started from a script: its home, where it listens, who it bootstraps from."""

    index: int
    count: int
    home: Path
    port: int
    peer_id: str
    bootstrap: list[str]

    @property
    def listen(self) -> str:
        return f"/ip4/127.0.0.1/tcp/{self.port}"

    @property
    def address(self) -> str:
        return f"{self.listen}/p2p/{self.peer_id}"

    def argv(self) -> list[str]:
        """The arguments that make the script this member."""
        return ["--home", str(self.home), "--listen", self.listen, "--member", str(self.index),
                "--members", str(self.count), "--bootstrap", *self.bootstrap]


def script_members(n: int, base: Path) -> list[ScriptMember]:
    """N members with homes under ``base`` (identities created now, so every address is known before
    any starts), each bootstrapping from all the others."""
    members = []
    for i in range(n):
        home = Path(base) / f"member{i}"
        home.mkdir(parents=True, exist_ok=True, mode=0o700)
        peer_id = peer_id_of(load_or_create_identity(home)).to_base58()
        members.append(ScriptMember(i, n, home, free_port(), peer_id, []))
    for m in members:
        m.bootstrap = [o.address for o in members if o is not m]
    return members


def start_script(script: str | Path, member: ScriptMember, args: Sequence[str] = ()) -> ForkedProcess | subprocess.Popen[str]:
    """Start ``script`` as ``member`` (stdout piped, stderr to ``<home>/script.log``), through
    :func:`~p2ptrain.testing.start_forked` (forked where the fork server is on)."""
    with open(member.home / "script.log", "a") as log:  # the child has its own copy of the descriptor
        return start_forked([sys.executable, str(script), *member.argv(), *args], stdout=subprocess.PIPE,
                            stderr=log, text=True)


def run_script(script: str | Path, members: Sequence[ScriptMember], args: Sequence[str] = (), *,
               timeout: float = 300.0) -> list[dict[str, Any]]:
    """Start ``script`` once per member at once, wait for all (``timeout`` in all), return the last JSON
    line each printed. RuntimeError, with the member's log, if one fails or runs out of time."""
    procs = [start_script(script, m, args) for m in members]
    deadline = time.monotonic() + timeout
    results: list[dict[str, Any]] = []
    try:
        for m, p in zip(members, procs):
            try:
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"member {m.index} did not finish in {timeout:.0f} s:\n{_tail(m)}"
                                   f"{_others(members, procs, m)}") from None
            if p.returncode != 0:
                raise RuntimeError(f"member {m.index} exited with {p.returncode}:\n{_tail(m)}{_others(members, procs, m)}")
            results.append(last_json(out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def last_json(out: str) -> dict[str, Any]:
    """The last line of ``out`` that is a JSON object."""
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            value = json.loads(line)
            if isinstance(value, dict):
                return value
    raise RuntimeError(f"the script printed no JSON line:\n{out[-2000:]}")


def _others(members: Sequence[ScriptMember], procs: Sequence[ForkedProcess | subprocess.Popen[str]], failed: ScriptMember) -> str:
    """How every other member stands, with its log's tail: the one that failed often only waited for
    another (a member that never came up leaves its peers' logs saying "not reached")."""
    parts = []
    for m, p in zip(members, procs):
        if m is not failed:
            code = p.poll()
            state = "still running" if code is None else f"exited with {code}"
            parts.append(f"\n--- member {m.index}: {state}:\n{_tail(m, 2000)}")
    return "".join(parts)


def _tail(member: ScriptMember, chars: int = 4000) -> str:
    try:
        return (member.home / "script.log").read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"
