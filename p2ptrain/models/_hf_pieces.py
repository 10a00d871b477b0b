"""A Hugging Face causal LM (``[model] name = "hf"``) as a sequence of pieces, for pipeline stages.

A pipelined run cuts its model into pieces applied one after the other (models/_pieces.py). An
``hf`` model's ``forward`` is the installed ``transformers``' code, which nobody traces; but the
decoder-only families below are, in that code, exactly an embedding, a loop over decoder layers
each given the same causal mask (and, for the rotary families, the same position embeddings), and a
final norm with the head. Each piece here makes that same call with what ``forward`` would have
passed: the mask and the rotary cosines are rebuilt inside each layer's piece from the activation's
length, with the functions ``forward`` itself calls, so no mask crosses a boundary and the composed
pieces compute the bits the whole model computes (tests/models/test_hf_pieces.py compares them for
each family, so a ``transformers`` release that changes a ``forward`` fails there, not in a run).

Supported: ``gpt2`` (learned positions) and the rotary families ``llama``, ``mistral``, ``qwen2``
and ``qwen3``. Any other ``model_type`` is refused with a :class:`PartitionError` naming these.
Also refused: a model that drops out anything (a replica's second opinion compares outputs bit for
bit, and a dropped-out activation is a draw of the replica's own generator), which GPT-2's config
does by default (``resid_pdrop``, ``embd_pdrop``, ``attn_pdrop``: set them to 0).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from p2ptrain.models._hf import CausalLM
from p2ptrain.models._pieces import PartitionError, Piece

ROTARY_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
CUTTABLE = ("gpt2", *ROTARY_FAMILIES)


def hf_pieces(model: CausalLM) -> list[Piece]:
    """``model``'s pieces, named as in ``model.state_dict()``; :class:`PartitionError` saying why
    it cannot be cut (another family, or dropout)."""
    config = model.config
    kind = getattr(config, "model_type", None)
    if kind not in CUTTABLE:
        raise PartitionError(f"an hf model of model_type {kind!r} cannot be cut into stages: only "
                             f"{', '.join(CUTTABLE)} can (each family's layer call is checked against its forward)")
    dropped = _dropout(model)
    if dropped is not None:
        raise PartitionError(f"{dropped} drops out activations: a pipelined run's replicas must compute the same "
                             "bits (set the config's dropout settings to 0, e.g. resid_pdrop, embd_pdrop, attn_pdrop)")
    lm: Any = model.model  # transformers' classes, untyped here: the attributes of each family's own
    if kind == "gpt2":
        base = lm.transformer
        context = int(config.n_positions)
        return [
            _GPT2Embed({"model.transformer.wte": base.wte, "model.transformer.wpe": base.wpe}, context),
            *(_GPT2Block({f"model.transformer.h.{i}": block}, config, context) for i, block in enumerate(base.h)),
            Piece({"model.transformer.ln_f": base.ln_f, "model.lm_head": lm.lm_head}),
        ]
    base = lm.model
    context = int(config.max_position_embeddings)
    layer_types = getattr(config, "layer_types", None) if kind in ("qwen2", "qwen3") else None
    pieces: list[Piece] = [_Embed({"model.model.embed_tokens": base.embed_tokens}, context)]
    for i, layer in enumerate(base.layers):
        sliding = (layer_types[i] == "sliding_attention" if layer_types is not None
                   else kind == "mistral" and config.sliding_window is not None)
        pieces.append(_RotaryLayer({f"model.model.layers.{i}": layer}, config, context, type(base.rotary_emb), sliding))
    pieces.append(Piece({"model.model.norm": base.norm, "model.lm_head": lm.lm_head}))
    return pieces


def _dropout(model: nn.Module) -> str | None:
    """The first submodule that drops anything out in training, as ``name (p)``; None if none."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout) and module.p > 0:
            return f"{name} (p = {module.p})"
        rate = getattr(module, "attention_dropout", 0.0)
        if isinstance(rate, float) and rate > 0:
            return f"{name}.attention_dropout ({rate})"
    return None


