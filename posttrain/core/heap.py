"""The C heap under a training process: fewer glibc arenas, and the update's large blocks mapped, so that freed
tensor memory is reused or returned rather than held.

Imports nothing heavy, so the CLI can call it before torch starts any thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import os

MALLOC_ARENAS = 2
_M_ARENA_MAX = -8  # glibc's mallopt parameter


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Caps glibc's malloc at `arenas` heaps, unless the user has set a limit
    (`MALLOC_ARENA_MAX`, or `arena_max` in `GLIBC_TUNABLES`).

    glibc gives each thread that allocates under contention a heap of its own (up to 8 per core), and memory a
    tensor freed in one heap is not reused for a tensor allocated in another. A training step allocates and frees
    gigabytes of short-lived tensors from several threads, so the process grows to hold freed memory in every heap:
    on the 19.5M benchmark (`bench/vs_trl.py`) two heaps cut peak RSS from 2.5 to 1.8 GB at the same speed. Only
    heaps created from now on are capped, so the CLI calls this first thing. Returns whether the cap was set.
    """
    if "MALLOC_ARENA_MAX" in os.environ or "arena_max" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        return bool(ctypes.CDLL(None).mallopt(_M_ARENA_MAX, arenas))
    except (OSError, AttributeError):  # not glibc: nothing to cap
        return False


_M_MMAP_THRESHOLD = -3
MAPPED_IN_UPDATE = 8 << 20  # bytes: the update's activations of this size and up are mapped, not heap
HEAP_THRESHOLD = 32 << 20  # glibc's own ceiling for its moving threshold, where it settles in a training process


@contextlib.contextmanager
def large_allocations_mapped(threshold: int = MAPPED_IN_UPDATE):
    """Within it, glibc maps every allocation of `threshold` bytes or more on its own and unmaps it when freed.

    The update frees a micro-batch's activations and allocates the next one's while gradients are allocated
    between them, so heap memory freed there stays in the process as holes (glibc can only shrink a heap from its
    top). Mapped blocks leave nothing behind. At ~100M fp32 (`bench/vs_trl.py`) this took the update phase's peak
    RSS from about 3.7 to 3.5 GB. It is kept to the update: in the decode loop, mapping each step's 16 MB
    float64 CDF afresh made the rollout slower. Outside glibc, or where the user tuned malloc
    (`MALLOC_MMAP_THRESHOLD_`, `GLIBC_TUNABLES`), it changes nothing.
    """
    tuned = "MALLOC_MMAP_THRESHOLD_" in os.environ or "mmap_threshold" in os.environ.get("GLIBC_TUNABLES", "")
    try:
        mallopt = None if tuned else ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None or not mallopt(_M_MMAP_THRESHOLD, threshold):
        yield
        return
    try:
        yield
    finally:
        mallopt(_M_MMAP_THRESHOLD, HEAP_THRESHOLD)
