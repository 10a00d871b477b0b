"""Tests that need a tool declare it, and one hook decides: run, skip, or (in CI) fail.

``pytestmark = pytest.mark.needs("ip", "tc", "iptables", root=True)`` on a test module (or a test):
the hook below checks each tool on PATH (``helia``: the Helia install under ipfs/.helia) before the
test runs. A missing tool skips the test with the reason, except under ``CI=true`` when the
Makefile's ``test-tools`` target (or the Helia stamp) installs it: there ``make test`` ran and the
tool should be here, so the test fails instead of passing quietly (a CI machine without iptables
once skipped every NAT test and stayed green). Nothing that needs root fails for want of root:
``make test`` installs nothing when it is not root, and the skip says so.
"""

from __future__ import annotations

import functools
import gc
import itertools
import os
import re
import shutil
import tempfile
from collections.abc import Collection, Iterable, Iterator, Set as AbstractSet
from typing import Any
from pathlib import Path

import pytest

from p2ptrain.node import port_slice
from p2ptrain.testing._forkserver import SHARE_ENV, forked_worker_python
from p2ptrain.testing._timers import QUICK_ENV, apply_quick_timers, quick_timers_off

ROOT = Path(__file__).resolve().parents[1]
HELIA_NODE = ROOT / "ipfs" / ".helia" / "node_modules" / ".bin" / "node"


def installed_by_make() -> dict[str, str]:
    """{tool: how `make test` installs it}: the Makefile's TEST_TOOLS (tool:debian-package pairs),
    read from the Makefile so that the list lives in one place, and Helia (installed when npm is)."""
    text = (ROOT / "Makefile").read_text()
    match = re.search(r"^TEST_TOOLS\s*:=\s*(.*)$", text, re.MULTILINE)
    pairs = match.group(1).split() if match else []
    tools = {tool: f"apt-get install {package}" for tool, _, package in (p.partition(":") for p in pairs)}
    tools["helia"] = "ipfs/install-helia.sh (when npm is present)"
    return tools


def _present(tool: str) -> bool:
    return HELIA_NODE.exists() if tool == "helia" else shutil.which(tool) is not None


def missing_tool_verdict(tools: tuple[str, ...], *, root: bool, ci: bool, euid: int) -> tuple[str, str] | None:
    """("skip" | "fail", why) for a test that needs ``tools`` (and root), or None if it can run."""
    if root and euid != 0:
        return "skip", "needs root (network namespaces, veth, tc); make test installs nothing when not root"
    missing = [t for t in tools if not _present(t)]
    if not missing:
        return None
    installable = installed_by_make()
    made = [t for t in missing if t in installable]
    if ci and made and euid == 0:
        how = "; ".join(f"{t}: {installable[t]}" for t in made)
        return "fail", f"missing {', '.join(made)}, which make test installs as root ({how}): did make test run?"
    why = f"needs {', '.join(missing)} on PATH"
    if made and euid != 0:
        why += " (make test installs it as root; not root here, so it did not)"
    elif made:
        why += " (make test installs it: run make test)"
    return "skip", why


def pytest_configure(config: pytest.Config) -> None:
    # The processes the tests start (nodes, CLI commands, member scripts) are forked from a server
    # that imported torch and libp2p once (p2ptrain/testing/_forkserver.py), unless this is "0".
    os.environ.setdefault("P2PTRAIN_TEST_FORK", "1")
    # Under xdist, one server for every worker (the workers inherit this variable from the
    # controller): its imports paid once, not on each worker as its first process test waits.
    if config.getoption("dist", "no") != "no" and not hasattr(config, "workerinput") and SHARE_ENV not in os.environ:
        os.environ[SHARE_ENV] = tempfile.mkdtemp(prefix="p2ptrain-forkserver-")
        config.add_cleanup(functools.partial(shutil.rmtree, os.environ[SHARE_ENV], ignore_errors=True))
        # ... and the workers themselves forked from it (p2ptrain/testing/_forked_python.py): each
        # starts with torch, libp2p and the package imported instead of importing them beside five others.
        python = forked_worker_python()
        if python is not None:
            config.option.tx = [f"popen//python={python}" if spec == "popen" else spec for spec in config.option.tx]
    # Each xdist worker hands out listening ports (free_port) from its own slice, so two workers
    # never pick the same port for children that have not bound it yet.
    if hasattr(config, "workerinput") and "P2PTRAIN_FREE_PORTS" not in os.environ:
        os.environ["P2PTRAIN_FREE_PORTS"] = port_slice(int(config.workerinput["workerid"].removeprefix("gw")),
                                                       int(config.workerinput["workercount"]))
    config.addinivalue_line(
        "markers", "needs(*tools, root=False): tools on PATH (and root) the test needs; see tests/conftest.py"
    )


