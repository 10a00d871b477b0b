"""Hugging Face architectures by config: ``[model] name = "hf"`` builds any causal language model of
the installed ``transformers`` from a config table, with code of this machine only.

The task carries the config (``model_type`` and its settings), never code or weights by name:
``AutoConfig.for_model`` and ``AutoModelForCausalLM.from_config`` build it, ``trust_remote_code`` is
never passed, and the Hub is switched off (``HF_HUB_OFFLINE``) before ``transformers`` is imported,
so nothing is downloaded. A config arrives from the network, so :func:`check_hf_config` bounds it: at
most :data:`MAX_SETTINGS` settings, each a scalar or a short flat list, each one the architecture
declares (a typo is an error, not a silently ignored attribute), none that selects code, files,
dtypes or kernels (:data:`HF_REFUSED`).

:class:`CausalLM` wraps the model so that it takes token ids and returns logits ``(N, T, vocab)``, as
the registry's language model does. A model whose head is tied to its embedding (GPT-2's ``lm_head``
is ``wte``) holds one tensor under two names; safetensors stores each tensor once, so the wrapper's
state dict lists each tensor once (the first name, as ``save_pretrained`` does) and loading re-fills
the other name from it: model bytes stay deterministic and the tie survives a save and a load.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import torch
from torch import nn

from p2ptrain.models._model_error import MissingBuilder, ModelError

HF_MODEL = "hf"
INSTALL_HINT = "pip install 'p2ptrain[hf]'"
MAX_SETTINGS = 64
MAX_STRING = 64
MAX_LIST = 16
_KEY = re.compile(r"[a-z][a-z0-9_]{0,63}")
# Integers are bounded before anything is built: the parameter cap is counted on the meta device,
# but building makes Python modules per layer and per expert (~10-40 ms a GPT-2 layer on a loaded
# core), so a count of 10**9 would hang the count itself. Layer, block and expert counts (by name)
# at most MAX_COUNT each and MAX_MODULES multiplied; heads at most MAX_HEADS; any other integer at
# most MAX_INT (vocabularies and position limits are far below).
MAX_COUNT = 256
MAX_MODULES = 2048
MAX_HEADS = 1024
MAX_INT = 1 << 24
_MODULES = re.compile(r"(layer|block|expert)s?$|layers_|blocks_")
_HEADS = re.compile(r"heads?$")
# Settings a config may not carry, though a config class may list some: they name code
# (auto_map), files or Hub repositories (name_or_path), another dtype than the fp32 every member
# trains in, kernels fetched by name (attn_implementation), or change what forward returns.
HF_REFUSED = frozenset({
    "trust_remote_code", "auto_map", "name_or_path", "architectures", "transformers_version", "dtype",
    "torch_dtype", "quantization_config", "attn_implementation", "experts_implementation", "return_dict",
    "id2label", "label2id", "revision", "token", "cache_dir", "device_map",
})


def transformers_installed() -> bool:
    """Whether ``transformers`` can be imported here (found, not imported: it takes seconds)."""
    return importlib.util.find_spec("transformers") is not None


def import_transformers() -> ModuleType:
    """The installed ``transformers``, imported with the Hub switched off; a one-line
    :class:`ModelError` saying how to install it when it is missing."""
    os.environ["HF_HUB_OFFLINE"] = "1"  # no download, ever: from_config needs nothing from the Hub
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    try:
        import transformers as tf
    except ImportError:
        raise MissingBuilder(HF_MODEL, f"hf models need the transformers package: {INSTALL_HINT}") from None
    return tf


def _causal_types() -> Mapping[str, str]:
    import_transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def _config_class(model_type: Any) -> Any:
    if not isinstance(model_type, str) or not _KEY.fullmatch(model_type):
        raise ModelError("model.config.model_type: must name an architecture of transformers (e.g. \"gpt2\")")
    causal = _causal_types()
    if model_type not in causal:
        known = ", ".join(t for t in ("gpt2", "llama", "mistral", "qwen2", "gpt_neox") if t in causal)
        raise ModelError(f"model.config.model_type: {model_type!r} is not a causal language model of the installed "
                         f"transformers (e.g. {known})")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]


def _check_value(value: Any, where: str, in_list: bool = False) -> Any:
    if type(value) is bool:
        return value
    if type(value) is int:
        name = where.rsplit(".", 1)[-1].split("[")[0]
        limit = MAX_COUNT if _MODULES.search(name) else MAX_HEADS if _HEADS.search(name) else MAX_INT
        if abs(value) > limit:
            raise ModelError(f"{where}: at most {limit:,}")
        return value
    if type(value) is float:
        if not math.isfinite(value):
            raise ModelError(f"{where}: must be a finite number")
        return value
    if type(value) is str:
        if len(value) > MAX_STRING:
            raise ModelError(f"{where}: a string of at most {MAX_STRING} characters")
        return value
    if not in_list and isinstance(value, (list, tuple)) and len(value) <= MAX_LIST:
        return [_check_value(v, f"{where}[{i}]", in_list=True) for i, v in enumerate(value)]
    raise ModelError(f"{where}: must be a number, boolean, short string or a flat list of at most {MAX_LIST} of them")


def hf_settings(config_class: Any) -> set[str]:
    """The settings an architecture declares: its default config's attributes and their aliases."""
    return (set(config_class().to_dict()) | set(getattr(config_class, "attribute_map", {}))) - HF_REFUSED