def _context_check(t: int, context: int, what: str) -> None:
    # A replica builds a t x t mask from what a peer sent: a t that only the frame limits bound
    # would take gigabytes from one frame, so a sequence longer than the model's context is refused
    # (the registry's transformer_lm has the same rule).
    if t > context:
        raise ValueError(f"{what} of {t} positions is longer than the model's context {context}")


def _positions(h: torch.Tensor) -> torch.Tensor:
    return torch.arange(h.shape[1], device=h.device).unsqueeze(0)


def _mask_positions(h: torch.Tensor) -> torch.Tensor:
    """The positions the mask functions read: on the CPU when ``h`` is on the meta device (a driver
    computes the shape a stage answers there, ``pipeline.output_shape``), since transformers reads
    their values to detect packed sequences, which a meta tensor does not have."""
    return torch.arange(h.shape[1]).unsqueeze(0) if h.is_meta else _positions(h)


def _mask(name: str) -> Callable[..., Any]:
    from transformers import masking_utils

    function: Callable[..., Any] = getattr(masking_utils, name)
    return function


class _Embed(Piece):
    """``embed_tokens(ids)``, as a rotary family's forward begins."""

    def __init__(self, owned: dict[str, nn.Module], context: int) -> None:
        super().__init__(owned)
        self.context = context

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _context_check(x.shape[1], self.context, "sequence")
        out: torch.Tensor = self.parts[0](x.long())  # token shards store uint8/uint16 ids
        return out


class _GPT2Embed(_Embed):
    """``wte(ids) + wpe(positions)``, as GPT2Model.forward begins (its dropout is refused)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _context_check(x.shape[1], self.context, "sequence")
        wte, wpe = self.parts
        out: torch.Tensor = wte(x.long()) + wpe(_positions(x))
        return out


class _GPT2Block(Piece):
    """One GPT2Block, called with the causal mask GPT2Model.forward makes for this length."""

    def __init__(self, owned: dict[str, nn.Module], config: Any, context: int) -> None:
        super().__init__(owned)
        self.config, self.context = config, context
        self.mask_function = _mask("create_causal_mask")

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        _context_check(h.shape[1], self.context, "activation")
        positions = _positions(h)
        mask = self.mask_function(config=self.config, inputs_embeds=h, attention_mask=None, cache=None,
                                  position_ids=_mask_positions(h))
        out: torch.Tensor = self.parts[0](h, None, mask, None, encoder_attention_mask=None, use_cache=False,
                                          position_ids=positions)
        return out


class _RotaryLayer(Piece):
    """One decoder layer of a rotary family, given the mask and the rotary cosines and sines the
    model's forward makes for this length."""

    def __init__(self, owned: dict[str, nn.Module], config: Any, context: int, rotary_class: type[nn.Module],
                 sliding: bool) -> None:
        super().__init__(owned)
        self.config, self.context = config, context
        self.mask_function = _mask("create_sliding_window_causal_mask" if sliding else "create_causal_mask")
        # Its own rotary module on the CPU, held in a tuple so that it is no submodule: a pipelined
        # member frees a stage's tensors (to the meta device) and allocates them again, and the
        # non-persistent inv_freq buffer would come back uninitialised (the model's own rotary
        # module is on meta already when the model was built there).
        with torch.device("cpu"):
            self._rotary = (rotary_class(config=config),)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        _context_check(h.shape[1], self.context, "activation")
        positions = _positions(h)
        mask = self.mask_function(config=self.config, inputs_embeds=h, attention_mask=None, cache=None,
                                  position_ids=_mask_positions(h))
        cos_sin = self._rotary[0](h, position_ids=positions)
        out: torch.Tensor = self.parts[0](h, attention_mask=mask, position_embeddings=cos_sin,
                                          position_ids=positions, cache=None, use_cache=False)
        return out
