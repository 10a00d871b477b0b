"""Whether a data set's samples fit a model of the registry: one forward pass on the meta device.

A task names its model and its data set apart, and nothing but a forward pass says whether one
fits the other (an ``mlp``'s ``in_features`` against the samples' width, a ``transformer_lm``'s
``context`` against the windows' length). Without this check each member found out inside its
first step, as an internal error of the run. On the meta device the pass allocates nothing and
computes nothing, so it costs milliseconds whatever the model's size.

Only the builders this package ships are checked: an installed package's model may use operations
the meta device does not implement, and a check that could refuse a task that trains would be
worse than none. Their inputs are what the data loader gives them: token ids (int64) for the
language model, float32 for the others (pixels are scaled to float32 as they are read).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from p2ptrain.models._registry import meta_model

CHECKED_BUILDERS = frozenset({"mlp", "cnn", "transformer_lm"})
_TOKEN_INPUTS = frozenset({"transformer_lm"})


def input_problem(name: str, kwargs: dict[str, Any], sample_shape: Sequence[int]) -> str | None:
    """Why samples of ``sample_shape`` cannot go through model ``name`` built from ``kwargs``, in
    one line; None when they can, or when ``name`` is not one of :data:`CHECKED_BUILDERS`."""
    if name not in CHECKED_BUILDERS:
        return None
    width = math.prod(sample_shape)
    if name == "mlp" and kwargs.get("in_features", width) != width:
        # The forward pass's own words ("a and b must have same reduction dim...") name no setting.
        return (f"samples of shape {tuple(sample_shape)} do not fit model mlp: it takes in_features = "
                f"{kwargs['in_features']} values a sample, these have {width} (set in_features = {width})")
    dtype = torch.int64 if name in _TOKEN_INPUTS else torch.float32
    model = meta_model(name, kwargs)
    try:
        with torch.no_grad():
            model(torch.empty((1, *sample_shape), dtype=dtype, device="meta"))
    except NotImplementedError:
        return None  # the meta device cannot tell
    except (ValueError, RuntimeError, IndexError, TypeError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        shape = getattr(model, "shape", None)
        if name == "cnn" and len(sample_shape) == 3 and sample_shape[1] == sample_shape[2] and shape is not None:
            # torch's words ("shape '[1, 3, 8, 8]' is invalid for input of size 768") name no setting.
            return (f"samples of shape {tuple(sample_shape)} do not fit model cnn: it takes {shape[0]} channel(s) of "
                    f"{shape[1]}x{shape[2]} pixels (set in_channels = {sample_shape[0]}, image_size = {sample_shape[1]})")
        return f"samples of shape {tuple(sample_shape)} do not fit model {name}: {first_line}"
    return None
