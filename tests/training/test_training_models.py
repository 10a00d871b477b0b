"""Model registry: known builders only, checked kwargs, capped size, seeded init, working forward."""

import pytest
import torch

from p2ptrain.models._registry import MAX_PARAMETERS, count_parameters
from p2ptrain.models import ModelError, build_model, check_model
from p2ptrain.protocol import model_bytes


def test_unknown_model_and_arguments_refused():
    with pytest.raises(ModelError, match=r"^model.name: unknown model 'os.system'"):
        build_model("os.system", {}, 0)
    with pytest.raises(ModelError, match=r"^model.kwargs.activation: mlp takes no such argument"):
        check_model("mlp", {"activation": "relu"})
    with pytest.raises(ModelError, match=r"^model.kwargs.width: must be an integer"):
        check_model("transformer_lm", {"width": "128"})
    with pytest.raises(ModelError, match=r"^model.kwargs.heads: width 100 is not divisible"):
        check_model("transformer_lm", {"width": 100, "heads": 3})
    with pytest.raises(ModelError, match=r"^model.kwargs.channels: must be a list"):
        check_model("cnn", {"channels": 16})


def test_parameter_cap_counted_without_allocating():
    kwargs = {"vocab_size": 50000, "width": 1024, "depth": 4, "heads": 8}
    n = count_parameters("transformer_lm", kwargs)  # ~150M parameters, counted on the meta device
    assert n > MAX_PARAMETERS
    with pytest.raises(ModelError, match="over the 50,000,000 cap"):
        build_model("transformer_lm", kwargs, 0)


@pytest.mark.parametrize(
    "name, kwargs, x, out_shape",
    [
        ("mlp", {"hidden": [32, 16]}, torch.randn(5, 64), (5, 10)),
        ("cnn", {}, torch.randn(5, 64), (5, 10)),  # digits arrive flat
        ("cnn", {"image_size": 28, "channels": [8, 16]}, torch.randn(5, 1, 28, 28), (5, 10)),
        ("transformer_lm", {"vocab_size": 97, "context": 16, "width": 32, "depth": 2, "heads": 4},
         torch.randint(0, 97, (3, 16)), (3, 16, 97)),
    ],
)
def test_builders_seeded_and_working(name, kwargs, x, out_shape):
    a, b, c = build_model(name, kwargs, 7), build_model(name, kwargs, 7), build_model(name, kwargs, 8)
    assert model_bytes(a) == model_bytes(b)
    assert model_bytes(a) != model_bytes(c)
    assert a(x).shape == out_shape
    assert sum(p.numel() for p in a.parameters()) == count_parameters(name, kwargs)


def test_seeding_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model("mlp", {}, 5)
    assert torch.equal(torch.rand(3), expected)


def test_transformer_is_causal_and_blocks_differ():
    m = build_model("transformer_lm", {"vocab_size": 50, "context": 8, "width": 16, "depth": 2, "heads": 2}, 0)
    x = torch.randint(0, 50, (1, 8))
    y = x.clone()
    y[0, 5] = (y[0, 5] + 1) % 50
    with torch.no_grad():
        assert torch.allclose(m(x)[0, :5], m(y)[0, :5], atol=1e-5)  # the future does not leak back
        assert not torch.allclose(m(x)[0, 5:], m(y)[0, 5:])
    w0, w1 = m.blocks[0].linear1.weight, m.blocks[1].linear1.weight
    assert not torch.equal(w0, w1)
    with pytest.raises(ValueError, match="longer than the model's context"):
        m(torch.zeros(1, 9, dtype=torch.long))


def test_models_built_at_once_from_threads_are_identical():
    """In-process peers build their trainers in worker threads: torch's initialisers share one global
    generator, and without a lock concurrent builds interleaved their draws (members of one run then
    started from different initial models, and every record forked)."""
    from concurrent.futures import ThreadPoolExecutor

    from p2ptrain.models import build_model

    def weights(_: int) -> bytes:
        module = build_model("mlp", {"in_features": 64, "hidden": [256, 256, 256], "out_features": 10}, 7)
        return b"".join(p.detach().numpy().tobytes() for p in module.parameters())

    with ThreadPoolExecutor(8) as pool:
        built = list(pool.map(weights, range(32)))
    assert len(set(built)) == 1
