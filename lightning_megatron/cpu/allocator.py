"""Keep freed CPU memory in the process: glibc ``mallopt`` so that steps stop page-faulting.

torch's CPU tensors come from ``malloc``. glibc serves blocks above its mmap threshold (at most
32 MiB) with a fresh ``mmap`` and returns them with ``munmap`` on free, and trims the heap top
back to the OS. A training step frees and reallocates the same activations and gradients every
step, so every step maps them in again: each 4 KiB page costs a fault and the kernel zeroes it
(``benchmarks/profile_step.py`` prints the page faults and system time with and without
:func:`keep_freed_memory`; docs/benchmarks.md has the figures).

:func:`keep_freed_memory` sets ``M_MMAP_MAX = 0`` (every block from the heap, none mmapped) and
``M_TRIM_THRESHOLD`` to its largest value (never give the heap top back). The cost: the process
keeps its high-water mark of heap memory until it exits, as with a caching allocator (CUDA's is
one). The same effect is available without code, before the process starts:
``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=<bytes>`` or ``LD_PRELOAD`` of jemalloc/tcmalloc.

Only glibc on Linux has ``mallopt``; elsewhere it does nothing and returns False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["keep_freed_memory"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1
_applied = False


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory for reuse (see the module docstring).

    Returns True when the settings are in effect (now or from an earlier call).
    """
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _INT_MAX))
    return _applied
