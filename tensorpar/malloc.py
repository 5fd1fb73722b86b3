"""A rank's C heap: glibc's mmap threshold fixed low while the weights are loaded, raised once the engine is built.

glibc's ``malloc`` serves a request of at least ``M_MMAP_THRESHOLD`` bytes (128 KiB at start) with its own
``mmap``, returned to the system on ``free``; smaller ones come from the heap, whose freed chunks stay resident
unless they sit at its top. By default the threshold is *dynamic*: freeing an mmapped block of up to 32 MiB raises
it to that block's size. A rank frees such blocks as it prepares its weights (the lean decode fuses q/k/v and
gate/up into new tensors and frees the separate ones: 2-46 MB each for a 1.1B Llama), after which tensors of up to
that size, the fused weights among them, came from the heap, and the freed weight matrices stayed resident beside
them: +472 MB (fp32, tp=1) and +331 MB (bf16, tp=2, one rank) for the 1.1B random Llama after its first decode
(bench/results/memory_decode_growth.md). Setting the threshold explicitly turns the adjustment off
(``mallopt(3)``): while loading, every tensor of at least :data:`MMAP_THRESHOLD` bytes is mapped and unmapped on its
own (:meth:`HeapState.for_load`). That made every step's activations of 1 MiB or more a fresh mapping, faulted in
anew each step (serving 13 % slower, bench/results/serve_mmap_threshold.md), so once the decode engine is built,
weights loaded and fused, the threshold is raised to :data:`STEADY_MMAP_THRESHOLD` (:meth:`HeapState.for_steady`):
a step's temporaries reuse the heap again, and no weight is freed after that point.
"""
from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass

#: while loading: requests of at least this many bytes get their own mapping: every weight matrix of the 1.1B
#: Llama in fp32, and a decode step's activations at batch 1 (hidden or logits rows, 8-128 KB) stay below it
MMAP_THRESHOLD = 1 << 20
#: free memory at the heap's top beyond this is returned (glibc's dynamic rule keeps it at 2x the mmap threshold)
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD
#: once the engine is built: glibc's ceiling for its own dynamic threshold on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX``),
#: the largest ``mallopt`` takes
STEADY_MMAP_THRESHOLD = 32 << 20
STEADY_TRIM_THRESHOLD = 2 * STEADY_MMAP_THRESHOLD
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3      # <malloc.h>


def _mallopt():
    """glibc's ``mallopt``, or ``None`` where the C library is not glibc (e.g. musl, macOS: other parameter
    numbers, or none)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallopt = libc.mallopt
        libc.gnu_get_libc_version         # glibc only
    except (OSError, AttributeError, TypeError):
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt


@dataclass
class HeapState:
    """The glibc malloc thresholds this process set (``mallopt`` has no getter), one per process: a rank's
    :attr:`tensorpar.parallel.ParallelContext.heap`, set by :func:`~tensorpar.parallel.init_parallel`.

    Attributes:
        mmap_threshold, trim_threshold: bytes last set; ``None`` before any was set, or where the C library is not
            glibc (nothing is set there).
    """

    mmap_threshold: int | None = None
    trim_threshold: int | None = None

    def for_load(self) -> bool:
        """:data:`MMAP_THRESHOLD` and :data:`TRIM_THRESHOLD`: freed weights go back to the system. Returns whether
        they were set (``False`` without glibc)."""
        return self._set(MMAP_THRESHOLD, TRIM_THRESHOLD)

    def for_steady(self) -> bool:
        """:data:`STEADY_MMAP_THRESHOLD` and :data:`STEADY_TRIM_THRESHOLD`, once the decode engine is built (its
        weights loaded and fused: :class:`~tensorpar.serve.engine.Engine` constructed); a second call changes
        nothing. Returns whether they are set (``False`` without glibc)."""
        if self.mmap_threshold == STEADY_MMAP_THRESHOLD:
            return True
        return self._set(STEADY_MMAP_THRESHOLD, STEADY_TRIM_THRESHOLD)

    def _set(self, mmap_threshold: int, trim_threshold: int) -> bool:
        mallopt = _mallopt()
        if mallopt is None:
            return False
        ok = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))
        if ok:
            self.mmap_threshold, self.trim_threshold = mmap_threshold, trim_threshold
        return ok
