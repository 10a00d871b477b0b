"""The registry of model builders a task may name.

A task names a builder and passes keyword arguments; it never carries code. Every argument is checked
against the builder's declared parameters (type and bounds), and the parameter count of the result is
capped before any memory is allocated (the model is first built on the ``meta`` device), so a task
cannot ask a peer for a 100 GB model. Initialisation is seeded from the task's seed, so every member
builds bitwise-identical initial weights without exchanging them.

Models take a batch ``x`` and return logits: ``(N, classes)`` for classifiers and ``(N, T, vocab)``
for the language model (targets ``(N, T)``); the trainer's loss and accuracy handle both shapes.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from p2ptrain.models import _hf
from p2ptrain.models._model_error import ModelError as ModelError

# 50M float32 parameters = 200 MB of weights (about 800 MB with Adam state and gradients).
MAX_PARAMETERS = 50_000_000
# What a safetensors file of tensors may carry beyond their bytes: the 8-byte length, the header's
# JSON (each tensor's name, dtype, shape and offsets: under HEADER_PER_TENSOR bytes with names of at
# most tensorfile.MAX_NAME_LENGTH) and the metadata (the model card, a few hundred bytes; 64 KiB allowed).
HEADER_PER_TENSOR = 512
HEADER_SLACK = 64 * 1024
# Any model file the registry's builders can make: MAX_PARAMETERS float32 values (builders make
# nothing else: no buffers) and a header for up to 2,048 tensors. The bound for reading a model
# whose card is not known before it is read (``model serve``, ``load_model``).
MAX_MODEL_FILE_BYTES = MAX_PARAMETERS * 4 + 2048 * HEADER_PER_TENSOR + HEADER_SLACK


@dataclass(frozen=True)
class Arg:
    """One keyword argument of a builder: its type (int, float, bool, or a list of ints) and bounds."""

    kind: type
    default: Any
    lo: float = 0
    hi: float = math.inf
    max_items: int = 8
    doc: str = ""


@dataclass(frozen=True)
class Builder:
    """A model a task may name: ``fn(**kwargs)`` returns an ``nn.Module`` built from the checked
    ``args`` (no weights downloaded, nothing fetched). The public contract for a package's builders
    (:mod:`p2ptrain.models._plugins`): ``Builder("mypkg:tiny", tiny, {"width": Arg(int, 16, 1, 1024)},
    "what it is")``."""

    name: str
    fn: Callable[..., nn.Module]
    args: dict[str, Arg]
    doc: str
    # Checks the kwargs in place of ``args`` and returns the builder's real call (the hf builder's
    # config table: its settings are the architecture's, not declared here).
    check: Callable[[dict[str, Any]], dict[str, Any]] | None = None


REGISTRY: dict[str, Builder] = {}
"""The built-in builders (this module's, and any p2ptrain module's that calls :func:`register`)."""


def lookup(name: str) -> Builder:
    """The builder a task names: a built-in, else one of an installed package (the one lookup every
    caller uses). Raises ``MissingBuilder`` (a ModelError) saying why this node has none."""
    builder = REGISTRY.get(name)
    if builder is not None:
        return builder
    from p2ptrain.models._plugins import PLUGINS  # it imports this module: the registry comes first

    return PLUGINS.get(name)


def builders() -> dict[str, Builder]:
    """Every builder this node has, built-ins first, then those of installed packages; ``hf`` only
    where ``transformers`` is installed (a node advertises these names, and a peer that chose members
    by them must not pick one that refuses the task)."""
    from p2ptrain.models._plugins import PLUGINS

    have = {name: b for name, b in REGISTRY.items() if name != _hf.HF_MODEL or _hf.transformers_installed()}
    return {**have, **PLUGINS.available()}


def register(name: str, doc: str, **args: Arg) -> Callable[[Callable[..., nn.Module]], Callable[..., nn.Module]]:
    """Register ``fn`` as the builder called ``name`` with declared keyword arguments."""

    def wrap(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        REGISTRY[name] = Builder(name, fn, args, doc)
        return fn

    return wrap


def _check_number(value: Any, kind: type, arg: Arg, where: str) -> Any:
    if kind is bool:
        if type(value) is not bool:
            raise ModelError(f"{where}: must be true or false")
        return value
    if kind is int and type(value) is not int:
        raise ModelError(f"{where}: must be an integer")
    if kind is float and (type(value) not in (int, float) or not math.isfinite(value)):
        raise ModelError(f"{where}: must be a finite number")
    if not arg.lo <= value <= arg.hi:
        raise ModelError(f"{where}: must be between {arg.lo:g} and {arg.hi:g} (got {value})")
    return float(value) if kind is float else value


def check_kwargs(name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Validate a builder's kwargs; return them complete with defaults (the builder's real call)."""
    builder = lookup(name)
    if builder.check is not None:
        return builder.check(kwargs)
    unknown = sorted(set(kwargs) - set(builder.args))
    if unknown:
        raise ModelError(
            f"model.kwargs.{unknown[0]}: {name} takes no such argument "
            f"(it takes: {', '.join(sorted(builder.args))})"
        )
    out: dict[str, Any] = {}
    for key, arg in builder.args.items():
        where = f"model.kwargs.{key}"
        value = kwargs.get(key, arg.default)
        if arg.kind is list:
            if not isinstance(value, (list, tuple)) or not 1 <= len(value) <= arg.max_items:
                raise ModelError(f"{where}: must be a list of 1 to {arg.max_items} integers")
            out[key] = tuple(_check_number(v, int, arg, f"{where}[{i}]") for i, v in enumerate(value))
        else:
            out[key] = _check_number(value, arg.kind, arg, where)
    return out


