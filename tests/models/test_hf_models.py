"""``[model] name = "hf"``: a causal LM of the installed transformers built from a checked config.

Every member builds bitwise-identical weights from the task's seed; GPT-2's tied head is stored
once and tied again on load (also into a module built on the meta device, as a trainer's snapshot
is); a config from the network is refused, in one line naming the field, for anything but
scalar settings the architecture declares; without transformers the line says how to install it.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from p2ptrain.models import (
    CardError, ModelError, build_model, card_of, check_hf_config, check_model, first_difference,
    model_file_limit,
)
from p2ptrain.models._registry import MAX_PARAMETERS, count_parameters
from p2ptrain.protocol import model_bytes, read_tensors
from p2ptrain.task import NoBuilder, TaskError, load_task, read_task, task_bytes
from p2ptrain.training import model_from_bytes

GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 97, "n_positions": 16,
        "bos_token_id": 0, "eos_token_id": 0}
CARD = {"name": "hf", "kwargs": GPT2}


def test_a_gpt2_config_builds_seeded_identical_models_that_return_logits():
    a, b, c = build_model("hf", GPT2, 7), build_model("hf", GPT2, 7), build_model("hf", GPT2, 8)
    assert model_bytes(a, CARD) == model_bytes(b, CARD)
    assert model_bytes(a, CARD) != model_bytes(c, CARD)
    x = torch.randint(0, 97, (3, 16), dtype=torch.int64).to(torch.uint16)  # token shards hold uint16 ids
    assert a(x).shape == (3, 16, 97)
    assert sum(p.numel() for p in a.parameters()) == count_parameters("hf", GPT2)
    assert len(model_bytes(a, CARD)) <= model_file_limit("hf", GPT2)
    llama = {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64,
             "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 50, "max_position_embeddings": 32}
    assert build_model("hf", llama, 0)(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5, 50)


def test_the_tied_head_is_stored_once_and_tied_again_on_load():
    module = build_model("hf", GPT2, 3)
    data = model_bytes(module, CARD)
    names = set(read_tensors(data))
    assert "model.transformer.wte.weight" in names and "model.lm_head.weight" not in names
    loaded = model_from_bytes(data)
    assert loaded.model.lm_head.weight is loaded.model.transformer.wte.weight
    x = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        assert torch.equal(loaded(x), module.eval()(x))
    # A trainer's snapshot: built on meta, the tensors assigned (not copied) into it.
    with torch.device("meta"):
        shell = build_model("hf", GPT2, 3)
    shell.load_state_dict(module.state_dict(), strict=True, assign=True)
    with torch.no_grad():
        assert torch.equal(shell.eval()(x), module(x))


def test_an_untied_config_is_another_architecture_and_a_raw_tied_module_is_named():
    tied, untied = build_model("hf", GPT2, 0), build_model("hf", {**GPT2, "tie_word_embeddings": False}, 0)
    cards = [card_of(m, torch.optim.Adam(m.parameters()), {}) for m in (tied, untied)]
    assert [t[0] for t in cards[0]["tensors"]].count("model.transformer.wte.weight") == 1
    assert first_difference(cards[0], cards[1]) == "this model has param model.lm_head.weight, the run's model has none"
    with pytest.raises(CardError, match="transformer.wte.weight and lm_head.weight are one tensor.*CausalLM"):
        card_of(tied.model, torch.optim.Adam(tied.parameters()), {})


@pytest.mark.parametrize("config, message", [
    ({**GPT2, "trust_remote_code": True}, r"^model.config.trust_remote_code: not allowed"),
    ({**GPT2, "auto_map": "x.Y"}, r"^model.config.auto_map: not allowed"),
    ({**GPT2, "_name_or_path": "gpt2"}, r"^model.config._name_or_path: a setting is a lower-case name"),
    ({**GPT2, "__class__": 1}, r"^model.config.__class__: a setting is"),
    ({**GPT2, "attn_implementation": "flash_attention_2"}, r"^model.config.attn_implementation: not allowed"),
    ({**GPT2, "dtype": "float16"}, r"^model.config.dtype: not allowed"),
    ({**GPT2, "n_layers": 3}, r"^model.config.n_layers: gpt2 has no such setting"),
    ({**GPT2, "model_type": "t5"}, r"^model.config.model_type: 't5' is not a causal language model"),
    ({**GPT2, "model_type": "../../x"}, r"^model.config.model_type: must name an architecture"),
    ({"n_layer": 2}, r"^model.config.model_type: must name"),
    ({**GPT2, "n_inner": {"a": 1}}, r"^model.config.n_inner: must be a number"),
    ({**GPT2, "bos_token_id": [[1]]}, r"^model.config.bos_token_id\[0\]: must be a number"),
    ({**GPT2, "bos_token_id": list(range(17))}, r"^model.config.bos_token_id: must be a number"),
    ({**GPT2, "n_layer": 10**6}, r"^model.config.n_layer: at most 256"),  # a module a layer: never built
    ({"model_type": "mixtral", "num_hidden_layers": 100, "num_local_experts": 100},
     r"^model.config: layers x experts is 10,000, more than 2,048"),
    ({**GPT2, "vocab_size": 2**60}, r"^model.config.vocab_size: at most 16,777,216"),
    ({**GPT2, "layer_norm_epsilon": math.nan}, r"^model.config.layer_norm_epsilon: must be a finite number"),
    ({**GPT2, "activation_function": "x" * 65}, r"^model.config.activation_function: a string of at most 64"),
    ({**GPT2, **{f"k{i}": 1 for i in range(64)}}, r"^model.config: 72 settings, more than 64"),
    ({**GPT2, "n_head": 3}, r"^model.config: transformers (refuses|cannot build) it: "),
    ({**GPT2, "activation_function": "os.system"}, r"^model.config: transformers (refuses|cannot build) it: "),
    ({**GPT2, "n_embd": 4096, "n_head": 32, "n_layer": 8}, r"over the 50,000,000 cap"),
])
def test_hostile_configs_are_refused_in_one_line_naming_the_field(config, message):
    with pytest.raises(ModelError, match=message) as caught:
        check_model("hf", config)
    assert "\n" not in str(caught.value)


TASK = """\
name = "lm"
[model]
name = "hf"
{model}
[dataset]
manifest = "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o"
[optimizer]
name = "adam"
lr = 0.001
[training]
batch_size = 8
total_steps = 10
"""


def test_a_task_carries_the_config_and_refuses_it_elsewhere():
    task = load_task(TASK.format(model='config = { model_type = "gpt2", n_layer = 2, n_embd = 32, n_head = 2 }'))
    assert task.model.config == {"model_type": "gpt2", "n_embd": 32, "n_head": 2, "n_layer": 2}
    assert task.model.arguments == task.model.config and task.model.kwargs == {}
    with pytest.raises(TaskError, match=r"^model.config: missing"):
        load_task(TASK.format(model=""))
    with pytest.raises(TaskError, match=r'^model.kwargs: not for name = "hf"'):
        load_task(TASK.format(model='config = { model_type = "gpt2" }\nkwargs = { width = 3 }'))
    with pytest.raises(TaskError, match=r"^model.config.trust_remote_code: not allowed"):
        load_task(TASK.format(model='config = { model_type = "gpt2", trust_remote_code = true }'))
    with pytest.raises(TaskError, match=r'^model.config: only for name = "hf"'):
        load_task(TASK.replace('name = "hf"', 'name = "mlp"').format(model='config = { model_type = "gpt2" }'))


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(st.dictionaries(
    st.sampled_from(["model_type", "n_layer", "n_embd", "n_head", "vocab_size", "n_positions", "n_inner",
                     "activation_function", "tie_word_embeddings", "auto_map", "_x", "layer_norm_epsilon", "x" * 70]),
    st.one_of(st.sampled_from(["gpt2", "llama", "gelu", ""]), st.integers(-2**70, 2**70),
              st.integers(0, 64), st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
              st.lists(st.integers(0, 9), max_size=20), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)),
    max_size=10))
def test_any_config_is_built_or_refused_with_a_model_error(config):
    try:
        n = check_model("hf", config)
    except ModelError as exc:
        assert str(exc).startswith("model.") and "\n" not in str(exc)
    else:
        assert 0 < n <= MAX_PARAMETERS
        assert check_hf_config(config)["model_type"] == config["model_type"]


def test_without_transformers_the_line_says_how_to_install_it(monkeypatch):
    from p2ptrain.models import builders

    assert "hf" in builders()
    monkeypatch.setitem(sys.modules, "transformers", None)  # what `import transformers` meets when it is not installed
    assert "hf" not in builders()  # what a node advertises in its capabilities
    with pytest.raises(ModelError, match=r"^model.name: hf models need the transformers package: "
                                         r"pip install 'p2ptrain\[hf\]'$"):
        check_model("hf", GPT2)
    with pytest.raises(NoBuilder, match=r"pip install 'p2ptrain\[hf\]'") as caught:
        load_task(TASK.format(model='config = { model_type = "gpt2", n_layer = 2 }'))
    # Still readable where it cannot be built (a chain's rules, model verify, repo gc).
    task = caught.value.task
    assert task is not None and task.model.config == {"model_type": "gpt2", "n_layer": 2}
    assert read_task(task_bytes(task)) == task
