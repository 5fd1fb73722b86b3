"""A rank's C heap: glibc's mmap threshold fixed at start-up, so freed weights go back to the system.

glibc's ``malloc`` serves a request of at least ``M_MMAP_THRESHOLD`` bytes (128 KiB at start) with its own
``mmap``, returned to the system on ``free``; smaller ones come from the heap, whose freed chunks stay resident
unless they sit at its top. By default the threshold is *dynamic*: freeing an mmapped block of up to 32 MiB raises
it to that block's size. A rank frees such blocks as it prepares its weights (the lean decode fuses q/k/v and
gate/up into new tensors and frees the separate ones: 2-46 MB each for a 1.1B Llama), after which tensors of up to
that size, the fused weights among them, came from the heap, and the freed weight matrices stayed resident beside
them: +472 MB (fp32, tp=1) and +331 MB (bf16, tp=2, one rank) for the 1.1B random Llama after its first decode
(bench/results/memory_decode_growth.md). Setting the threshold once, explicitly, turns the adjustment off
(``mallopt(3)``): every tensor of at least :data:`MMAP_THRESHOLD` bytes is mapped and unmapped on its own.
"""
from __future__ import annotations

import ctypes
import ctypes.util

#: requests of at least this many bytes get their own mapping: every weight matrix of the 1.1B Llama in fp32, and
#: a decode step's activations at batch 1 (hidden or logits rows, 8-128 KB) stay below it, in the heap
MMAP_THRESHOLD = 1 << 20
#: free memory at the heap's top beyond this is returned (glibc's dynamic rule keeps it at 2x the mmap threshold)
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3      # <malloc.h>


def fix_mmap_threshold() -> bool:
    """Fix glibc's ``M_MMAP_THRESHOLD`` at :data:`MMAP_THRESHOLD` and ``M_TRIM_THRESHOLD`` at
    :data:`TRIM_THRESHOLD` in this process (no dynamic raise after a large free). Idempotent. Returns ``False``
    where the C library is not glibc (nothing to set: e.g. musl, macOS), ``True`` when both were set."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version         # glibc only: other libcs' mallopt takes other parameter numbers
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