def _construct(name: str, full: dict[str, Any]) -> nn.Module:
    """Call the builder with checked arguments. A builder may still fail on a combination of them
    (or, from an installed package, in any way it likes): that is a ModelError naming it, never
    another exception escaping a task's parse."""
    try:
        module = lookup(name).fn(**full)
        if not isinstance(module, nn.Module):
            raise TypeError(f"returned {type(module).__name__}, not a torch.nn.Module")
    except ModelError:
        raise
    except Exception as exc:
        raise ModelError(f"model.kwargs: {name} could not be built: {type(exc).__name__}: {exc}"[:500]) from exc
    return module


def meta_model(name: str, kwargs: dict[str, Any]) -> nn.Module:
    """The model built on the meta device from checked arguments: its shapes and structure, nothing
    allocated and nothing initialised (to count it, bound its file, or check where it can be cut)."""
    full = check_kwargs(name, kwargs)
    with torch.device("meta"):
        return _construct(name, full)


def count_parameters(name: str, kwargs: dict[str, Any]) -> int:
    """Parameters of the model, counted on the meta device (no memory allocated)."""
    return sum(p.numel() for p in meta_model(name, kwargs).parameters())


def check_model(name: str, kwargs: dict[str, Any], cap: int = MAX_PARAMETERS) -> int:
    """Validate name and kwargs and the size of the result (at most ``cap`` parameters: a pipelined
    task's own bound is :data:`p2ptrain.models.MAX_PIPELINED_PARAMETERS`, its stages'
    ``MAX_PARAMETERS``); return its parameter count."""
    n = count_parameters(name, kwargs)
    if n > cap:
        raise ModelError(f"model.kwargs: {name} would have {n:,} parameters, over the {cap:,} cap")
    return n


def file_bytes_bound(tensors: Iterable[torch.Tensor]) -> int:
    """The most bytes a safetensors file of ``tensors`` takes: their bytes at their dtypes' sizes,
    plus the header allowance (HEADER_PER_TENSOR each, HEADER_SLACK in all)."""
    return sum(t.numel() * t.element_size() + HEADER_PER_TENSOR for t in tensors) + HEADER_SLACK


def model_file_limit(name: str, kwargs: dict[str, Any]) -> int:
    """The most bytes an honest model file of this architecture takes, from its state dict built on
    the meta device (nothing allocated, no initialisation). A task names the architecture, so this
    bounds what a node fetches and reads of any model the task names (``initial_model``) before a
    byte of it is parsed: a model of 10k parameters is never a 2 GiB download."""
    return file_bytes_bound(meta_model(name, kwargs).state_dict().values())


_SEEDED_BUILD = threading.Lock()
T = TypeVar("T")


def build_model(name: str, kwargs: dict[str, Any], seed: int, cap: int = MAX_PARAMETERS) -> nn.Module:
    """Build a registered model with weights initialised deterministically from ``seed`` (on CPU),
    of at most ``cap`` parameters (:func:`check_model`)."""
    check_model(name, kwargs, cap)
    full = check_kwargs(name, kwargs)
    return seeded_call(lambda: _construct(name, full), seed)[0]


def seeded_call(make: Callable[[], T], start: int | torch.Tensor) -> tuple[T, torch.Tensor]:
    """``make()`` with torch's global generator seeded with ``start`` (a seed, or a state this
    returned), and the generator's state after it: what a builder draws from a seed, in parts."""
    # torch's initialisers draw from its one global generator: two peers of one process (local_peers)
    # building at once from threads interleaved their draws, and members of a run started from
    # different "initial" models (their records then forked). fork_rng alone does not keep other
    # threads out; the lock does.
    with _SEEDED_BUILD, torch.random.fork_rng(devices=[]):
        if isinstance(start, int):
            torch.manual_seed(start)
        else:
            torch.set_rng_state(start)
        out = make()
        return out, torch.get_rng_state()


# --- builders -----------------------------------------------------------------------------------


