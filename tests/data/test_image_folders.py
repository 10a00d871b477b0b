"""``dataset add`` of an image folder (ROOT/CLASS/*.png|jpg): real PNG and JPEG files written here
from scikit-learn's digits, read back by CID through IPFSDataset; hostile files refused, nothing
stored."""

import json
import struct
import sys
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from sklearn.datasets import load_digits

from p2ptrain.data import IPFSDataset
from p2ptrain.data._images import MAX_IMAGE_PIXELS

COUNT = 300


def write_digits(root: Path, count: int = COUNT) -> None:
    """The first ``count`` digits as 8x8 grayscale images, alternately PNG and JPEG, in ROOT/digitN/."""
    digits = load_digits()
    for i in range(count):
        folder = root / f"digit{digits.target[i]}"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = (digits.images[i] * (255 / 16)).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"{i:04d}.{'png' if i % 2 else 'jpg'}")


def direct(root: Path) -> Counter:
    """(class name, pixel bytes) of every image, read with Pillow alone: what the dataset must hold."""
    return Counter((path.parent.name, np.asarray(Image.open(path).convert("L")).tobytes())
                   for path in sorted(root.glob("*/*")))


def through_ipfs(cid: str, home: Path) -> tuple[Counter, dict]:
    """The same pairs, from every split of the dataset as IPFSDataset yields it (pixels / 255)."""
    manifest = IPFSDataset(cid, home=home).manifest
    pairs = Counter()
    for split in manifest.splits:
        for x, y in IPFSDataset(cid, split=split, home=home):
            pixels = np.rint(x.numpy()[0] * 255).astype(np.uint8)
            pairs[(manifest.classes[int(y)], pixels.tobytes())] += 1
    return pairs, manifest.to_dict()


def test_png_and_jpeg_folder_round_trips_by_cid_to_the_same_pixels(tmp_path, dataset_cli):
    write_digits(tmp_path / "digits")
    code, cid, err = dataset_cli("add", str(tmp_path / "digits"), "--shards", "3", home=tmp_path / "home")
    assert code == 0, err
    pairs, manifest = through_ipfs(cid, tmp_path / "home")
    assert pairs == direct(tmp_path / "digits")
    assert manifest["classes"] == [f"digit{d}" for d in range(10)]
    assert manifest["features"] == {"dtype": "uint8", "shape": [1, 8, 8]}  # stored as pixels, read as floats
    assert manifest["pixels"] == {"mean": [0.0], "std": [1.0]}
    again = dataset_cli("add", str(tmp_path / "digits"), "--shards", "3", home=tmp_path / "other")[1]
    assert again == cid  # the same folder, the same CID


def test_normalize_uses_the_train_split_statistics_or_given_ones(tmp_path, dataset_cli):
    write_digits(tmp_path / "digits")
    home = tmp_path / "home"
    cid = dataset_cli("add", str(tmp_path / "digits"), "--shards", "2", "--normalize", home=home)[1]
    train = np.stack([x.numpy() for x, _ in IPFSDataset(cid, home=home)])
    assert train.dtype == np.float32 and abs(train.mean()) < 1e-4 and abs(train.std() - 1) < 1e-4
    cid = dataset_cli("add", str(tmp_path / "digits"), "--shards", "2", "--normalize", "0.5/0.25", home=home)[1]
    x, _ = next(iter(IPFSDataset(cid, home=home, shuffle=False)))
    raw = np.rint((x.numpy() * 0.25 + 0.5) * 255)
    assert np.allclose((raw / 255 - 0.5) / 0.25, x.numpy(), atol=1e-5) and raw.min() >= 0 and raw.max() <= 255


def test_images_of_different_sizes_and_modes_need_a_size_and_become_rgb(tmp_path, dataset_cli):
    root = tmp_path / "mixed"
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    rng = np.random.default_rng(0)
    for i in range(6):
        Image.fromarray(rng.integers(0, 256, (20 + i, 30), dtype=np.uint8)).save(root / "a" / f"{i}.png")
        Image.fromarray(rng.integers(0, 256, (40, 12, 3), dtype=np.uint8), "RGB").save(root / "b" / f"{i}.jpg")
    code, _, err = dataset_cli("add", str(root), "--shards", "1", home=tmp_path / "h")
    assert code == 1 and "differ in size" in err and "--image-size" in err
    code, cid, err = dataset_cli("add", str(root), "--shards", "2", "--image-size", "16x10", home=tmp_path / "h")
    assert code == 0, err
    x, _ = next(iter(IPFSDataset(cid, home=tmp_path / "h")))
    assert tuple(x.shape) == (3, 10, 16)  # channels, height, width


