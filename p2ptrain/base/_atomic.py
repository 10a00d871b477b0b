"""Write a file so that readers see the old one or the new one, never half of one.

Used by every layer that persists state (block store, pins, node config, task chains), so it sits
below all of them and imports nothing of ours.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Temporary file in the same directory (unique name, so threads and processes never share one),
    every byte written, fsync, rename over ``path``; the temporary file is removed on failure."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
