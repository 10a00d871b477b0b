"""What a served model accepts: the shape and dtype of one sample, read from the model's card.

A request's ``inputs`` come from anyone who can reach the port, so they are checked before any
tensor reaches the model: a list of 1 to MAX_INPUTS_PER_REQUEST samples, each exactly the card's
sample shape, numbers of the card's kind (token ids in range). Every way a request can be wrong is
one :class:`InputError`, which the HTTP layer turns into a 4xx naming the reason.

The spec per architecture lives here, beside the server, and not in the model registry: only
serving needs to know what a sample looks like before the model sees it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from p2ptrain.base import UserError, boundedjson
from p2ptrain.models import HF_MODEL, hf_config

# Samples in one request: 1024 digits rows are ~0.5 MB of JSON; a bigger batch is better sent as
# several requests (the server batches them anyway), and one request cannot hold the queue alone.
MAX_INPUTS_PER_REQUEST = 1024
# A request body: 8 MiB holds 1024 samples of 784 floats written with 8 digits each (~7 MB), the
# largest request MAX_INPUTS_PER_REQUEST allows for MNIST-sized inputs. Larger bodies get 413
# before they are read. A model whose samples are smaller takes less (InputSpec.max_body_bytes).
MAX_BODY_BYTES = 8 * 1024 * 1024
# What one number of a sample may take in a request's JSON: a float as Python writes it
# ("-1.2345678901234567e-308", 24 characters), its separator, and the indentation of JSON
# pretty-printed four levels deep; and each sample's brackets, and the document's own.
BODY_BYTES_PER_NUMBER = 40
BODY_BYTES_PER_SAMPLE = 64
BODY_BYTES_SLACK = 1024
# {"inputs": [[[...]]]}: a (C, H, W) sample nests four levels; six refuse any bracket bomb early.
MAX_REQUEST_DEPTH = 6
# Numbers in one answer: 2M floats are ~40 MB of JSON (under the client's 64 MiB read limit). A
# classifier's 1024 samples of 10 logits are far below; a language model answers (T, vocab) logits a
# sample, so 128 sequences of 64 tokens over 256 ids is the most one request may ask.
MAX_OUTPUT_NUMBERS = 2_000_000
# Tokens a request may send an hf model whose config names no position limit (rotary models may).
HF_MAX_LEN = 2048


class InputError(ValueError):
    """A request the model cannot take; the message says why (the HTTP layer answers 4xx with it)."""


@dataclass(frozen=True)
class InputSpec:
    """One sample's accepted shapes and dtype (``long``: token ids below ``vocab``)."""

    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    vocab: int = 0
    max_len: int = 0  # > 0: a variable-length sequence of 1..max_len ids (shapes is unused)
    outputs: int = 0  # numbers answered per sample (classes), or per token (vocab) for sequences

    @property
    def max_body_bytes(self) -> int:
        """The largest body an honest request for this model sends: MAX_INPUTS_PER_REQUEST of the
        largest samples, each number written long (at most MAX_BODY_BYTES). For digits (64
        features) 2.7 MB, not 8 MiB: a body past it is refused before it is read or parsed."""
        numbers = self.max_len or max(math.prod(shape) for shape in self.shapes)
        per_sample = BODY_BYTES_PER_SAMPLE + numbers * BODY_BYTES_PER_NUMBER
        return min(MAX_BODY_BYTES, BODY_BYTES_SLACK + MAX_INPUTS_PER_REQUEST * per_sample)

    def describe(self) -> dict[str, Any]:
        """The spec as JSON, for ``GET /model``."""
        if self.max_len:
            return {"dtype": "int64", "shape": ["T"], "max_len": self.max_len, "vocab": self.vocab}
        return {"dtype": "float32", "shape": list(self.shapes[0]), "also": [list(s) for s in self.shapes[1:]]}

    def check(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (N samples) if every sample fits the spec; else :class:`InputError`."""
        sample = tuple(x.shape[1:])
        if self.max_len:
            if len(sample) != 1 or not 1 <= sample[0] <= self.max_len:
                raise InputError(f"each input must be a list of 1 to {self.max_len} token ids (got shape {list(sample)})")
            if x.numel() and (int(x.min()) < 0 or int(x.max()) >= self.vocab):
                raise InputError(f"token ids must be in [0, {self.vocab})")
        elif sample not in self.shapes:
            want = " or ".join(str(list(s)) for s in self.shapes)
            raise InputError(f"each input must have shape {want} (got {list(sample)})")
        numbers = len(x) * self.outputs * (sample[0] if self.max_len else 1)
        if numbers > MAX_OUTPUT_NUMBERS:
            raise InputError(f"the answer would hold {numbers} numbers, over the {MAX_OUTPUT_NUMBERS} limit: "
                             "send fewer samples a request")
        return x


@dataclass(frozen=True)
class UserModel:
    """A model of the user's own module, served from Python (``p2ptrain.serve(cid, model=instance,
    input_shape=...)``): the instance is the architecture (copied for each model loaded into it), and
    the sample shape is the user's word, since no card can say what the module takes."""

    module: nn.Module
    input_shape: tuple[int, ...]

    def spec(self, module: nn.Module) -> InputSpec:
        """Float samples of ``input_shape``; the numbers answered per sample from one forward pass."""
        if not self.input_shape or any(not isinstance(d, int) or d < 1 for d in self.input_shape):
            raise UserError(f"input_shape must be positive ints (one sample's shape), not {self.input_shape!r}")
        with torch.no_grad():
            out = module.eval()(torch.zeros(1, *self.input_shape))
        return InputSpec((tuple(self.input_shape),), torch.float32, outputs=max(1, out[0].numel()))


