"""Shared fixtures: scikit-learn digits published as a real dataset in an embedded store, a digits
task maker, and an exact in-process mean standing in for the all-reduce (the same tensor for all).

Tests run with ``--import-mode=importlib``, so helpers reach test modules as fixtures."""

import numpy as np
import pytest
import torch
import trio

from p2ptrain.data import build_dataset, load_source
from p2ptrain.ipfs import EmbeddedStore
from p2ptrain.task import load_task

# The models here are tiny: extra intra-op threads only fight the other processes on a small machine.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def digits(tmp_path_factory):
    """``(store, manifest_cid)`` of digits (features scaled to [0, 1]) in 6 train shards."""
    store = EmbeddedStore(tmp_path_factory.mktemp("digits-home"))
    name, features, labels = load_source("sklearn:digits")
    cid, _ = build_dataset(store, name, (features / 16.0).astype(np.float32), labels, 6, test_fraction=0.2)
    return store, cid


def digits_task(manifest_cid, steps=150, **extra):
    """A digits MLP task; ``extra`` maps "section.key" to a TOML value string."""
    sections = {"training": {"batch_size": "32", "total_steps": str(steps), "checkpoint_interval": "5"},
                "optimizer": {"name": '"adam"', "lr": "0.005"},
                "model": {"name": '"mlp"', "kwargs": "{ hidden = [64] }"},
                "dataset": {"manifest": f'"{manifest_cid}"'}}
    for key, value in extra.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    text = 'name = "digits"\nseed = 3\n' + "".join(
        f"[{s}]\n" + "".join(f"{k} = {v}\n" for k, v in body.items()) for s, body in sections.items()
    )
    return load_task(text)


class ExactMean:
    """The members' mean gradient, computed once per round id and handed to all of them."""

    def __init__(self, members: int) -> None:
        self.members = members
        self.rounds: dict[int, tuple[list[torch.Tensor], trio.Event, list[torch.Tensor]]] = {}
        self.calls = 0

    async def average(self, flat: torch.Tensor, round_id: int) -> torch.Tensor:
        self.calls += 1
        parts, done, result = self.rounds.setdefault(round_id, ([], trio.Event(), []))
        parts.append(flat.clone())
        if len(parts) == self.members:
            result.append(torch.stack(parts).mean(0))
            done.set()
        with trio.fail_after(10):
            await done.wait()
        return result[0].clone()


@pytest.fixture(name="digits_task")
def digits_task_fixture():
    return digits_task


@pytest.fixture(name="ExactMean")
def exact_mean_fixture():
    return ExactMean