@register(
    "mlp",
    "Fully connected classifier on flat feature vectors (digits: 64 features, 10 classes).",
    in_features=Arg(int, 64, 1, 1 << 20, doc="input features"),
    hidden=Arg(list, [128], 1, 1 << 16, doc="hidden layer widths"),
    out_features=Arg(int, 10, 1, 1 << 20, doc="classes"),
)
def mlp(in_features: int, hidden: tuple[int, ...], out_features: int) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, out_features))
    return nn.Sequential(*layers)


class SmallCNN(nn.Module):
    """Conv blocks (conv 3x3, ReLU, 2x2 max-pool while the image is large enough) and a linear head.

    Accepts flat inputs too (``(N, C*H*W)``), as tabular image data sets like digits arrive flat.
    """

    def __init__(self, in_channels: int, image_size: int, channels: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.shape = (in_channels, image_size, image_size)
        blocks: list[nn.Module] = []
        size, width = image_size, in_channels
        for c in channels:
            blocks += [nn.Conv2d(width, c, 3, padding=1), nn.ReLU()]
            if size >= 4:
                blocks.append(nn.MaxPool2d(2))
                size //= 2
            width = c
        self.features = nn.Sequential(*blocks)
        self.head = nn.Linear(width * size * size, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], *self.shape)
        out: torch.Tensor = self.head(self.features(x).flatten(1))
        return out


@register(
    "cnn",
    "Small convolutional classifier for square images (digits 8x8, MNIST-like 28x28).",
    in_channels=Arg(int, 1, 1, 16),
    image_size=Arg(int, 8, 4, 256),
    channels=Arg(list, [16, 32], 1, 1024, max_items=6),
    num_classes=Arg(int, 10, 1, 1 << 16),
)
def cnn(in_channels: int, image_size: int, channels: tuple[int, ...], num_classes: int) -> nn.Module:
    return SmallCNN(in_channels, image_size, channels, num_classes)


class TinyLM(nn.Module):
    """A causal transformer language model: token + position embeddings, pre-norm blocks, linear head.

    Input ``(N, T)`` token ids with ``T <= context``; output ``(N, T, vocab_size)`` next-token logits.
    The head is not tied to the embedding so the state dict has no shared tensors (safetensors stores
    each tensor once by name, and deterministic bytes need no aliasing rules).
    """

    def __init__(self, vocab_size: int, context: int, width: int, depth: int, heads: int) -> None:
        super().__init__()
        shape = (vocab_size, context, width, depth, heads)
        self.tokens, self.positions = lm_piece(*shape, 0)
        self.blocks = nn.ModuleList(lm_piece(*shape, i)[0] for i in range(1, depth + 1))
        self.norm, self.head = lm_piece(*shape, depth + 1)
        self.context = context

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        if t > self.context:
            raise ValueError(f"sequence of {t} tokens is longer than the model's context {self.context}")
        pos = torch.arange(t, device=x.device)
        h = self.tokens(x.long()) + self.positions(pos)  # byte datasets store uint8 tokens
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=x.device, dtype=h.dtype)
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        out: torch.Tensor = self.head(self.norm(h))
        return out


def lm_piece(vocab_size: int, context: int, width: int, depth: int, heads: int, index: int) -> list[nn.Module]:
    """The modules of :class:`TinyLM`'s piece ``index``, constructed (and so initialised from torch's
    generator) as its constructor makes them: 0 the token and position embeddings, 1 to ``depth`` a
    block, ``depth + 1`` the final norm and the head. Constructing pieces 0 to ``depth + 1`` in order
    draws what one TinyLM draws, so a pipelined member can build the initial bits of one piece at a
    time (:class:`p2ptrain.models.InitialPieces`) and never hold the whole model."""
    if index == 0:
        return [nn.Embedding(vocab_size, width), nn.Embedding(context, width)]
    if index <= depth:
        # One by one (not nn.TransformerEncoder, which deep-copies one layer) so that each block gets
        # its own random initialisation.
        return [nn.TransformerEncoderLayer(width, heads, dim_feedforward=4 * width, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)]
    return [nn.LayerNorm(width), nn.Linear(width, vocab_size)]


@register(
    "transformer_lm",
    "Tiny causal transformer language model over byte/token ids.",
    vocab_size=Arg(int, 256, 2, 1 << 17),
    context=Arg(int, 64, 1, 8192),
    width=Arg(int, 128, 8, 4096),
    depth=Arg(int, 2, 1, 48),
    heads=Arg(int, 4, 1, 64),
)
def transformer_lm(vocab_size: int, context: int, width: int, depth: int, heads: int) -> nn.Module:
    if width % heads:
        raise ModelError(f"model.kwargs.heads: width {width} is not divisible by heads {heads}")
    return TinyLM(vocab_size, context, width, depth, heads)


# transformers is imported only when an hf model is checked or built.
REGISTRY[_hf.HF_MODEL] = Builder(_hf.HF_MODEL, _hf.build, {}, "Any causal LM of the installed transformers, from a config "
                           "table (model.config, not kwargs).", check=_hf.check_hf_config)
