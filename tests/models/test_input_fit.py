"""A task whose data set's samples do not fit its model is refused at join in one line
(models/_fit.py: one forward pass on the meta device), not found inside the first step."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import trio

from p2ptrain.models import input_problem
from p2ptrain.testing import local_peers
from p2ptrain.testing._peers import DIGITS_TASK

pytestmark = pytest.mark.usefixtures("quick_timers")  # tests/conftest.py: the protocol's idle waits shortened

MLP = {"in_features": 64, "hidden": [16], "out_features": 10}


@pytest.mark.parametrize(("name", "kwargs", "shape", "fits"), [
    ("mlp", MLP, (64,), True),
    ("mlp", MLP, (8, 8), True),  # flattened by the model
    ("mlp", MLP, (32,), False),
    ("transformer_lm", {"context": 128}, (128,), True),
    ("transformer_lm", {"context": 32}, (128,), False),  # windows longer than the context
    ("cnn", {}, (64,), True),  # digits 8x8, flat
    ("cnn", {"in_channels": 3, "image_size": 32}, (3, 32, 32), True),
    ("cnn", {}, (1, 28, 28), False),
])
def test_samples_fit_a_model_or_the_problem_is_one_line(name, kwargs, shape, fits) -> None:
    problem = input_problem(name, kwargs, shape)
    assert (problem is None) is fits, problem
    if not fits:
        assert "\n" not in problem and f"samples of shape {shape}" in problem and name in problem


def test_an_mlp_of_the_wrong_width_is_told_which_setting_to_change() -> None:
    assert input_problem("mlp", MLP, (4,)) == ("samples of shape (4,) do not fit model mlp: it takes in_features = 64 "
                                               "values a sample, these have 4 (set in_features = 4)")


def test_a_cnn_of_the_wrong_image_size_is_told_which_settings_to_change() -> None:
    """It said torch's "shape '[1, 3, 8, 8]' is invalid for input of size 768", naming no setting."""
    assert input_problem("cnn", {"in_channels": 3}, (3, 16, 16)) == (
        "samples of shape (3, 16, 16) do not fit model cnn: it takes 3 channel(s) of 8x8 pixels "
        "(set in_channels = 3, image_size = 16)")


def test_a_builder_this_package_does_not_ship_is_not_judged() -> None:
    assert input_problem("hf", {}, (10_000,)) is None


async def test_a_member_refuses_a_task_whose_samples_do_not_fit_its_model_in_one_line(tmp_path: Path) -> None:
    """Before: the run failed in its first step as 'internal error: ExceptionGroup(...)'."""
    from p2ptrain.data import build_dataset, load_source
    from p2ptrain.task import load_task, task_bytes

    async with local_peers(1, tmp_path) as peers:
        peer = peers[0]
        store = peer.content.store

        def build() -> str:
            source, features, labels = load_source("sklearn:digits")
            manifest, _ = build_dataset(store, source, (features / 16.0).astype(np.float32), labels, 2,
                                        test_fraction=0.2)
            text = DIGITS_TASK.format(name="misfit", manifest=manifest, total_steps=4, checkpoint_interval=2,
                                      min_peers=1, max_peers=1)
            return store.add_bytes(task_bytes(load_task(text.replace("in_features = 64", "in_features = 32"))))

        task_cid = await trio.to_thread.run_sync(build)
        with trio.fail_after(60):
            run = await peer.tasks.join(task_cid)
            await peers.wait_until(lambda: run.shared.phase == "failed" or None, 60, what="the run refused")
        assert run.shared.error is not None and "internal error" not in run.shared.error
        assert "do not fit" in run.shared.error and "(64,)" in run.shared.error, run.shared.error
