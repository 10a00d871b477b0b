"""``model import`` / ``model export`` of save_pretrained directories: real directories written by
transformers here, then broken one way at a time; each is refused in one line and nothing is made."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from p2ptrain.ipfs import EmbeddedStore
from p2ptrain.models import build_model
from p2ptrain.protocol import model_bytes, read_model_card
from p2ptrain.testing import run_forked
from p2ptrain.training import PretrainedError, export_pretrained, import_pretrained, model_from_bytes

SETTINGS = {"n_layer": 1, "n_embd": 16, "n_head": 2, "vocab_size": 40, "n_positions": 8, "bos_token_id": 0,
            "eos_token_id": 0}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    root = tmp_path_factory.mktemp("pretrained") / "gpt2"
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", **SETTINGS)).eval()
    model.save_pretrained(root)
    return root, model


def copy_of(saved_dir: Path, to: Path) -> Path:
    to.mkdir()
    for f in saved_dir.iterdir():
        (to / f.name).write_bytes(f.read_bytes())
    return to


def test_import_keeps_the_weights_and_the_settings_that_differ_and_export_gives_them_back(saved, tmp_path):
    directory, model = saved
    data, card = import_pretrained(directory)
    assert card == {"name": "hf", "kwargs": {"model_type": "gpt2", **dict(sorted(SETTINGS.items()))}}
    assert read_model_card(data) == card
    x = torch.randint(0, 40, (2, 8))
    with torch.no_grad():
        assert torch.equal(model_from_bytes(data)(x), model(x).logits)
    out = export_pretrained(data, tmp_path / "out")
    assert {"config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind
    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(out).eval()(x).logits, model(x).logits)
    assert import_pretrained(out)[0] == data  # the round trip is the same model, byte for byte
    with pytest.raises(PretrainedError, match="exists; export writes a new directory"):
        export_pretrained(data, out)


def test_model_export_prints_its_line_and_no_progress_bar_of_transformers(saved, tmp_path):
    """``p2ptrain model export CID DIR`` (a real process) says what it wrote in one line on stdout,
    and its stderr holds no "Writing model shards" tqdm bar of save_pretrained's; in a process of
    the user's, transformers' progress bars are as they were afterwards. Red before: the bar was on
    stderr."""
    data, _ = import_pretrained(saved[0])
    home = tmp_path / "home"
    cid = EmbeddedStore(home).add_bytes(data)
    done = run_forked([sys.executable, "-m", "p2ptrain.cli.main", "model", "export", cid, str(tmp_path / "out"),
                       "--home", str(home)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{cid} -> ") and len(done.stdout.splitlines()) == 1
    assert "Writing model shards" not in done.stderr and "\r" not in done.stderr, done.stderr
    assert hf_logging.is_progress_bar_enabled()
    export_pretrained(data, tmp_path / "in-process")
    assert hf_logging.is_progress_bar_enabled()


def test_export_refuses_a_model_of_another_builder(tmp_path):
    data = model_bytes(build_model("mlp", {}, 0), {"name": "mlp", "kwargs": {}})
    with pytest.raises(PretrainedError, match=r"this file is a 'mlp' model \(p2ptrain model fetch"):
        export_pretrained(data, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _edit_config(d: Path, **changes: object) -> None:
    config = json.loads((d / "config.json").read_text())
    config.update(changes)
    (d / "config.json").write_text(json.dumps(config))


def _edit_weights(d: Path, edit) -> None:
    tensors = safetensors.torch.load_file(d / "model.safetensors")
    edit(tensors)
    safetensors.torch.save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("breakage, message", [
    (lambda d: (d / "config.json").unlink(), r"no config.json"),
    (lambda d: (d / "model.safetensors").rename(d / "pytorch_model.bin"),
     r"no model.safetensors \(pytorch_model.bin is a pickle, never read"),
    (lambda d: (d / "config.json").write_text("[" * 100), r"config.json: .*(deep|nest)"),
    (lambda d: _edit_config(d, model_type="bert_generation_x"), r"model_type: 'bert_generation_x' is not a causal"),
    (lambda d: _edit_config(d, auto_map={"AutoModel": "m.M"}), r"auto_map: this model needs code from its repository"),
    (lambda d: _edit_config(d, n_embd=32), r"model.safetensors: transformer.wte.weight is \(40, 16\), config.json makes "
                                           r"it \(40, 32\)"),
    (lambda d: _edit_config(d, n_layer=2), r"does not fit config.json: no tensor transformer.h.1"),
    (lambda d: _edit_config(d, n_embd=4096, n_head=32, n_layer=8), r"over the 50,000,000 cap"),
    (lambda d: _edit_weights(d, lambda t: t.update({"transformer.wpe.weight": t["transformer.wpe.weight"].to(torch.int8)})),
     r"transformer.wpe.weight is torch.int8; only float32, float16 and bfloat16"),
    (lambda d: _edit_weights(d, lambda t: t.update({"extra.weight": torch.zeros(2)})), r"an extra tensor extra.weight"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 64), r"model.safetensors: not a valid safetensors"),
])
def test_a_broken_directory_is_refused_in_one_line(saved, tmp_path, breakage, message):
    directory = copy_of(saved[0], tmp_path / "broken")
    breakage(directory)
    with pytest.raises(PretrainedError, match=message) as caught:
        import_pretrained(directory)
    assert "\n" not in str(caught.value)


def test_half_precision_weights_are_widened_to_fp32(saved, tmp_path):
    directory = copy_of(saved[0], tmp_path / "half")
    _edit_weights(directory, lambda t: t.update({k: v.half() for k, v in t.items()}))
    module = model_from_bytes(import_pretrained(directory)[0])
    assert {p.dtype for p in module.parameters()} == {torch.float32}
    assert torch.equal(module.model.transformer.wpe.weight, saved[1].transformer.wpe.weight.half().float())


def test_model_serve_takes_an_hf_model_with_its_vocabulary_and_positions(saved, tmp_path):
    from p2ptrain.ipfs import EmbeddedStore
    from p2ptrain.serve._input_spec import InputError, parse_request
    from p2ptrain.serve._server import load_served

    store = EmbeddedStore(tmp_path / "home")
    cid = store.add_bytes(import_pretrained(saved[0])[0])
    loaded = load_served(store, cid, torch.device("cpu"))
    assert loaded.spec.describe() == {"dtype": "int64", "shape": ["T"], "max_len": 8, "vocab": 40}
    x = parse_request(b'{"inputs": [[1, 2, 3], [4, 5, 6]]}', loaded.spec)
    with torch.no_grad():
        assert torch.equal(loaded.module(x), saved[1](x).logits)
    for body in (b'{"inputs": [[40]]}', b'{"inputs": [[' + b"1," * 8 + b"1]]}"):
        with pytest.raises(InputError):
            parse_request(body, loaded.spec)
