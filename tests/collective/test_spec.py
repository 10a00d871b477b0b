"""RoundSpec: a round's options, checked once where they are made, then passed down whole.

Every bad option is one CollectiveError at construction (not at the third layer down, mid-round);
a task's [compression] maps to the spec its rounds run with (training.sync.round_spec).
"""

from __future__ import annotations

import pytest
import torch

from p2ptrain.collective import CollectiveError, RoundSpec
from p2ptrain.testing._peers import DIGITS_TASK
from p2ptrain.training._sync import round_spec
from p2ptrain.task import load_task

TASK = DIGITS_TASK.format(name="t", manifest="QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o", total_steps=10,
                          checkpoint_interval=5, min_peers=1, max_peers=4)


@pytest.mark.parametrize("options, message", [
    ({"op": "max"}, "op must be one of"),
    ({"density": 0.0}, "density must be in"),
    ({"density": 1.5}, "density must be in"),
    ({"value_dtype": torch.int64}, "unsupported value dtype"),
    ({"robust": "median"}, "robust must be one of"),
    ({"quantize": "int4", "density": 0.1}, "quantize='int4' is not supported"),
    ({"quantize": "int8"}, "with density < 1"),
    ({"timeout": 0}, "timeouts must be positive"),
    ({"start_timeout": -1.0}, "timeouts must be positive"),
])
def test_a_bad_option_is_refused_where_the_spec_is_made(options: dict, message: str) -> None:
    with pytest.raises(CollectiveError, match=message):
        RoundSpec(**options)


def test_the_defaults_are_the_dense_mean_in_the_tensors_own_dtype() -> None:
    spec = RoundSpec()
    assert (spec.op, spec.density, spec.robust, spec.quantize) == ("mean", 1.0, "none", None)
    assert spec.average and spec.join_timeout == spec.timeout == 5.0
    assert spec.values_of(torch.bfloat16) is torch.bfloat16
    assert RoundSpec(timeout=2.0, start_timeout=9.0).join_timeout == 9.0


@pytest.mark.parametrize("compression, expected", [
    ("", RoundSpec(density=0.01, value_dtype=torch.float32)),
    ("fp16_values = true", RoundSpec(density=0.01, value_dtype=torch.float16)),
    ('values = "2bit"\nrobust = "clip"', RoundSpec(density=0.01, value_dtype=torch.float32, robust="clip", quantize="2bit")),
    ("density = 1.0\nerror_feedback = false", RoundSpec(value_dtype=torch.float32)),
    ('robust = "clip"\ncheck_fraction = 0.25',
     RoundSpec(density=0.01, value_dtype=torch.float32, robust="clip", check_fraction=0.25)),
])
def test_a_tasks_compression_is_the_spec_its_rounds_run_with(compression: str, expected: RoundSpec) -> None:
    task = load_task(TASK + f"[compression]\n{compression}\n")
    assert round_spec(task.compression) == expected
