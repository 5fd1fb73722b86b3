"""A rank's C heap returns freed tensors of 1 MiB and more to the system (issue 28, item 4; docs/memory.md).

glibc raises its mmap threshold to the size of a freed mapped block (up to 32 MiB) unless the threshold was set
explicitly; a rank sets it in :func:`tensorpar.parallel.init_parallel` (:func:`tensorpar.malloc.fix_mmap_threshold`).
Before, the lean decode's fusion of q/k/v and gate/up, which frees the separate matrices, left the 1.1B random
Llama's ranks up to 331 MB (bf16 tp=2) above their shard after decoding (bench/results/memory_decode_growth.md).
"""
import ctypes

import pytest
import torch


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def job_mapped_after_large_free(ctx):
    """Bytes glibc maps on its own (``mallinfo2().hblkhd``) gained by a 2 MiB tensor allocated after a 4 MiB one
    was freed, or ``None`` without glibc's ``mallinfo2``."""
    try:
        info = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    info.restype = _MallInfo2
    big = torch.ones(1 << 20)       # 4 MiB: mapped (above any threshold a rank starts with) and unmapped on free
    del big                         # glibc's dynamic rule would now raise the threshold to 4 MiB
    before = info().hblkhd
    t = torch.ones(1 << 19)         # 2 MiB, written: its own mapping only with the threshold fixed below it
    got = info().hblkhd - before
    del t
    return got


def test_rank_maps_tensors_of_a_mebibyte_after_a_larger_free(pools):
    """On the old code the 2 MiB tensor came from the heap (hblkhd gained 0); now it is mapped on its own: hblkhd
    gains at least its 2 MiB (exact arithmetic on byte counts; the mapping rounds up to a page, hence >=)."""
    got = pools(1).run(job_mapped_after_large_free)[0]
    if got is None:
        pytest.skip("not glibc: no mallinfo2, and tensorpar.malloc sets nothing")
    assert got >= 2 * 2 ** 20, f"a 2 MiB tensor after a 4 MiB free came from the heap (mapped bytes +{got})"
