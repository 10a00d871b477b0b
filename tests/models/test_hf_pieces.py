"""An hf causal LM cut into pieces computes, piece after piece, the bits its own ``forward``
computes (models/_hf_pieces.py), family by family; what cannot be cut is refused in one line."""

from __future__ import annotations

import pytest
import torch

from p2ptrain.models import build_model, cut_pieces, PartitionError
from p2ptrain.task import load_task, TaskError

pytest.importorskip("transformers")

SMALL = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
FAMILIES = {
    "gpt2": dict(model_type="gpt2", vocab_size=97, n_embd=32, n_layer=3, n_head=4, n_positions=64, resid_pdrop=0.0,
                 embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False),
    "llama": dict(model_type="llama", **SMALL),
    # A window shorter than the sequence: the sliding mask is what each layer must be given.
    "mistral": dict(model_type="mistral", sliding_window=8, **SMALL),
    # Sliding layers after the first only (max_window_layers): each layer its own kind of mask.
    "qwen2": dict(model_type="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1, **SMALL),
    "qwen3": dict(model_type="qwen3", head_dim=8, **SMALL),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_pieces_compose_to_the_whole_models_bits_and_names(family):
    model = build_model("hf", FAMILIES[family], seed=3)
    pieces, cut = cut_pieces(model, 3)
    assert len(pieces) == 5 and cut.bounds[0] == 0 and cut.bounds[-1] == 5
    assert [name for piece in pieces for name in piece.state_names()] == list(model.state_dict())
    x = torch.randint(0, 97, (2, 20))
    h = x
    for piece in pieces:
        h = piece(h)
    assert torch.equal(h, model(x))
    # Gradients too: a stage's backward is the whole model's, restricted to its parameters.
    loss = torch.nn.functional.cross_entropy(h.flatten(0, 1), x.flatten())
    grads = torch.autograd.grad(loss, list(model.parameters()))
    model.zero_grad()
    whole = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
    for got, want in zip(grads, torch.autograd.grad(whole, list(model.parameters())), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_driver_finds_each_stages_answer_shape_on_the_meta_device(family):
    """A driver checks every answer's shape against the one the stage computes on the meta device
    (``pipeline.output_shape``): transformers' mask functions read the positions' values, which a
    meta tensor has not, and the first 4-stage run of node/tasks/llama-pipeline.toml failed so."""
    from p2ptrain.models import meta_model
    from p2ptrain.pipeline import partition
    from p2ptrain.pipeline._partition import output_shape

    cut = partition(meta_model("hf", FAMILIES[family]), 4)
    assert output_shape(cut[0], torch.zeros(2, 20, dtype=torch.int64)) == (2, 20, 32)
    for stage in cut[1:3]:
        assert output_shape(stage, torch.zeros(2, 20, 32)) == (2, 20, 32)
    assert output_shape(cut[3], torch.zeros(2, 20, 32)) == (2, 20, 97)


def test_a_sequence_longer_than_the_context_is_refused_before_any_mask_is_built():
    pieces, _ = cut_pieces(build_model("hf", FAMILIES["llama"], seed=3), 2)
    with pytest.raises(ValueError, match="activation of 65 positions is longer than the model's context 64"):
        pieces[1](torch.zeros(1, 65, 32))


@pytest.mark.parametrize(("config", "why"), [
    (dict(model_type="gpt2", vocab_size=97, n_embd=32, n_layer=3, n_head=4, n_positions=64),
     r"model.transformer.drop \(p = 0.1\) drops out activations"),
    (dict(model_type="gpt2", vocab_size=97, n_embd=32, n_layer=3, n_head=4, n_positions=64, resid_pdrop=0.0,
          embd_pdrop=0.0, attn_pdrop=0.0),
     r"model.lm_head.weight is tied to a weight of another stage; .*tie_word_embeddings = false"),
    (dict(model_type="llama", attention_dropout=0.1, **SMALL), r"attention_dropout \(0.1\) drops out activations"),
    (dict(model_type="gpt_neox", vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
          num_attention_heads=4), "model_type 'gpt_neox' cannot be cut into stages: only gpt2, llama"),
])
def test_what_cannot_be_cut_is_refused_naming_why(config, why):
    with pytest.raises(PartitionError, match=why):
        cut_pieces(build_model("hf", config, seed=3), 2)


def test_a_pipelined_hf_task_is_checked_when_parsed():
    def task(config: str) -> str:
        return (f'name = "t"\n[model]\nname = "hf"\nconfig = {{ {config} }}\n'
                '[dataset]\nmanifest = "QmPr27mpm19tVRhDMn98aEecF9ii7FVYZVuQNeTGNTFida"\n'
                '[optimizer]\nname = "sgd"\nlr = 0.1\n[training]\nbatch_size = 4\ntotal_steps = 10\n'
                "[peers]\nmin = 2\n[pipeline]\nstages = 2\nmicrobatch_size = 2\n")

    llama = 'model_type = "llama", vocab_size = 97, hidden_size = 32, intermediate_size = 64, num_hidden_layers = 2, ' \
            "num_attention_heads = 4, max_position_embeddings = 64"
    assert load_task(task(llama)).pipeline.stages == 2
    with pytest.raises(TaskError, match="pipeline.stages: .*drops out activations"):
        load_task(task('model_type = "gpt2", vocab_size = 97, n_embd = 32, n_layer = 2, n_head = 4, n_positions = 64'))


def test_the_shipped_pipelined_llama_task_parses_and_cuts_into_four_balanced_stages():
    from pathlib import Path

    from p2ptrain.task import stage_parameters

    text = (Path(__file__).resolve().parents[2] / "node" / "tasks" / "llama-pipeline.toml").read_text()
    task = load_task(text.replace("QmReplaceWithTheManifestCidPrintedByDatasetAdd",
                                  "QmPr27mpm19tVRhDMn98aEecF9ii7FVYZVuQNeTGNTFida"))
    sizes = stage_parameters(task)
    assert len(sizes) == 4 and 12_000_000 < sum(sizes) < 14_000_000
    assert max(sizes) < 1.5 * sum(sizes) / 4  # balanced: no stage much above a quarter