# --- hostile files -----------------------------------------------------------------------------

def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_claiming(width: int, height: int, rows: int = 1) -> bytes:
    """A grayscale PNG whose header says ``width`` x ``height``, with ``rows`` rows of zeros."""
    compress = zlib.compressobj()
    line = b"\0" * (width + 1)
    body = b"".join(compress.compress(line) for _ in range(rows)) + compress.flush()
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + _chunk(b"IDAT", body) + _chunk(b"IEND", b""))


def jpeg_claiming(width: int, height: int) -> bytes:
    """A real 8x8 JPEG with its frame header's size rewritten."""
    path_bytes = _jpeg_bytes()
    start = path_bytes.index(b"\xff\xc0")
    return path_bytes[:start + 5] + struct.pack(">HH", height, width) + path_bytes[start + 9:]


def _jpeg_bytes(noise: bool = False) -> bytes:
    import io

    out = io.BytesIO()
    pixels = np.random.default_rng(0).integers(0, 256, (8, 8), dtype=np.uint8) if noise else np.zeros((8, 8), np.uint8)
    Image.fromarray(pixels).save(out, "JPEG")
    return out.getvalue()


HOSTILE = [
    ("bomb.png", lambda: png_claiming(50_000, 50_000), "its header claims"),
    # A complete, valid image, refused by our cap alone (Pillow's own check starts at 89M pixels).
    ("big.png", lambda: png_claiming(9000, 9000, rows=9000),
     f"claims 9000x9000 pixels, over the limit of {MAX_IMAGE_PIXELS}"),
    ("bomb.jpg", lambda: jpeg_claiming(50_000, 50_000), "its header claims"),
    ("broken.png", lambda: png_claiming(8, 8)[:33] + _chunk(b"IDAT", b"not zlib") + _chunk(b"IEND", b""),
     "not a PNG or JPEG image we can read"),
    ("cut.jpg", lambda: _jpeg_bytes(noise=True)[:300], "not a PNG or JPEG image we can read"),
    ("gif.png", lambda: b"GIF89a" + bytes(64), "not a PNG or JPEG image we can read"),
]


@pytest.mark.parametrize("name,content,message", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_hostile_image_is_refused_in_one_line_and_nothing_is_written(
        tmp_path, dataset_cli, home_files, name, content, message):
    write_digits(tmp_path / "digits", count=20)
    home = tmp_path / "home"
    assert dataset_cli("add", str(tmp_path / "digits"), "--shards", "2", home=home)[0] == 0
    before = home_files(home)
    (tmp_path / "digits" / "digit0" / name).write_bytes(content())
    code, out, err = dataset_cli("add", str(tmp_path / "digits"), "--shards", "2", home=home)
    assert code == 1 and out == "" and message in err and name in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert home_files(home) == before


def test_without_pillow_the_error_names_the_extra(tmp_path, dataset_cli, monkeypatch, home_files):
    write_digits(tmp_path / "digits", count=20)
    for module in [m for m in sys.modules if m == "PIL" or m.startswith("PIL.")]:
        monkeypatch.setitem(sys.modules, module, None)  # as if Pillow were not installed
    monkeypatch.setitem(sys.modules, "PIL", None)
    code, _, err = dataset_cli("add", str(tmp_path / "digits"), "--shards", "2", home=tmp_path / "home")
    assert code == 1 and "needs Pillow: pip install 'p2ptrain[data]'" in err
    assert home_files(tmp_path / "home") == {}


def test_dataset_info_names_the_classes(tmp_path, dataset_cli):
    write_digits(tmp_path / "digits", count=40)
    cid = dataset_cli("add", str(tmp_path / "digits"), "--shards", "2", home=tmp_path / "h")[1]
    code, out, _ = dataset_cli("info", cid, home=tmp_path / "h")
    assert code == 0 and "classes: 10 (digit0, digit1" in out and "pixels: uint8 images" in out
    assert json.loads(dataset_cli("info", cid, "--json", home=tmp_path / "h")[1])["classes"][0] == "digit0"
