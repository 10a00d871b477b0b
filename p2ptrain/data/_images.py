"""An image folder (``root/CLASS/*.png|jpg``) as a dataset: uint8 pixels of one size, labels from
the folder names.

Each file is opened lazily (Pillow reads only the header) and refused before any pixel is decoded
if it is over :data:`MAX_IMAGE_FILE_BYTES`, not PNG or JPEG, or claims more than
:data:`MAX_IMAGE_PIXELS` pixels (a 50,000 x 50,000 PNG of a few hundred bytes would otherwise ask for
7.5 GB); then it is decoded, converted to RGB (grayscale stays one channel when every image is),
scaled to cover the target size and centre-cropped (``ImageOps.fit``) into one preallocated array,
on one thread per core. That array is memory-mapped from an unlinked temporary file, so a folder
larger than memory can be added; nothing is stored before every file is decoded.

Classes are the subfolders that hold images, in sorted order (label ``i`` is ``classes[i]``), and
files are read in sorted order, so the same folder gives the same shards. The pixels depend on
Pillow's decoders and resampling: pin Pillow where CIDs must match across machines.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from p2ptrain.data._manifest import MAX_CLASS_NAME, MAX_CLASSES, MAX_SAMPLE_ELEMENTS
from p2ptrain.data._source import Source, dataset_name, need
from p2ptrain.base import ArgumentError, UserError

SUFFIXES = frozenset({".png", ".jpg", ".jpeg"})
FORMATS = ("PNG", "JPEG")
# One image file: a 48-megapixel JPEG is ~20 MB, a PNG of it ~100 MB; 256 MiB leaves room.
MAX_IMAGE_FILE_BYTES = 256 * 1024 * 1024
# Pixels one header may claim (checked before decoding): 2**26 is an 8192 x 8192 image, above any
# camera's; its RGB decode is 200 MB. Pillow's own check (2 x 89M pixels) comes later and higher.
MAX_IMAGE_PIXELS = 1 << 26
# Images in one dataset: ImageNet-1k has 1.28M; the labels array and file list stay small.
MAX_IMAGES = 1 << 24


class ImageError(UserError, ValueError):
    """An image folder or file that is over the bounds or not a PNG/JPEG image we can read."""


# Files handed to the decoding threads at a time.
THREAD_BATCH = 256
T = TypeVar("T")
# Modes that are already one channel: such images stay grayscale if every image is one.
_GRAY = frozenset({"1", "L", "LA", "I", "I;16", "I;16L", "I;16B", "F"})


def is_image_folder(folder: Path) -> bool:
    """A folder whose subfolders hold PNG/JPEG files (and which holds no array files itself)."""
    if any(folder.glob("*.npy")) or any(folder.glob("*.npz")) or any(folder.glob("*.csv")):
        return False
    return any(_images(sub) for sub in _subfolders(folder))


def parse_size(text: str) -> tuple[int, int]:
    """``--image-size`` (``image_size=``): ``N`` (square) or ``WIDTHxHEIGHT``, each 1-4096."""
    parts = text.lower().split("x")
    try:
        width, height = (int(parts[0]), int(parts[0])) if len(parts) == 1 else (int(parts[0]), int(parts[1]))
    except ValueError:
        raise ArgumentError("{image_size:{text}}: give N or WIDTHxHEIGHT, e.g. 32 or 64x48", text=text) from None
    if len(parts) > 2 or not (1 <= width <= 4096 and 1 <= height <= 4096):
        raise ArgumentError("{image_size:{text}}: give N or WIDTHxHEIGHT, each from 1 to 4096", text=text)
    return width, height


def read_image_folder(
    root: Path, size: tuple[int, int] | None = None, progress: Callable[[int], None] | None = None
) -> Source:
    """The folder as uint8 ``(N, C, H, W)`` features and int64 labels (``size`` is width, height;
    ``None``: the first image's size, which every image must then have)."""
    image = need("PIL.Image", "reading an image folder")
    ops = need("PIL.ImageOps", "reading an image folder")
    classes, files = _listing(root)
    same = size is None
    if size is None:
        with _opened(image, files[0][1]) as first:
            size = first.size
    width, height = size
    if 3 * width * height > MAX_SAMPLE_ELEMENTS:
        raise ImageError(f"3x{height}x{width} pixels per image are over {MAX_SAMPLE_ELEMENTS}")
    features = _scratch((len(files), 3, height, width))
    gray = np.asarray(_in_threads(lambda i: _decode(image, ops, files[i][1], size, same, features[i]), len(files),
                                  progress))
    if gray.all():
        features = features[:, :1]
    else:
        for i in np.nonzero(gray)[0]:  # a grayscale image among colour ones: the same value in R, G and B
            features[i, 1:] = features[i, :1]
    labels = np.fromiter((label for label, _ in files), dtype=np.int64, count=len(files))
    return Source(dataset_name(root.resolve().name), features, labels, classes, images=True)


def _subfolders(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _images(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir()
                  if p.suffix.lower() in SUFFIXES and not p.name.startswith(".") and p.is_file())


def _listing(root: Path) -> tuple[tuple[str, ...], list[tuple[int, Path]]]:
    classes: list[str] = []
    files: list[tuple[int, Path]] = []
    for sub in _subfolders(root):
        found = _images(sub)
        if not found:
            continue
        name = sub.name
        if len(name) > MAX_CLASS_NAME or not _printable_utf8(name):
            raise ImageError(f"{sub}: a class folder's name must be at most {MAX_CLASS_NAME} printable UTF-8 "
                             "characters")
        files.extend((len(classes), path) for path in found)
        classes.append(name)
        if len(classes) > MAX_CLASSES or len(files) > MAX_IMAGES:
            raise ImageError(f"{root}: over {MAX_CLASSES} classes or {MAX_IMAGES} images")
    if not files:
        raise ImageError(f"{root}: no class folders with .png/.jpg files (root/CLASS/IMAGE.png)")
    return tuple(classes), files


def _printable_utf8(name: str) -> bool:
    try:
        name.encode("utf-8")  # a file name that is not UTF-8 comes back with surrogates
    except UnicodeEncodeError:
        return False
    return name.isprintable()


def _in_threads(work: Callable[[int], T], count: int, progress: Callable[[int], None] | None = None) -> list[T]:
    """``[work(0), ..., work(count - 1)]`` on one thread per core (Pillow decodes and resizes without
    the GIL), a batch at a time so a million files never make a million futures. The first failure
    in file order is the one raised, whatever the threads' timing."""
    results: list[T] = []
    with ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="images") as pool:
        for start in range(0, count, THREAD_BATCH):
            results.extend(pool.map(work, range(start, min(start + THREAD_BATCH, count))))
            if progress is not None:
                progress(min(THREAD_BATCH, count - start))
    return results


@contextmanager
def _opened(image: Any, path: Path) -> Iterator[Any]:
    """``Image.open`` of one file within the bounds; any failure, of opening or of what the caller
    does with the image, is one line naming the file. Pillow's decoders raise many types for bad
    bytes (OSError, SyntaxError, struct.error, ValueError, IndexError, its DecompressionBombError),
    so everything but our own errors is caught here, at the one boundary."""
    try:
        size = path.stat().st_size
        if size > MAX_IMAGE_FILE_BYTES:
            raise ImageError(f"{path}: {size} B is over the {MAX_IMAGE_FILE_BYTES} B limit of an image file")
        with warnings.catch_warnings():
            warnings.simplefilter("error", image.DecompressionBombWarning)
            with image.open(path, formats=FORMATS) as im:
                width, height = im.size
                if width * height > MAX_IMAGE_PIXELS:
                    raise ImageError(f"{path}: its header claims {width}x{height} pixels, over the limit of "
                                    f"{MAX_IMAGE_PIXELS}")
                yield im
    except (ImageError, ArgumentError):
        raise
    except (image.DecompressionBombError, image.DecompressionBombWarning) as exc:  # Pillow's check, in open()
        raise ImageError(f"{path}: its header claims more pixels than the limit of {MAX_IMAGE_PIXELS} "
                         f"({str(exc).split(',')[0]})") from None
    except Exception as exc:  # (see the docstring)
        raise ImageError(f"{path}: not a PNG or JPEG image we can read ({type(exc).__name__}: {exc})") from None


def _decode(image: Any, ops: Any, path: Path, size: tuple[int, int], same: bool, out: np.ndarray) -> bool:
    """Decode one image into ``out`` (uint8 ``(3, H, W)``): converted to RGB, or to grayscale into
    channel 0 (then True is returned), scaled to cover ``size`` and centre-cropped to it; ``same``:
    it must have that size already. A JPEG is decoded at the smallest of 1/8, 1/4, 1/2, 1 scale that
    still covers ``size`` (``draft``): the same pixels on every run, for a fraction of the work."""
    with _opened(image, path) as im:
        if same and im.size != size:
            raise ArgumentError("{path}: images differ in size ({a[0]}x{a[1]}, {b[0]}x{b[1]}, ...): give {image_size}",
                                path=path, a=size, b=im.size)
        gray = im.mode in _GRAY
        mode = "L" if gray else "RGB"
        if im.format == "JPEG":
            im.draft(mode, size)
        im = im.convert(mode)
        if im.size != size:
            im = ops.fit(im, size, method=image.Resampling.BILINEAR)
        pixels = np.asarray(im, dtype=np.uint8)
    if gray:
        out[0] = pixels
    else:
        out[:] = pixels.transpose(2, 0, 1)
    return gray


def _scratch(shape: tuple[int, ...]) -> np.ndarray:
    """A zeroed uint8 array backed by an unlinked temporary file: the decoded images can be larger
    than memory, and nothing is left on disk whatever happens to the process."""
    with tempfile.TemporaryFile(prefix="p2ptrain-images-") as f:
        return np.memmap(f, dtype=np.uint8, mode="w+", shape=shape)
