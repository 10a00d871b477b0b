"""The suite's order (tests/conftest.py, ``longest_first``): the longest tests first, by the seconds
each took in the last run (pytest's cache), so that ``make test``'s workers do not end on one long
test drawn last; a file's tests together; and before any run, the tests that declare a long timeout
of their own first, as the declared timeouts alone ordered them. Under xdist, at most a few heavy
tests at a time (``next_unit``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("p2ptrain_test_conftest_order", Path(__file__).with_name("conftest.py"))
assert _spec is not None and _spec.loader is not None
conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conftest)


def _ordered(tests: list[tuple[str, float]], durations: dict[str, float]) -> list[str]:
    nodeids = [nodeid for nodeid, _ in tests]
    return [nodeids[i] for i in conftest.longest_first(nodeids, [t for _, t in tests], durations)]


def test_before_any_run_the_files_with_declared_timeouts_go_first_longest_bound_first() -> None:
    tests = [("a.py::one", 0), ("a.py::two", 0), ("b.py::run", 300), ("b.py::quick", 0), ("c.py::big", 900),
             ("d.py::x", 0)]
    assert _ordered(tests, {}) == ["c.py::big", "b.py::run", "b.py::quick", "a.py::one", "a.py::two", "d.py::x"]


def test_recorded_seconds_order_the_files_by_their_longest_test_and_each_file_longest_first() -> None:
    tests = [("a.py::one", 0), ("a.py::two", 0), ("b.py::run", 300), ("b.py::quick", 0), ("c.py::big", 900),
             ("d.py::x", 0), ("d.py::y", 0)]
    durations = {"a.py::one": 0.1, "a.py::two": 9.0, "b.py::run": 30.0, "b.py::quick": 0.2, "c.py::big": 12.0,
                 "d.py::x": 0.5, "d.py::y": 0.4}
    assert _ordered(tests, durations) == ["b.py::run", "b.py::quick", "c.py::big", "a.py::two", "a.py::one",
                                          "d.py::x", "d.py::y"]


def test_a_test_not_yet_recorded_counts_its_files_mean_or_with_a_declared_timeout_goes_first() -> None:
    tests = [("a.py::old", 0), ("a.py::new", 0), ("b.py::old", 0), ("c.py::new_run", 300), ("e.py::new", 0)]
    durations = {"a.py::old": 2.0, "b.py::old": 40.0, "gone.py::x": 1.0}
    # c.py's new run, unmeasured, before the measured 40 s; a.py's new test at a.py's mean (2 s),
    # after its measured test (a tie keeps the collection's order); e.py, unknown, last.
    assert _ordered(tests, durations) == ["c.py::new_run", "b.py::old", "a.py::old", "a.py::new", "e.py::new"]


@pytest.mark.parametrize("durations", [{}, {"a.py::1": 1.0, "b.py::1": 1.0, "a.py::2": 1.0, "b.py::2": 1.0}])
def test_files_that_tie_keep_their_tests_together_in_the_collections_order(durations: dict[str, float]) -> None:
    tests = [("a.py::1", 0), ("a.py::2", 0), ("b.py::1", 0), ("b.py::2", 0)]
    assert _ordered(tests, durations) == ["a.py::1", "a.py::2", "b.py::1", "b.py::2"]


def test_at_the_heavy_limit_the_first_unit_without_a_heavy_test_is_dealt() -> None:
    heavy = {"a.py::run", "b.py::run", "c.py::run"}
    waiting = [["a.py::run"], ["b.py::run"], ["d.py::x"], ["c.py::run"], ["e.py::y"]]
    assert conftest.next_unit(waiting, 3, heavy, 4) == 0  # under the limit: the order as it is
    assert conftest.next_unit(waiting, 4, heavy, 4) == 2  # at it: the first light one
    assert conftest.next_unit(waiting, 9, heavy, 0) == 0  # 0: no limit
    assert conftest.next_unit([["a.py::run"], ["c.py::run"]], 4, heavy, 4) == 0  # nothing light left: the first
    # a unit of several tests (a file dealt whole) is heavy if one of its tests is
    assert conftest.next_unit([["f.py::1", "a.py::run"], ["f.py::2"]], 4, heavy, 4) == 1
