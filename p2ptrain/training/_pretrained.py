"""Hugging Face ``save_pretrained`` directories in and out: ``model import`` and ``model export``.

:func:`import_pretrained` reads a local directory (``config.json`` and ``model.safetensors``; a
pickled ``pytorch_model.bin`` is never opened) into the bytes of a p2ptrain model of ``name = "hf"``:
the config reduced to the settings that differ from the architecture's defaults (the same checked
table a task's ``[model] config`` holds), the weights checked name by name, shape by shape against
the model that config builds. A task names the result's CID as ``initial_model`` to fine-tune it.
:func:`export_pretrained` writes such a model back as a directory ``transformers`` loads with
``from_pretrained``, atomically (a temporary directory renamed into place).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from p2ptrain.base import UserError, boundedjson
from p2ptrain.models import (
    CausalLM, HF_MODEL, HF_REFUSED, MAX_MODEL_FILE_BYTES, ModelError, build_model, check_hf_config, hf_settings,
    import_transformers, model_file_limit,
)
from p2ptrain.protocol import RecordError, model_bytes, read_model_card, read_tensors

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
MAX_CONFIG_BYTES = 1024 * 1024
MAX_CONFIG_DEPTH = 8
# Widened to the fp32 every member trains in; other dtypes (quantized integers) are refused.
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
# What save_pretrained adds to its file beyond what model_file_limit allows for ours.
_HEADER_ALLOWANCE = 64 * 1024


class PretrainedError(UserError):
    """A directory that is not a model ``model import`` reads, or a model ``model export`` cannot write."""


def _read_bounded(path: Path, limit: int, what: str) -> bytes:
    size = path.stat().st_size
    if size > limit:
        raise PretrainedError(f"{path}: {size:,} B, over the {limit:,} B {what}")
    with path.open("rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise PretrainedError(f"{path}: grew past the {limit:,} B {what} while read")
    return data


def pretrained_config(directory: Path) -> dict[str, Any]:
    """The checked hf config of a ``save_pretrained`` directory: its ``model_type`` and the
    settings that differ from that architecture's defaults (metadata such as ``architectures`` and
    ``transformers_version`` is left out)."""
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise PretrainedError(f"{directory}: no {CONFIG_FILE} (a save_pretrained directory has one)")
    try:
        raw = boundedjson.loads(_read_bounded(path, MAX_CONFIG_BYTES, "limit for a config"),
                                max_depth=MAX_CONFIG_DEPTH, what=CONFIG_FILE)
    except boundedjson.JSONBoundsError as exc:
        raise PretrainedError(f"{path}: {exc}") from None
    if not isinstance(raw, dict):
        raise PretrainedError(f"{path}: not a JSON object")
    for key in ("auto_map", "trust_remote_code"):
        if key in raw:
            raise PretrainedError(f"{path}: {key}: this model needs code from its repository; only architectures "
                                  "of the installed transformers are imported")
    try:
        check_hf_config({"model_type": raw.get("model_type")})
        import_transformers()
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        cls = CONFIG_MAPPING[raw["model_type"]]
        defaults = cls().to_dict()
        known = hf_settings(cls)
        config = {k: v for k, v in raw.items()
                  if k in known and not k.startswith("_") and k not in HF_REFUSED and v != defaults.get(k)}
        return check_hf_config({"model_type": raw["model_type"], **config})
    except ModelError as exc:
        raise PretrainedError(f"{path}: {str(exc).removeprefix('model.config.')}") from None


def import_pretrained(directory: Path) -> tuple[bytes, dict[str, Any]]:
    """``(model bytes, card)`` of a ``save_pretrained`` directory: a p2ptrain model of ``name = "hf"``
    (fp32, its weights those of the directory), ready to store by CID."""
    directory = Path(directory)
    if not directory.is_dir():
        raise PretrainedError(f"{directory}: not a directory")
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        if (directory / f"{WEIGHTS_FILE}.index.json").exists():
            raise PretrainedError(f"{directory}: sharded weights; save it as one {WEIGHTS_FILE} "
                                  "(save_pretrained(..., max_shard_size='50GB'))")
        pickled = " (pytorch_model.bin is a pickle, never read: save with safetensors)" \
            if (directory / "pytorch_model.bin").exists() else ""
        raise PretrainedError(f"{directory}: no {WEIGHTS_FILE}{pickled}")
    config = pretrained_config(directory)
    try:
        limit = model_file_limit(HF_MODEL, config) + _HEADER_ALLOWANCE
        module = build_model(HF_MODEL, config, seed=0)
    except ModelError as exc:
        raise PretrainedError(f"{directory / CONFIG_FILE}: {exc}") from None
    try:
        tensors = read_tensors(_read_bounded(weights, limit, "a model of this config takes"))
    except RecordError as exc:
        raise PretrainedError(f"{weights}: {exc}") from None
    assert isinstance(module, CausalLM)
    _load_weights(module, tensors, weights)
    card = {"name": HF_MODEL, "kwargs": config}
    return model_bytes(module, card), card


def _load_weights(module: CausalLM, tensors: dict[str, torch.Tensor], weights: Path) -> None:
    """Copy a save_pretrained file's tensors (names without our ``model.`` prefix) into ``module``,
    which must need exactly them: a file saved with a tied name too is accepted when it holds the
    same values."""
    expected = module.state_dict()
    given = {f"model.{name}": t for name, t in tensors.items()}
    for alias, source in module.aliases.items():
        if alias in given and source in given:
            if not torch.equal(given[alias].float(), given[source].float()):
                raise PretrainedError(f"{weights}: {alias[6:]} differs from {source[6:]}, to which config.json ties it")
            del given[alias]
    missing, extra = sorted(set(expected) - set(given)), sorted(set(given) - set(expected))
    if missing or extra:
        name = (missing or extra)[0][6:]
        raise PretrainedError(f"{weights}: does not fit config.json: {'no tensor' if missing else 'an extra tensor'} "
                              f"{name} ({len(missing)} missing, {len(extra)} extra)")
    for name, want in expected.items():
        got = given[name]
        if got.dtype not in FLOATS:
            raise PretrainedError(f"{weights}: {name[6:]} is {got.dtype}; only float32, float16 and bfloat16 "
                                  "weights are imported")
        if got.shape != want.shape:
            raise PretrainedError(f"{weights}: {name[6:]} is {tuple(got.shape)}, config.json makes it {tuple(want.shape)}")
        given[name] = got.to(torch.float32)
    module.load_state_dict(given, strict=True)


def export_pretrained(data: bytes, directory: Path) -> Path:
    """Write the hf model in ``data`` (a p2ptrain model file) as a ``save_pretrained`` directory at
    ``directory``, which must not exist yet; it appears whole or not at all."""
    from p2ptrain.training._loading import model_from_bytes

    directory = Path(directory)
    if directory.exists():
        raise PretrainedError(f"{directory}: exists; export writes a new directory")
    if len(data) > MAX_MODEL_FILE_BYTES:
        raise PretrainedError(f"model file of {len(data):,} B is over the {MAX_MODEL_FILE_BYTES:,} B limit")
    card = read_model_card(data)
    if card is None or card["name"] != HF_MODEL:
        name = "no architecture" if card is None else f"a {card['name']!r} model"
        raise PretrainedError(f"export writes Hugging Face directories of hf models; this file is {name} "
                              "(p2ptrain model fetch writes its safetensors file)")
    module = model_from_bytes(data)
    assert isinstance(module, CausalLM)
    tmp = directory.with_name(f".{directory.name}.{secrets.token_hex(6)}.tmp")
    try:
        hf_model: Any = module.model  # a transformers PreTrainedModel
        with _no_progress_bars():
            hf_model.save_pretrained(tmp)
        for name in os.listdir(tmp):
            with (tmp / name).open("rb") as f:
                os.fsync(f.fileno())
        os.rename(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


@contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' own progress bars off while it writes (its "Writing model shards" tqdm bar on
    stderr, before ``model export``'s one line); its warnings and errors still show. They are as
    they were afterwards, for a caller of :func:`export_pretrained` that wants them elsewhere."""
    from transformers.utils import logging as typed_logging

    hf_logging: Any = typed_logging  # its switches carry no annotations
    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def config_snippet(card: dict[str, Any], cid: str) -> str:
    """The task TOML that fine-tunes an imported model: its ``[model]`` and ``initial_model``."""
    config = ", ".join(f"{k} = {json.dumps(v)}" for k, v in card["kwargs"].items())
    return f'initial_model = "{cid}"\n\n[model]\nname = "{HF_MODEL}"\nconfig = {{ {config} }}\n'
