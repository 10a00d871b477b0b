"""Property-based fuzz of every decoder of network or disk input (targets in targets_*.py).

Each decoder gets 300 hostile cases: raw bytes from hypothesis, and seeded mutations that plant
huge integers, deep nesting and non-finite numbers into valid samples; the only exceptions
allowed out are the decoder's declared errors. bench/fuzz.py runs the same targets
with 10,000+ cases each.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def _fuzzing():
    """tests/fuzz/fuzzing.py, loaded by path under the name its targets import it by."""
    name = "_p2ptrain_fuzzing"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("fuzzing.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


fuzzing = _fuzzing()
TARGETS = fuzzing.load_targets()


def test_there_are_targets():
    assert len(TARGETS) >= 1
    assert len({t.name for t in TARGETS}) == len(TARGETS), "fuzz target names must be unique"


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
def test_valid_samples_are_accepted(target):
    for sample in target.seeds:
        verdict, detail = fuzzing.run_case(target, sample)
        assert verdict == "accepted", f"{target.name}: a valid sample was {verdict}: {detail}"


# The 300 cases a decoder gets, in the mix they always had (one in five raw bytes, four in five
# seeded mutations of its valid samples), split by who makes them. A mutation is made by a seeded
# random.Random (fuzzing.hostile_input, as bench/fuzz.py makes its 10,000), so hypothesis added no
# search to it, only its engine: ~75% of this file's CPU went to hypothesis's bookkeeping around
# 17,100 examples (profiled: run_case and hostile_input ~12 of ~41 CPU-s). Hypothesis keeps the raw
# bytes, where its generation and shrinking are what find and show a bug.
MUTATIONS = 240
RAW_EXAMPLES = 60


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
@settings(max_examples=RAW_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(raw=st.binary(max_size=2048))
def test_only_declared_errors(target, raw):
    verdict, detail = fuzzing.run_case(target, raw)
    assert verdict != "crash", f"{target.name}: {detail} on {raw[:200]!r}"


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
def test_only_declared_errors_on_mutated_samples(target):
    for seed in range(MUTATIONS):  # one seed a case: a crash names the seed that remakes it
        raw = fuzzing.hostile_input(target, random.Random(seed))
        verdict, detail = fuzzing.run_case(target, raw)
        assert verdict != "crash", f"{target.name}, seed {seed}: {detail} on {raw[:200]!r}"
