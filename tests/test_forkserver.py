"""The fork server of p2ptrain.testing: a command it forks is a separate process that sees what a
fresh interpreter would (argv, sys.path[0], __name__, its cwd, environment and stdio), exits with the
command's code, and dies by a signal like any process; what it cannot fork starts fresh."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p2ptrain.testing import ForkedProcess, run_forked, start_forked

P2PTRAIN = str(Path(sys.executable).with_name("p2ptrain"))
SCRIPT = """\
import json, os, sys
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "name": __name__, "cwd": os.getcwd(),
                  "env": os.environ.get("FORK_PROBE"), "pid": os.getpid(), "ppid": os.getppid(),
                  "torch": "torch" in sys.modules}))
print("to stderr", file=sys.stderr)
sys.exit(int(os.environ.get("FORK_EXIT", "0")))
"""


@pytest.fixture(autouse=True)
def _fork_server_on(monkeypatch):
    monkeypatch.setenv("P2PTRAIN_TEST_FORK", "1")


def test_a_forked_script_sees_what_a_fresh_interpreter_sees(tmp_path):
    (tmp_path / "probe.py").write_text(SCRIPT)
    workdir = tmp_path / "work"
    workdir.mkdir()
    args = [sys.executable, str(tmp_path / "probe.py"), "a", "b c"]
    env = {**os.environ, "FORK_PROBE": "yes", "FORK_EXIT": "3"}
    fresh = subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=workdir, env=env)
    proc = start_forked(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=workdir, env=env)
    assert isinstance(proc, ForkedProcess)
    out, err = proc.communicate(timeout=60)
    forked, seen = json.loads(out), json.loads(fresh.stdout)
    assert proc.returncode == fresh.returncode == 3
    assert err == fresh.stderr == "to stderr\n"
    for key in ("argv", "path0", "name", "cwd", "env"):
        assert forked[key] == seen[key], key
    assert forked["pid"] == proc.pid != os.getpid() and forked["ppid"] != os.getpid()
    assert forked["torch"] and not seen["torch"]  # the only difference: what was imported before


def test_the_cli_forked_prints_and_exits_as_the_installed_command_does(tmp_path):
    for args in (["node", "id", "--home", str(tmp_path / "h")], ["node", "status", "--home", str(tmp_path / "none")]):
        fresh = subprocess.run([P2PTRAIN, *args], capture_output=True, text=True, timeout=120)
        forked = run_forked([P2PTRAIN, *args], capture_output=True, text=True, timeout=120)
        assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    module = run_forked([sys.executable, "-m", "p2ptrain.cli.main", "node", "id", "--home", str(tmp_path / "h")],
                        capture_output=True, text=True, timeout=60)
    assert module.returncode == 0 and module.stdout.startswith("12D3KooW")


def test_a_forked_node_is_killed_by_a_signal_and_its_output_goes_where_it_was_sent(tmp_path):
    log = tmp_path / "node.log"
    with open(log, "wb") as f:
        proc = start_forked([sys.executable, "-m", "p2ptrain.cli.main", "node", "start", "--home", str(tmp_path / "h"),
                             "--listen", "/ip4/127.0.0.1/tcp/0", "--no-dht"], stdout=f, stderr=subprocess.STDOUT)
    try:
        assert isinstance(proc, ForkedProcess)
        deadline = time.monotonic() + 60
        while "listening on" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.05)
        assert "listening on" in log.read_text()
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.1)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
        with pytest.raises(ProcessLookupError):
            os.kill(proc.pid, 0)
    finally:  # a node left running by a failed assertion would run on after the suite
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_command_over_its_timeout_is_killed(tmp_path):
    (tmp_path / "sleeper.py").write_text("import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(60)\n")
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_forked([sys.executable, str(tmp_path / "sleeper.py")], capture_output=True, timeout=1)
    assert time.monotonic() - started < 30


TIMERS_PROBE = """\
import importlib, json
from p2ptrain.testing._timers import QUICK_TIMERS
print(json.dumps([getattr(importlib.import_module(m), n) for m, n, _ in QUICK_TIMERS]))
"""


def test_a_child_asked_for_quick_timers_has_them_and_the_others_keep_production_values(tmp_path, monkeypatch):
    """P2PTRAIN_TEST_QUICK_TIMERS=1 in a child's environment (the quick_process_timers fixture) gives
    it QUICK_TIMERS; the server and the children not asking keep the modules' values, as does every
    child under P2PTRAIN_TEST_QUICK=0."""
    from p2ptrain.testing._timers import QUICK_ENV, QUICK_TIMERS

    (tmp_path / "timers.py").write_text(TIMERS_PROBE)
    args = [sys.executable, str(tmp_path / "timers.py")]
    quick = [value for _, _, value in QUICK_TIMERS]
    monkeypatch.delenv(QUICK_ENV, raising=False)
    monkeypatch.delenv("P2PTRAIN_TEST_QUICK", raising=False)
    production = json.loads(run_forked(args, capture_output=True, text=True, timeout=60, check=True).stdout)
    assert all(p > q for p, q in zip(production, quick)), production
    asked = run_forked(args, capture_output=True, text=True, timeout=60, check=True, env={**os.environ, QUICK_ENV: "1"})
    assert json.loads(asked.stdout) == quick
    after = run_forked(args, capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(after.stdout) == production  # the server's modules were left as they were
    off = run_forked(args, capture_output=True, text=True, timeout=60, check=True,
                     env={**os.environ, QUICK_ENV: "1", "P2PTRAIN_TEST_QUICK": "0"})
    assert json.loads(off.stdout) == production


def test_what_it_cannot_fork_starts_fresh(tmp_path, monkeypatch):
    code = [sys.executable, "-c", "import sys; print('torch' in sys.modules)"]
    proc = start_forked(code, stdout=subprocess.PIPE, text=True)
    assert isinstance(proc, subprocess.Popen) and proc.communicate(timeout=60)[0].strip() == "False"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}  # read at interpreter start: a fork would miss it
    (tmp_path / "probe.py").write_text(SCRIPT)
    proc = start_forked([sys.executable, str(tmp_path / "probe.py")], env=env, stdout=subprocess.PIPE, text=True,
                        stderr=subprocess.DEVNULL)
    assert isinstance(proc, subprocess.Popen) and not json.loads(proc.communicate(timeout=60)[0])["torch"]
    monkeypatch.delenv("P2PTRAIN_TEST_FORK")  # off unless asked for
    proc = start_forked([sys.executable, str(tmp_path / "probe.py")], stdout=subprocess.PIPE, text=True,
                        stderr=subprocess.DEVNULL)
    assert isinstance(proc, subprocess.Popen) and not json.loads(proc.communicate(timeout=60)[0])["torch"]


def test_what_torch_sets_at_run_time_does_not_stop_forking(tmp_path, monkeypatch):
    """Inductor's cache folder and OpenMP's duplicate-library switch, which torch puts in a running
    process's environment when it first compiles: a test process that has them still forks, and the
    child sees them (it takes the environment whole). They stopped forking for good in subset runs."""
    (tmp_path / "probe.py").write_text("import os; print(os.environ.get('TORCHINDUCTOR_CACHE_DIR'))")
    probe = [sys.executable, str(tmp_path / "probe.py")]
    for name in ("TORCHINDUCTOR_CACHE_DIR", "KMP_DUPLICATE_LIB_OK"):
        monkeypatch.delenv(name, raising=False)
    before = start_forked(probe, stdout=subprocess.PIPE, text=True)  # the server runs, without them
    assert isinstance(before, ForkedProcess) and before.communicate(timeout=60)[0].strip() == "None"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("KMP_DUPLICATE_LIB_OK", "TRUE")
    after = start_forked(probe, stdout=subprocess.PIPE, text=True)
    assert isinstance(after, ForkedProcess)
    assert after.communicate(timeout=60)[0].strip() == str(tmp_path / "inductor")


@pytest.mark.needs("ip", root=True)
def test_a_command_behind_ip_netns_exec_is_forked_into_that_namespace(tmp_path):
    name = f"p2pfork{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True, timeout=30)
        (tmp_path / "links.py").write_text("import socket\nprint(sorted(n for _, n in socket.if_nameindex()))\n")
        args = ["ip", "netns", "exec", name, sys.executable, str(tmp_path / "links.py")]
        fresh = subprocess.run(args, capture_output=True, text=True, timeout=60)
        proc = start_forked(args, stdout=subprocess.PIPE, text=True)
        assert isinstance(proc, ForkedProcess)
        assert proc.communicate(timeout=60)[0] == fresh.stdout == "['lo']\n"
        here = subprocess.run([sys.executable, str(tmp_path / "links.py")], capture_output=True, text=True, timeout=60)
        assert here.stdout != fresh.stdout  # the namespace is not this one
    finally:
        subprocess.run(["ip", "netns", "delete", name], timeout=30)
