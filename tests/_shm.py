"""Helpers for the shared-memory tests: a fast twin of a rank's tp group, and bit-level fingerprints."""
import dataclasses
import hashlib

import torch

from tensorpar import comm
from tensorpar.shm import enable_fast_collectives


def fast_twin(ctx, mode: str = "on", **kw) -> comm.Group:
    """A new Group over ``ctx.tp``'s process group with the fast path enabled (``ctx.tp`` stays plain gloo).

    Each test job makes its own and closes it (``disable_fast_collectives``), so the shared
    pools keep running the other test files over gloo.
    """
    g = comm.Group(pg=ctx.tp.pg, rank=ctx.tp.rank, size=ctx.tp.size, name="tp")
    enabled = enable_fast_collectives(g, mode, **kw)
    assert enabled == (mode != "off"), (mode, enabled)
    return g


def with_tp(ctx, group: comm.Group):
    """``ctx`` with its tp group replaced, for reusing jobs written against ``ctx.tp``."""
    return dataclasses.replace(ctx, tp=group)


def fingerprint(t: torch.Tensor) -> str:
    """Digest of dtype, shape and raw bytes: equal fingerprints mean bit-identical tensors."""
    h = hashlib.sha1(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
