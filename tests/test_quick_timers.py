"""The quick timers of in-process tests (p2ptrain/testing/_timers.py, tests/conftest.py's fixtures):
``quick_timers_slow_joins`` shortens the same waits as ``quick_timers`` but the join margins
(docs/testing.md, "What a test may shorten, and why it is safe"), and both put the production
values back after the test."""

from __future__ import annotations

import importlib

import pytest

from p2ptrain.testing._timers import apply_quick_timers, JOIN_MARGINS, QUICK_TIMERS


def _values() -> dict[str, float]:
    return {name: getattr(importlib.import_module(module), name) for module, name, _ in QUICK_TIMERS}


def test_the_slow_joins_variant_shortens_every_wait_but_the_join_margins_and_both_are_undone() -> None:
    production = _values()
    quick = {name: value for _, name, value in QUICK_TIMERS}
    assert JOIN_MARGINS and JOIN_MARGINS <= set(quick), JOIN_MARGINS  # a renamed wait would keep nothing
    with pytest.MonkeyPatch.context() as patch:
        apply_quick_timers(patch.setattr)
        assert _values() == quick
    assert _values() == production
    with pytest.MonkeyPatch.context() as patch:
        apply_quick_timers(patch.setattr, keep_margins=True)
        assert _values() == {name: production[name] if name in JOIN_MARGINS else value for name, value in quick.items()}
    assert _values() == production
