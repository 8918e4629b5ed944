"""Keeps glibc from returning large freed buffers to the OS on CPU, where every step allocates them anew.

By default glibc serves big allocations with mmap and unmaps them on free, so each step's activation
buffers (tens of MB) are page-faulted and zeroed again by the kernel: on a 2-core machine a varied-length
workload spent 40% of its time in those faults. Raising the mmap threshold to its maximum (32 MiB) and the
trim threshold to 1 GiB keeps them in the heap for reuse. Process-wide, applied once, only on glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
_applied = False


def keep_freed_memory() -> bool:
    global _applied
    if _applied or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return _applied
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _applied = bool(libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError) as e:
        logger.debug("mallopt unavailable: %s", e)
    return _applied
