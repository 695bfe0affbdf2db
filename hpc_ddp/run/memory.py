"""The rank's host memory allocator (glibc's malloc): giving freed memory back to the system.

torch allocates CPU tensors with malloc. glibc serves a request of 32 MiB or more with a fresh mmap and unmaps
it when freed; anything smaller comes from its heaps once a chunk of that size has been freed (it raises its
mmap threshold to the largest such chunk), and a freed heap chunk stays the process's, counted in its resident
memory, until malloc reuses it or something trims it. A rank that frees a large set of medium tensors (FSDP's
sharded gradients, a save's staging copy) therefore keeps their memory, and what it allocates next in other
sizes comes on top. `trim()` returns the free pages of every heap (`malloc_trim(0)`: since glibc 2.8 it releases
free pages anywhere in a heap, not only at its top); the kit calls it where it has just dropped something large
that training will not allocate again (a save's staging copy after the final save). Trimming after every
step does not help: what grows a rank's memory is fragmentation within a step, which the settings the kit's
launchers start ranks with prevent (hpc_ddp.cluster.allocator). Without glibc (musl, macOS) `trim` does
nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache
from typing import Any


@cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def trim() -> bool:
    """Give the free pages of malloc's heaps back to the system; whether any were (False without glibc)."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