# Under xdist (make test) each worker is handed one test at a time, two deep, in the order of
# pytest_collection_modifyitems (xdist's ``load`` with ``--maxschedchunk 1`` did the same; by default
# it first gives a worker a quarter of its share of the suite, consecutive tests, so the long tests,
# run first, would all land on one worker). The test files below share a session-scoped daemon (the
# js-ipfs of tests/ipfs/test_kubo.py, ~8 CPU-s each start): each is dealt whole to one worker, so the
# daemon starts once, not on every worker that draws one of its tests. (xdist's ``loadgroup`` names
# a group by setting ``item._nodeid``, which pytest 9 no longer reads: it deals grouped tests apart.)
ONE_WORKER_FILES = frozenset({"tests/ipfs/test_kubo.py"})


@pytest.hookimpl(optionalhook=True)  # xdist's hook, in the controller
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """For ``-n N`` (``--dist load``): every test its own unit, dealt in the order of
    pytest_collection_modifyitems (no reordering by unit size), but one unit a file of
    ONE_WORKER_FILES, and at most MAX_HEAVY heavy tests out at a time (:func:`next_unit`)."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    heavy = {nodeid for nodeid, seconds in _recorded_durations(config).items() if seconds >= HEAVY_S}
    value = os.environ.get(MAX_HEAVY_ENV, str(MAX_HEAVY))
    if not value.isdigit():
        raise pytest.UsageError(f"{MAX_HEAVY_ENV}={value!r}: a whole number of heavy tests at a time (0: no limit)")
    limit = int(value)

    class OneWorkerFiles(LoadScopeScheduling):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            self.heavy_out: set[str] = set()  # heavy tests dealt and not done

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if path in ONE_WORKER_FILES else nodeid

        def _assign_work_unit(self, node: Any) -> None:
            index = next_unit(self.workqueue.values(), len(self.heavy_out), heavy, limit)
            if index:
                self.workqueue.move_to_end(next(itertools.islice(self.workqueue, index, None)), last=False)
            self.heavy_out.update(heavy.intersection(next(iter(self.workqueue.values()))))
            super()._assign_work_unit(node)

        def mark_test_complete(self, node: Any, item_index: int, duration: float = 0) -> None:
            self.heavy_out.discard(self.registered_collections[node][item_index])
            super().mark_test_complete(node, item_index, duration)

    config.option.loadscopereorder = False
    return OneWorkerFiles(config, log)


# At most MAX_HEAVY of the tests that took HEAVY_S or more in the last run (pytest's cache) are dealt
# at a time (P2PTRAIN_TEST_MAX_HEAVY: another limit, 0 none): six of them side by side (in-process
# runs of six peers, multi-process runs) starved each other on two cores, their deadlines passed, and
# they redid work: test_distrusted_liar took 119 s there and 15 alone. `make test`, same tree, one run
# each, 2026-11-28: no limit 421 s of pytest, 3 at a time 407, 4 379, 5 399 (docs/testing.md).
HEAVY_S = 12.0
MAX_HEAVY = 4
MAX_HEAVY_ENV = "P2PTRAIN_TEST_MAX_HEAVY"


def next_unit(waiting: Iterable[Collection[str]], heavy_out: int, heavy: AbstractSet[str], limit: int) -> int:
    """Which of the ``waiting`` units (test ids each, in dealing order) to deal next: the first,
    unless ``heavy_out`` heavy tests are out already (``limit``, 0 for none): then the first with no
    heavy test, or the first if every one has one (the run's end)."""
    if not limit or heavy_out < limit:
        return 0
    return next((i for i, unit in enumerate(waiting) if heavy.isdisjoint(unit)), 0)


def _own_timeout(item: pytest.Item) -> float:
    """The timeout a test declares on itself (``@pytest.mark.timeout(S)`` on the function, not its
    module's); 0 when it declares none."""
    marks = getattr(getattr(item, "obj", None), "pytestmark", [])
    return max((float(m.args[0]) for m in marks if m.name == "timeout" and m.args), default=0.0)


# Where the last runs' test durations are kept (pytest's cache, .pytest_cache/: never committed), and
# how the controller hands them to the xdist workers (each worker orders its own collection, and
# every worker must order it alike, so they read the controller's one copy, not the file).
DURATIONS_KEY = "p2ptrain/durations"
_DURATIONS_INPUT = "p2ptrain_durations"


def longest_first(nodeids: list[str], own_timeouts: list[float], durations: dict[str, float]) -> list[int]:
    """The order (indices into ``nodeids``) that runs the longest tests first: files by their
    longest test, and in a file its tests longest first (a file's tests stay together, so that a
    module-scoped fixture is set up once per worker that draws them, not once per stretch). A test
    that ran before counts the seconds it took last (``durations``, recorded by
    :func:`pytest_sessionfinish`); one that did not (a new test, a fresh checkout), the mean of its
    file's recorded tests; a test without either that declares a timeout of its own (a run of
    several processes) counts more than every recorded one, as when the declared timeouts were all
    there was to go by. Ties keep the collection's order."""
    def file_of(nodeid: str) -> str:
        return nodeid.split("::", 1)[0]

    by_file: dict[str, list[float]] = {}
    for nodeid, seconds in durations.items():
        by_file.setdefault(file_of(nodeid), []).append(seconds)
    first = max(durations.values(), default=0.0) + 1.0

    def estimate(i: int) -> float:
        if nodeids[i] in durations:
            return durations[nodeids[i]]
        if own_timeouts[i]:
            return first + own_timeouts[i]
        known = by_file.get(file_of(nodeids[i]))
        return sum(known) / len(known) if known else 0.0

    estimates = [estimate(i) for i in range(len(nodeids))]
    longest: dict[str, float] = {}
    place: dict[str, int] = {}  # between files whose longest tests tie: the collection's order
    for nodeid, seconds in zip(nodeids, estimates, strict=True):
        longest[file_of(nodeid)] = max(seconds, longest.get(file_of(nodeid), 0.0))
        place.setdefault(file_of(nodeid), len(place))
    return sorted(range(len(nodeids)), key=lambda i: (-longest[file_of(nodeids[i])], place[file_of(nodeids[i])],
                                                      -estimates[i]))


def _recorded_durations(config: pytest.Config) -> dict[str, float]:
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        return dict(workerinput.get(_DURATIONS_INPUT, {}))
    cache = getattr(config, "cache", None)  # None under -p no:cacheprovider
    if cache is None:
        return {}
    found = cache.get(DURATIONS_KEY, {})
    return {k: float(v) for k, v in found.items() if isinstance(v, int | float)} if isinstance(found, dict) else {}


@pytest.hookimpl(optionalhook=True)  # xdist's hook, in the controller
def pytest_configure_node(node: Any) -> None:
    node.workerinput[_DURATIONS_INPUT] = _recorded_durations(node.config)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest tests first (:func:`longest_first`). The workers of ``make test`` then take
    the long ones side by side and fill in with short ones, instead of one worker ending the suite
    alone with a run it drew last (longest-first scheduling)."""
    order = longest_first([item.nodeid for item in items], [_own_timeout(item) for item in items],
                          _recorded_durations(config))
    items[:] = [items[i] for i in order]


_ran: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each test's seconds (setup, call and teardown), in the process that writes the cache: the
    controller under xdist (the workers' reports come to it), else the one process."""
    _ran[report.nodeid] = _ran.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The durations of the tests that ran, kept for the next run's order (those that did not run
    keep their last)."""
    config = session.config
    cache = getattr(config, "cache", None)
    if hasattr(config, "workerinput") or cache is None or not _ran:
        return
    durations = _recorded_durations(config)
    durations.update((nodeid, round(seconds, 2)) for nodeid, seconds in _ran.items())
    cache.set(DURATIONS_KEY, durations)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Every result is reported by now: what is left is pytest's last garbage collections (5 in a
    row, for unraisable exceptions of objects freed at the end) and the interpreter's teardown, over
    a heap of torch, libp2p and every test module. Frozen, those skip it: a 6-worker run that
    collected and ran no test took 45-46 CPU-s instead of 58-60 (10 s less wall time on 2 cores)."""
    gc.freeze()


