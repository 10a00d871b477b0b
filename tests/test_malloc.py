"""One malloc arena: threads that allocate after use_one_arena() all use glibc's main arena."""

from __future__ import annotations

import ctypes.util
import subprocess
import sys

import pytest

# A child process (arenas are per process, and ours already has threads): optionally limit the
# arenas, let four threads allocate, then count the arenas glibc reports in malloc_info's XML.
CHILD = r"""
import ctypes, ctypes.util, os, sys, tempfile, threading
from p2ptrain.base import use_one_arena

if sys.argv[1] == "one":
    assert use_one_arena()

def work():
    blocks = [ctypes.create_string_buffer(64 * 1024) for _ in range(64)]
    del blocks

threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
path = os.path.join(tempfile.mkdtemp(), "info.xml")
f = libc.fopen(path.encode(), b"w")
libc.malloc_info(0, f)
libc.fclose(f)
print(open(path).read().count("<heap nr="))
"""


def _arenas(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


@pytest.mark.skipif(not hasattr(ctypes.CDLL(ctypes.util.find_library("c")), "gnu_get_libc_version"),
                    reason="glibc only")
def test_threads_share_the_main_arena_after_use_one_arena() -> None:
    assert _arenas("default") > 1  # glibc's default: allocating threads get arenas of their own
    assert _arenas("one") == 1
