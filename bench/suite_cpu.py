"""Where the test suite's CPU goes, per test file (issue 28): a pytest plugin, and its report.

``make test`` on the 2-core machine is bound by CPU (user+sys over wall is close to 2), so a
test's wall time under xdist says little: it waits on the cores. This measures CPU-seconds, which
other work on the machine barely changes. Around each test (setup, call and teardown) it reads the
CPU of the pytest process's whole tree from /proc: its own time, the time of the children it has
waited for, and of every live descendant (nodes and scripts started fresh). A descendant that ends
moves into its parent's waited-for time, so the sum carries on; only a process that outlives its
parent (reparented to init) drops out. What the fork server forks (nodes, member scripts, CLI
commands) is its child, not the worker's: ``make test``'s controller starts it, and forks the
workers from it too, so a process test's children count in no test here; vmstat's busy share over
the run, or the test file alone (``/usr/bin/time``), says what those cost.
A module- or session-scoped fixture's start counts in the first test that uses it on that worker,
its end in the last. Collection and the workers' start (importing torch) are in no test::

    flock /tmp/bench.lock /usr/bin/time -v .venv/bin/python -m pytest -q -n 4 -p bench.suite_cpu
    .venv/bin/python bench/suite_cpu.py [DIR] [TOP]    # the files, most CPU first

Each process writes one JSON line per test to ``$SUITE_CPU_DIR/<pid>.jsonl`` (default below).
Reading /proc costs ~10 ms a test (~15 s of CPU in the whole suite's 1,500 tests).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

OUT = Path(os.environ.get("SUITE_CPU_DIR", "/tmp/suite-cpu"))
CLK_TCK = os.sysconf("SC_CLK_TCK")


def tree_cpu(root: int) -> float:
    """CPU-seconds (user+sys) of ``root``, its waited-for children and its live descendants."""
    stat: dict[int, tuple[int, float]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            text = Path(f"/proc/{name}/stat").read_text()
        except OSError:  # ended while we listed
            continue
        fields = text[text.rfind(")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
        ticks = sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
        stat[int(name)] = (int(fields[1]), ticks / CLK_TCK)
    children: dict[int, list[int]] = defaultdict(list)
    for pid, (ppid, _) in stat.items():
        children[ppid].append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        if pid in stat:
            total += stat[pid][1]
            todo.extend(children[pid])
    return total


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    before, started = tree_cpu(os.getpid()), time.time()
    yield
    line = {"id": item.nodeid, "cpu": round(tree_cpu(os.getpid()) - before, 2), "wall": round(time.time() - started, 2),
            "start": round(started, 2)}
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / f"{os.getpid()}.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


def report(out: Path, top: int) -> str:
    """The test files, most CPU first: CPU-seconds, share (running), summed wall, tests."""
    cpu: Counter[str] = Counter()
    wall: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for path in out.glob("*.jsonl"):
        for text in path.read_text().splitlines():
            line: dict[str, Any] = json.loads(text)
            name = line["id"].split("::")[0]
            cpu[name] += line["cpu"]
            wall[name] += line["wall"]
            count[name] += 1
    total = sum(cpu.values()) or 1.0
    rows = [f"{sum(count.values())} tests, {total:.0f} CPU-s in tests", "  cpu-s  cum%   wall-s  tests  file"]
    running = 0.0
    for name, seconds in cpu.most_common(top):
        running += seconds
        rows.append(f"{seconds:7.1f} {100 * running / total:5.1f} {wall[name]:8.1f} {count[name]:6d}  {name}")
    return "\n".join(rows)


if __name__ == "__main__":
    print(report(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT, int(sys.argv[2]) if len(sys.argv) > 2 else 40))
