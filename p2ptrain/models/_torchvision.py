"""``torchvision:NAME``: a curated set of torchvision's image classifiers as task builders.

A bundled source of :mod:`p2ptrain.models._plugins` (importing this module imports torchvision; a
node without it reports the builders unavailable, with what to install). Every model is built with
``weights=None``: nothing is downloaded, ever; the initial weights come from the task's seed like
any builder's. ``in_channels`` other than 3 replaces the first convolution (grayscale images);
inputs may be ``(N, C, H, W)`` (what ``IPFSDataset`` yields for an image folder) or flat
``(N, C*H*W)`` of square images, which are reshaped as :class:`~p2ptrain.models._registry.SmallCNN` does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from torch import nn
from torchvision import models as tv  # when this fails, the source is unavailable with its reason

from p2ptrain.models._registry import Arg, Builder, ModelError

# name -> (torchvision constructor, what it is)
MODELS: dict[str, tuple[Callable[..., nn.Module], str]] = {
    "resnet18": (tv.resnet18, "ResNet-18 (11.7M parameters at 1000 classes)"),
    "resnet34": (tv.resnet34, "ResNet-34 (21.8M parameters at 1000 classes)"),
    "resnet50": (tv.resnet50, "ResNet-50 (25.6M parameters at 1000 classes)"),
    "mobilenet_v3_small": (tv.mobilenet_v3_small, "MobileNetV3-Small (2.5M parameters at 1000 classes)"),
    "mobilenet_v3_large": (tv.mobilenet_v3_large, "MobileNetV3-Large (5.5M parameters at 1000 classes)"),
    "efficientnet_b0": (tv.efficientnet_b0, "EfficientNet-B0 (5.3M parameters at 1000 classes)"),
}


def _flat_to_images(in_channels: int) -> Callable[[nn.Module, tuple[Any, ...]], tuple[Any, ...] | None]:
    """A forward pre-hook that reshapes flat square images ``(N, C*S*S)`` to ``(N, C, S, S)`` (a hook,
    not a wrapper module, so the state dict keeps torchvision's names)."""

    def hook(module: nn.Module, inputs: tuple[Any, ...]) -> tuple[Any, ...] | None:
        x = inputs[0]
        if x.dim() != 2:
            return None
        side = math.isqrt(x.shape[1] // in_channels)
        if side * side * in_channels != x.shape[1]:
            raise ValueError(f"flat input of {x.shape[1]} features is not {in_channels} square channels")
        return (x.reshape(x.shape[0], in_channels, side, side), *inputs[1:])

    return hook


def _with_channels(model: nn.Module, in_channels: int) -> None:
    """Replace the first convolution by one that takes ``in_channels`` (same kernel, stride, padding)."""
    for parent in model.modules():
        for child_name, child in parent.named_children():
            if isinstance(child, nn.Conv2d):
                k, st, pad, dil = child.kernel_size, child.stride, child.padding, child.dilation
                conv = nn.Conv2d(in_channels, child.out_channels, (k[0], k[1]), (st[0], st[1]),
                                 pad if isinstance(pad, str) else (pad[0], pad[1]), (dil[0], dil[1]),
                                 bias=child.bias is not None)
                if conv.weight.device.type != "meta":
                    nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")  # as torchvision does
                setattr(parent, child_name, conv)
                return
    raise ModelError("model.kwargs.in_channels: the model has no convolution to adapt")


def _builder(name: str) -> Builder:
    make, doc = MODELS[name]

    def build(num_classes: int, in_channels: int) -> nn.Module:
        model = make(weights=None, num_classes=num_classes)
        if in_channels != 3:
            _with_channels(model, in_channels)
        model.register_forward_pre_hook(_flat_to_images(in_channels))
        return model

    build.__name__ = name
    return Builder(
        f"torchvision:{name}", build,
        {"num_classes": Arg(int, 10, 1, 1 << 16, doc="classes"),
         "in_channels": Arg(int, 3, 1, 16, doc="image channels (1: grayscale; 3: RGB)")},
        f"torchvision {doc}, weights=None (seeded initialisation). Images (N, C, H, W) or flat square.",
    )


BUILDERS = tuple(_builder(name) for name in MODELS)
"""The source's builders (the object p2ptrain's bundled ``torchvision`` entry point names)."""
