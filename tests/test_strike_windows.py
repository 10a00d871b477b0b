"""base.StrikeWindows: strikes in each peer's last n judgements, bounded in peers (pure)."""

import pytest

from p2ptrain.base import StrikeWindows


def test_strikes_count_within_the_window_not_in_a_row():
    windows = StrikeWindows(limit=3, window=5, max_kept=8)
    marks = [True, False, True, False]  # 2 strikes, never in a row
    assert not any(windows.note("a", m) for m in marks)
    assert windows.note("a", True)  # 3 of the last 5
    windows.forget("a")
    assert not windows.note("a", True)  # a clean record after it was judged


def test_strikes_older_than_the_window_no_longer_count():
    windows = StrikeWindows(limit=2, window=3, max_kept=8)
    assert not windows.note("a", True)
    assert not windows.note("a", False)
    assert not windows.note("a", False)
    assert not windows.note("a", True)  # the first strike has left the window


def test_the_peer_judged_longest_ago_is_forgotten_first():
    windows = StrikeWindows(limit=2, window=4, max_kept=2)
    windows.note("a", True)
    windows.note("b", True)
    windows.note("a", False)  # a judged again: b is now the oldest
    windows.note("c", True)  # over the bound: b is forgotten
    assert len(windows) == 2
    assert not windows.note("b", True)  # b starts again: one strike
    assert windows.note("c", True)


@pytest.mark.parametrize("limit, window, kept", [(0, 3, 1), (4, 3, 1), (1, 3, 0)])
def test_bounds_that_make_no_sense_are_refused(limit, window, kept):
    with pytest.raises(ValueError):
        StrikeWindows(limit, window, kept)
