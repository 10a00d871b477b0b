"""Real `p2ptrain node` processes: a 4-peer mesh, a killed peer, a restarted peer, the id race."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from p2ptrain.base import short_id
from p2ptrain.testing import node_processes, run_forked, start_forked, wait_for

CLI = [sys.executable, "-m", "p2ptrain.cli.main"]


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return run_forked([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def clis(*commands: list[str], timeout: float = 60) -> list[subprocess.CompletedProcess]:
    """Several CLI commands as processes started at once (each imports for seconds on a loaded box)."""
    procs = [start_forked([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for args in commands]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [subprocess.CompletedProcess(p.args, p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def status_json(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def peer_ids(status: dict) -> set[str]:
    return {p["peer_id"] for p in status["peers"]}


def views(procs) -> str:
    """Who sees whom, for a failure message."""
    lines = []
    for p in procs:
        try:
            s = p.status()
            lines.append(f"{short_id(p.peer_id)}: peers {[short_id(x['peer_id']) for x in s['peers']]} "
                         f"gone {[(short_id(x['peer_id']), x['left_reason']) for x in s['gone']]} "
                         f"connected {len(s['connected'])}")
        except Exception as exc:
            lines.append(f"{short_id(p.peer_id)}: {exc}")
    return "\n".join(lines)


def settle(procs, predicate, timeout: float) -> None:
    try:
        wait_for(predicate, timeout=timeout)
    except TimeoutError:
        raise AssertionError(f"not settled in {timeout} s:\n{views(procs)}") from None


@pytest.mark.timeout(900)  # five process starts, each importing libp2p and torch on a shared 2-core box
def test_four_node_processes_form_a_mesh_survive_a_kill_and_a_restart(tmp_path):
    with node_processes(4, tmp_path) as procs:
        ids = {p.peer_id for p in procs}
        # Every node lists the other three (polled through the control socket, bounded at 10 s).
        settle(procs, lambda: all(peer_ids(p.status()) == ids - {p.peer_id} for p in procs), timeout=10)
        # ... and says so through the CLI contract: peer_id, addrs (usable as --bootstrap), peers.
        *machine, human = clis(*[["node", "status", "--home", str(p.home), "--json"] for p in procs],
                               ["node", "status", "--home", str(procs[0].home)])
        for p, done in zip(procs, machine):
            status = status_json(done)
            assert status["peer_id"] == p.peer_id
            assert p.addr in status["addrs"]
            assert all(a.endswith(f"/p2p/{p.peer_id}") for a in status["addrs"])
            assert peer_ids(status) == ids - {p.peer_id}
        assert human.returncode == 0 and procs[1].peer_id in human.stdout

        # A killed node gets no chance to say goodbye: the others notice its silence.
        victim = procs[3]
        victim.kill()
        survivors = procs[:3]
        settle(survivors, lambda: all(victim.peer_id in {g["peer_id"] for g in s.status()["gone"]} for s in survivors),
               timeout=20)
        assert all(victim.peer_id not in peer_ids(s.status()) for s in survivors)
        reasons = [g["left_reason"] for g in survivors[0].status()["gone"]]
        assert any("silent" in r for r in reasons)

        # Restarted on the same home (stale control socket and all), it keeps its peer ID and rejoins.
        assert (victim.home / "control.sock").exists(), "a killed node leaves its socket behind"
        victim.start()
        victim.wait_ready()
        assert victim.status()["peer_id"] == victim.peer_id
        settle(procs, lambda: all(peer_ids(p.status()) == ids - {p.peer_id} for p in procs), timeout=20)

        # SIGTERM stops a node cleanly: exit code 0, socket removed, its log names it.
        assert procs[0].terminate() == 0
        assert not (procs[0].home / "control.sock").exists()
        log = (procs[0].home / "logs" / "node.log").read_text()
        short = short_id(procs[0].peer_id)
        assert f"node {short} stopping" in log and f"node {short} stopped" in log


def test_two_processes_racing_on_a_new_home_end_with_one_identity(tmp_path):
    home = tmp_path / "new-home"
    racers = [start_forked([*CLI, "node", "id", "--home", str(home)], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [r.communicate(timeout=60)[0].strip() for r in racers]
    assert all(r.returncode == 0 for r in racers)
    assert outputs[0] == outputs[1] and outputs[0].startswith("12D3KooW")
    assert [p.name for p in home.iterdir() if "identity" in p.name] == ["identity.key"]
    assert oct(os.stat(home / "identity.key").st_mode & 0o777) == "0o600"
    assert cli("node", "id", "--home", str(home)).stdout.strip() == outputs[0]


def test_bad_bootstrap_is_one_clear_line(tmp_path):
    done = cli("node", "start", "--home", str(tmp_path / "h"), "--bootstrap", "/ip4/127.0.0.1/tcp/1")
    assert done.returncode == 1
    assert "no /p2p/<peer id> part" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("args", [["status"], ["status", "--json"]])
def test_status_without_a_node_is_one_clear_line(tmp_path, args):
    done = cli("node", *args, "--home", str(tmp_path / "h"))
    assert done.returncode == 1
    assert "no node is running for home" in done.stderr and "Traceback" not in done.stderr


def test_a_failed_block_shows_each_nodes_last_events(tmp_path, capsys):
    with pytest.raises(RuntimeError, match="boom"), node_processes(1, tmp_path) as procs:
        raise RuntimeError("boom")
    err = capsys.readouterr().err
    assert f"--- node0 ({short_id(procs[0].peer_id)}): its last events ---" in err
    assert f"listening on /ip4/127.0.0.1/tcp/{procs[0].port}" in err