def _shorten_protocol_waits(patch: pytest.MonkeyPatch, keep_margins: bool = False) -> None:
    """The protocol's idle waits (p2ptrain/testing/_timers.py, QUICK_TIMERS) set with ``patch``
    (undone with it), unless ``P2PTRAIN_TEST_QUICK=0``; ``keep_margins``: not JOIN_MARGINS."""
    if not quick_timers_off():
        apply_quick_timers(patch.setattr, keep_margins=keep_margins)


@pytest.fixture
def quick_timers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The protocol's idle waits (QUICK_TIMERS) shortened for one test of in-process peers. Opt-in
    (``pytestmark = pytest.mark.usefixtures("quick_timers")``): tests of the waits themselves, and of
    the pure state machines that compute with the constants, keep the production values. Processes
    (forked or fresh) import their own modules and keep them too (:func:`quick_process_timers` is
    theirs). ``P2PTRAIN_TEST_QUICK=0`` keeps the production values everywhere (was it the timers?
    compare)."""
    _shorten_protocol_waits(monkeypatch)


@pytest.fixture
def quick_timers_slow_joins(monkeypatch: pytest.MonkeyPatch) -> None:
    """:func:`quick_timers` but the first plan's grace (JOIN_MARGINS), for runs whose members join
    seconds apart (pipelined trainers, four to six built in this process): with the quick grace a
    member that joined after the election missed the first plan and was left out for a minute
    (tests/pipeline/test_stalling_replica.py: 24 s -> 104 s at load 6)."""
    _shorten_protocol_waits(monkeypatch, keep_margins=True)


@pytest.fixture(scope="module")
def quick_timers_for_module() -> Iterator[None]:
    """:func:`quick_timers` for a whole module, for one whose module-scoped fixture starts a peer
    that its tests share (the function-scoped one is set up after it, too late)."""
    with pytest.MonkeyPatch.context() as patch:
        _shorten_protocol_waits(patch)
        yield


@pytest.fixture
def quick_process_timers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same waits shortened in the processes one test forks (``node_processes``, ``NodeProcess``,
    ``start_script``/``run_script``, ``run_cli``): ``P2PTRAIN_TEST_QUICK_TIMERS=1`` in this process's
    environment, which they inherit, and the fork server's child applies (p2ptrain/testing/_zygote.py).
    A process started fresh ignores it and keeps the production values, as does this process (add
    ``quick_timers`` for in-process peers)."""
    monkeypatch.setenv(QUICK_ENV, "1")


@pytest.fixture(scope="module")
def quick_process_timers_for_module() -> Iterator[None]:
    """:func:`quick_process_timers` for a module whose module-scoped fixture starts the processes
    its tests share."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(QUICK_ENV, "1")
        yield


@pytest.fixture
def no_missed_plan(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Fails the test if any in-process member counted a plan that does not follow on the last it
    took (``missed_plan`` under ``rejected``: ``follows_on`` in protocol/_plans.py): an honest run
    never misses a plan, and a false positive there costs a reload or a retry without the member.
    Opt-in (``pytestmark = pytest.mark.usefixtures("no_missed_plan")``) for runs with no plan lost;
    read from the log (WARNING), so members stopped before the end count too."""
    yield
    missed = [r.getMessage() for r in caplog.get_records("call") if "[missed_plan:" in r.getMessage()]
    assert not missed, missed


@pytest.hookimpl(tryfirst=True)  # before fixtures start (a session daemon) and like skipif
def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("needs"):
        verdict = missing_tool_verdict(tuple(mark.args), root=bool(mark.kwargs.get("root")),
                                       ci=os.environ.get("CI") == "true", euid=os.geteuid())
        if verdict is None:
            continue
        kind, why = verdict
        if kind == "fail":
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
