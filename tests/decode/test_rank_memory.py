"""A rank's C heap returns freed tensors of 1 MiB and more to the system (issue 28, item 4; docs/memory.md).

glibc raises its mmap threshold to the size of a freed mapped block (up to 32 MiB) unless the threshold was set
explicitly; a rank sets it in :func:`tensorpar.parallel.init_parallel` (:meth:`tensorpar.malloc.HeapState.for_load`).
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


def job_thresholds_around_the_engine(ctx, folder):
    """The mmap threshold this rank's :class:`~tensorpar.malloc.HeapState` records after init_parallel, while the
    weights are fused (the lean decoder's ``fuse_projections``), at each decode step and after a second generate,
    and the bytes a 2 MiB tensor after a 4 MiB free gets mapped at the end (:func:`job_mapped_after_large_free`:
    glibc itself took the value). The pooled process is set back to the load's threshold afterwards."""
    from tensorpar.decode import lean
    from tensorpar.generate import SamplingConfig, generate_tokens
    from tensorpar.hf.load import build_parallel_model

    heap, seen = ctx.heap, {"init": ctx.heap.mmap_threshold, "steps": []}
    fuse = lean.fuse_projections

    def spy(model):
        seen.setdefault("fusion", heap.mmap_threshold)     # the first fusion (a second engine finds it done)
        return fuse(model)
    lean.fuse_projections = spy
    try:
        model, _ = build_parallel_model(folder, ctx.tp)
        seen["loaded"] = heap.mmap_threshold
        ids = torch.tensor([[1, 2, 3, 4]])
        generate_tokens(model, ctx.tp, ids, sampling=SamplingConfig(max_new_tokens=3), heap=heap,
                        on_token=lambda step, tok: seen["steps"].append(heap.mmap_threshold))
        generate_tokens(model, ctx.tp, ids, sampling=SamplingConfig(max_new_tokens=2), heap=heap)  # once per process
        seen["after"] = (heap.mmap_threshold, heap.trim_threshold)
        seen["mapped"] = job_mapped_after_large_free(ctx)
    finally:
        lean.fuse_projections = fuse
        heap.for_load()
    return seen


def test_threshold_is_the_loads_until_the_engine_is_built_then_raised(pools, tmp_path):
    """Issue 28: the fixed 1 MiB threshold kept freed weights out of the heap but mapped every step's activations of
    1 MiB or more anew (serving 13 % slower). Now it is 1 MiB from init_parallel through the load and the fusion of
    the weights, and 32 MiB (glibc's own ceiling) from the first decode step on, raised once; glibc took it: a
    2 MiB tensor then comes from the heap (no mapped bytes gained). The old code had no ctx.heap (AttributeError)."""
    from tensorpar.malloc import MMAP_THRESHOLD, STEADY_MMAP_THRESHOLD, STEADY_TRIM_THRESHOLD
    from tests.decode.test_generate import make_model_folder
    folder = str(make_model_folder(tmp_path / "llama", "llama"))
    seen = pools(1).run(job_thresholds_around_the_engine, folder)[0]
    if seen["init"] is None:
        pytest.skip("not glibc: tensorpar.malloc sets nothing")
    assert seen["init"] == seen["loaded"] == seen["fusion"] == MMAP_THRESHOLD, seen
    assert seen["steps"] == [STEADY_MMAP_THRESHOLD] * 3, seen
    assert seen["after"] == (STEADY_MMAP_THRESHOLD, STEADY_TRIM_THRESHOLD), seen
    assert seen["mapped"] is None or seen["mapped"] < 2 * 2 ** 20, seen
