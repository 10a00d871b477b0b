"""Input scaling stored in the manifest and applied by every reader of the dataset: per-feature
standardization (``dataset add --standardize``) and per-channel pixel normalization (image folders,
``--normalize``).

Why: raw tabular features on scales of 1 to 1000 (sklearn's breast_cancer, a CSV export) start a
network at losses of 25-72 and end it several points of accuracy short of the same data scaled to
mean 0 and std 1 (see docs/content.md). Storing the statistics in the manifest (not scaling the
shards) keeps the raw data as published (images stay uint8: a quarter of float32's bytes on the
wire), and gives training and ``model eval`` the same transform because both read through
:class:`~p2ptrain.data.IPFSDataset`.
"""

from __future__ import annotations

import numpy as np

from p2ptrain.data._manifest import Pixels, Standardize

# Digits kept of each statistic: float32 features carry about 7, and shorter numbers keep the
# manifest small; the same arrays give the same digits, so the manifest CID stays deterministic.
DIGITS = 7
# Samples summed at once for pixel statistics: bounds the float64 copy (4,096 3x224x224 images are
# 4.9 GB as float64; at 64x64 pixels 400 MB).
PIXEL_CHUNK = 1024


def compute(train_features: np.ndarray) -> Standardize:
    """Mean and (population) std of each feature over the train split's samples (axis 0)."""
    flat = np.asarray(train_features, dtype=np.float64).reshape(len(train_features), -1)
    return Standardize(_rounded(flat.mean(axis=0)), _rounded(flat.std(axis=0)))


def _rounded(values: np.ndarray) -> tuple[float, ...]:
    return tuple(float(f"{v:.{DIGITS}g}") for v in values)


def apply(features: np.ndarray, stats: Standardize) -> np.ndarray:
    """``(x - mean) / std`` per feature, as float32; a feature with std 0 (constant in the train
    split) is only centred, not divided by zero."""
    shape = features.shape
    mean = np.asarray(stats.mean, dtype=np.float32)
    std = np.asarray(stats.std, dtype=np.float32)
    std = np.where(std > 0, std, np.float32(1.0))
    flat = features.reshape(len(features), -1).astype(np.float32)
    return ((flat - mean) / std).reshape(shape)


def pixel_stats(images: np.ndarray, indices: np.ndarray) -> Pixels:
    """Per-channel mean and std of ``images[indices] / 255`` (uint8, ``(N, C, H, W)``), summed in
    chunks so a large (memory-mapped) image set is never copied whole. A channel that is constant
    gets std 1 (the manifest needs std > 0)."""
    channels = images.shape[1]
    total = np.zeros(channels)
    squares = np.zeros(channels)
    for start in range(0, len(indices), PIXEL_CHUNK):
        chunk = images[np.sort(indices[start:start + PIXEL_CHUNK])].astype(np.float64) / 255.0
        total += chunk.sum(axis=(0, 2, 3))
        squares += np.square(chunk).sum(axis=(0, 2, 3))
    count = len(indices) * images.shape[2] * images.shape[3]
    mean = total / count
    std = np.sqrt(np.maximum(squares / count - np.square(mean), 0.0))
    std = np.where(std > 1e-6, std, 1.0)
    return Pixels(_rounded(mean), _rounded(std))


def apply_pixels(images: np.ndarray, pixels: Pixels) -> np.ndarray:
    """uint8 ``(N, C, H, W)`` to float32 ``(x / 255 - mean[c]) / std[c]``, computed as one multiply
    and one add in place (``x * scale + shift``: two passes over the floats instead of four)."""
    std = np.asarray(pixels.std, dtype=np.float64)
    scale = (1 / (255 * std)).astype(np.float32).reshape(1, -1, 1, 1)
    shift = (-np.asarray(pixels.mean, dtype=np.float64) / std).astype(np.float32).reshape(1, -1, 1, 1)
    out = images.astype(np.float32)
    out *= scale
    out += shift
    return out