def check_hf_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A hostile config table made safe to build from (sorted), or :class:`ModelError` naming the
    field. The architecture (and its size) is checked by building it on the meta device after."""
    if not isinstance(config, Mapping):
        raise ModelError("model.config: must be a table of settings")
    if len(config) > MAX_SETTINGS:
        raise ModelError(f"model.config: {len(config)} settings, more than {MAX_SETTINGS}")
    for key in config:
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise ModelError(f"model.config.{str(key)[:40]}: a setting is a lower-case name (no leading underscore)")
        if key in HF_REFUSED:
            raise ModelError(f"model.config.{key}: not allowed (a task names an architecture, never code, files or dtypes)")
    cls = _config_class(config.get("model_type"))
    known = hf_settings(cls)
    out: dict[str, Any] = {"model_type": config["model_type"]}
    for key in sorted(config):
        if key == "model_type":
            continue
        if key not in known:
            raise ModelError(f"model.config.{key}: {config['model_type']} has no such setting")
        out[key] = _check_value(config[key], f"model.config.{key}")
    modules = math.prod(v for k, v in out.items() if _MODULES.search(k) and type(v) is int and v > 0)
    if modules > MAX_MODULES:
        raise ModelError(f"model.config: layers x experts is {modules:,}, more than {MAX_MODULES:,}")
    return dict(sorted(out.items()))


def hf_config(config: Mapping[str, Any]) -> Any:
    """The ``transformers`` config object of a checked config."""
    settings = {k: v for k, v in config.items() if k != "model_type"}
    try:
        return import_transformers().AutoConfig.for_model(config["model_type"], **settings)
    except ModelError:
        raise
    except Exception as exc:  # any config transformers refuses, in its own words
        raise ModelError(f"model.config: transformers refuses it: {_line(exc)}") from None


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]


class CausalLM(nn.Module):
    """A ``transformers`` causal LM that takes token ids ``(N, T)`` and returns logits ``(N, T, vocab)``.

    Tied parameters (one tensor, two names) appear once in :meth:`state_dict`, under the first name;
    loading a state dict fills the other names from it, so a model file never holds shared tensors.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.aliases: dict[str, str] = {}  # tied name -> the name its tensor is stored under
        first: dict[int, str] = {}
        for name, param in self.named_parameters(remove_duplicate=False):
            if id(param) in first:
                self.aliases[name] = first[id(param)]
            else:
                first[id(param)] = name
        self.register_state_dict_post_hook(_drop_aliases)  # type: ignore[no-untyped-call]
        self.register_load_state_dict_pre_hook(_fill_aliases)  # type: ignore[no-untyped-call]

    @property
    def config(self) -> Any:
        return self.model.config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.model(input_ids=x.long()).logits  # token shards store uint8/uint16 ids
        return logits


def _drop_aliases(module: nn.Module, state: dict[str, Any], prefix: str, _meta: Any) -> None:
    assert isinstance(module, CausalLM)
    for alias in module.aliases:
        state.pop(prefix + alias, None)


def _fill_aliases(module: nn.Module, state: dict[str, Any], prefix: str, *_rest: Any) -> None:
    assert isinstance(module, CausalLM)
    for alias, source in module.aliases.items():
        if prefix + source in state and prefix + alias not in state:
            state[prefix + alias] = state[prefix + source]


def build(**config: Any) -> nn.Module:
    """The registry's builder: a :class:`CausalLM` of a checked config, in fp32 (on the current
    default device: the registry counts parameters on ``meta``)."""
    tf = import_transformers()
    cfg = hf_config(config)
    try:
        model = tf.AutoModelForCausalLM.from_config(cfg, trust_remote_code=False, dtype=torch.float32)
    except Exception as exc:  # a config that builds no model (heads that do not divide the width, ...)
        raise ModelError(f"model.config: transformers cannot build it: {_line(exc)}") from None
    return CausalLM(model)
