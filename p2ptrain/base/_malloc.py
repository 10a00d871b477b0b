"""One malloc arena for the whole process, so a training step does not page-fault its tensors anew.

A node computes in trio's worker threads, and glibc gives a thread that allocates its own arena.
Such an arena hands freed memory back to the kernel far more eagerly than the main one, so the
next step's model-sized tensors (gradients, activations) fault their pages in again. Measured with
the MLP of the training benchmark (4.3M parameters, batch 256, one thread), a step in a worker
thread took 99-101 ms in about half of the runs (+60,000-100,000 page faults), against 91-95 ms in
the main thread; with one arena the worker thread's step took 91-94 ms in every run. The node's
threads rarely allocate at the same moment; the training benchmark's nodes got faster, not slower.

A leaf module (it imports nothing of ours).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_ARENA_MAX = -8  # glibc's mallopt parameter (malloc.h)


def use_one_arena() -> bool:
    """Make every thread allocate from glibc's main arena (``M_ARENA_MAX = 1``).

    Call it before the process starts its worker threads: a thread keeps the arena it first used.
    Returns False where the C library is not glibc (nothing to change there).
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it (musl, macOS: AttributeError)
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok: bool = mallopt(_M_ARENA_MAX, 1) == 1
    if not ok:
        logger.debug("mallopt(M_ARENA_MAX, 1) was refused")
    return ok
