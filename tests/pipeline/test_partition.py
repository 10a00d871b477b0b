"""Cutting a model into stages: balanced by parameters, contiguous, and the same bits as the whole."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from p2ptrain.models._registry import build_model
from p2ptrain.pipeline import balanced_cut, partition, PartitionError

LM = {"vocab_size": 61, "context": 16, "width": 16, "depth": 6, "heads": 2}


def _compose(stages, x):
    for stage in stages:
        x = stage(x)
    return x


@pytest.mark.parametrize("count", [1, 2, 3, 4, 8])
def test_transformer_lm_stages_compose_to_the_same_bits(count):
    model = build_model("transformer_lm", LM, seed=3)
    x = torch.randint(0, LM["vocab_size"], (3, 12), generator=torch.Generator().manual_seed(0))
    stages = partition(model, count)
    assert len(stages) == count
    with torch.no_grad():
        assert torch.equal(_compose(stages, x), model(x))
    # Every tensor lands in exactly one stage, under the whole model's name, in the model's order.
    names = [n for s in stages for n in s.state_names()]
    assert names == list(model.state_dict())
    assert sum(s.parameter_count() for s in stages) == sum(p.numel() for p in model.parameters())
    # The embedding is in the first stage, the head in the last.
    assert stages[0].state_names()[0] == "tokens.weight"
    assert stages[-1].state_names()[-1] == "head.bias"


def test_the_gradients_of_composed_stages_are_the_model_gradients():
    model = build_model("transformer_lm", LM, seed=4)
    x = torch.randint(0, LM["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(1))
    model(x).square().mean().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    _compose(partition(model, 4), x).square().mean().backward()
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, expected[name]), name


def test_the_cut_is_balanced_by_parameter_count():
    # Pieces 10, 1, 1, 1, 10, 1 in 3 stages: the largest stage can be no smaller than 11.
    assert balanced_cut([10, 1, 1, 1, 10, 1], 3).stage_sizes() == [10, 3, 11]
    # Exhaustive check against every contiguous cut on small inputs.
    import itertools

    g = torch.Generator().manual_seed(5)
    for _ in range(50):
        sizes = torch.randint(0, 20, (7,), generator=g).tolist()
        for stages in range(1, 8):
            best = min(
                max(sum(sizes[a:b]) for a, b in zip((0, *cuts), (*cuts, 7), strict=True))
                for cuts in itertools.combinations(range(1, 7), stages - 1)
            )
            cut = balanced_cut(sizes, stages)
            assert max(cut.stage_sizes()) == best, (sizes, stages)
            assert cut.bounds[0] == 0 and cut.bounds[-1] == 7
            assert all(a < b for a, b in zip(cut.bounds, cut.bounds[1:], strict=False))


def test_a_sequential_is_cut_and_composes_to_the_same_bits():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3))
    stages = partition(model, 3)
    assert [s.parameter_count() for s in stages] == [8 * 64 + 64, 64 * 64 + 64, 64 * 3 + 3]
    x = torch.randn(5, 8)
    with torch.no_grad():
        assert torch.equal(_compose(stages, x), model(x))
    assert [n for s in stages for n in s.state_names()] == list(model.state_dict())


def test_a_module_applied_twice_is_kept_twice():
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.Tanh(), shared)
    with torch.no_grad():
        x = torch.randn(2, 4)
        assert torch.equal(_compose(partition(model, 1), x), model(x))


def test_a_weight_tied_across_stages_is_refused_and_within_a_stage_is_fine():
    embed, head = nn.Linear(4, 32, bias=False), nn.Linear(32, 4, bias=False)
    head.weight = nn.Parameter(embed.weight.t().contiguous())  # not tied: a copy
    tied_head = nn.Linear(4, 32, bias=False)
    tied_head.weight = embed.weight  # tied
    model = nn.Sequential(embed, nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), tied_head)
    with pytest.raises(PartitionError, match="4.weight is tied"):
        partition(model, 2)
    assert len(partition(model, 1)) == 1


def test_models_that_are_not_a_sequence_of_blocks_are_refused():
    cnn = build_model("cnn", {}, seed=0)
    with pytest.raises(PartitionError, match="SmallCNN cannot be cut"):
        partition(cnn, 2)
    with pytest.raises(PartitionError, match="cannot cut 8 pieces into 9 stages"):
        partition(build_model("transformer_lm", LM, seed=0), 9)
    with pytest.raises(PartitionError, match="into 0 stages"):
        partition(build_model("transformer_lm", LM, seed=0), 0)