def spec_for(card: dict[str, Any]) -> InputSpec:
    """The input spec of the architecture a model card names (ValueError for one serve cannot take)."""
    name, kw = card["name"], card["kwargs"]
    if name == "mlp":
        return InputSpec(((int(kw.get("in_features", 64)),),), torch.float32, outputs=int(kw.get("out_features", 10)))
    if name == "cnn":
        c, s = int(kw.get("in_channels", 1)), int(kw.get("image_size", 8))
        return InputSpec(((c * s * s,), (c, s, s)), torch.float32, outputs=int(kw.get("num_classes", 10)))
    if name == "transformer_lm":
        vocab = int(kw.get("vocab_size", 256))
        return InputSpec((), torch.int64, vocab=vocab, max_len=int(kw.get("context", 64)), outputs=vocab)
    if name == HF_MODEL:  # a causal LM of transformers: its config knows its vocabulary and positions
        config = hf_config(kw)
        vocab = int(config.vocab_size)
        positions = getattr(config, "max_position_embeddings", None)
        return InputSpec((), torch.int64, vocab=vocab, max_len=int(positions or HF_MAX_LEN), outputs=vocab)
    raise ValueError(f"model serve does not know the inputs of a {name!r} model")


def parse_request(body: bytes, spec: InputSpec) -> torch.Tensor:
    """The ``inputs`` of a ``POST /predict`` body as one checked tensor (N, *sample). Up to
    ``spec.max_body_bytes`` of JSON: the server runs it in a worker thread."""
    try:
        doc = boundedjson.loads(body, max_bytes=spec.max_body_bytes, max_depth=MAX_REQUEST_DEPTH, what="request")
    except boundedjson.JSONBoundsError as exc:
        raise InputError(str(exc)) from None
    if not isinstance(doc, dict) or set(doc) != {"inputs"}:
        raise InputError('the body must be a JSON object {"inputs": [sample, ...]}')
    inputs = doc["inputs"]
    if not isinstance(inputs, list) or not 1 <= len(inputs) <= MAX_INPUTS_PER_REQUEST:
        raise InputError(f"inputs must be a list of 1 to {MAX_INPUTS_PER_REQUEST} samples")
    try:
        x = torch.tensor(inputs, dtype=spec.dtype if spec.dtype.is_floating_point else None)
    except (ValueError, TypeError, RuntimeError, OverflowError):
        raise InputError("inputs must be equally shaped lists of numbers") from None
    if not spec.dtype.is_floating_point and (x.dtype.is_floating_point or x.dtype == torch.bool):
        raise InputError("token ids must be integers")
    return spec.check(x.to(spec.dtype))
