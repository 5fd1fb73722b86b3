"""Several Linears of one module run as one matmul: their weights (and biases) concatenated along the output
dimension into one tensor, the original parameters made row views of it (same names, same values, no second copy).

The lean decode path fuses each attention's q/k/v and each gated MLP's gate/up this way
(:func:`tensorpar.decode.prepare.fuse_projections`); the tensor-parallel modules' own forwards
(:mod:`tensorpar.hf.modules`) use the fused tensor while it is current. The pair lives in the owner's ``__dict__``
under :data:`FUSED_KEY`: ``(weight [sum(out_i), in], bias [sum(out_i)] or None)``, or after int8 quantization
(:mod:`tensorpar.decode.quantize`) ``(Int8Weight, bias)``. Here, below both ``hf`` and ``decode``, so that neither
imports the other to read it. No collectives.
"""
from __future__ import annotations

import torch

#: the owner's ``__dict__`` entry holding its fused ``(weight, bias)``
FUSED_KEY = "_lean_fused"


def _concat_as_views(mods) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate ``mods[i].weight`` (and biases) along dim 0 and make each a view of the result."""
    ws = [m.weight for m in mods]
    fused = torch.cat([w.detach() for w in ws])
    off = 0
    for w in ws:
        n = w.shape[0]
        w.data = fused[off:off + n]
        off += n
    biases = [m.bias for m in mods]
    fb = None
    if all(b is not None for b in biases):
        fb = torch.cat([b.detach() for b in biases])
        off = 0
        for b in biases:
            b.data = fb[off:off + b.shape[0]]
            off += b.shape[0]
    elif any(b is not None for b in biases):
        fb = torch.cat([b.detach() if b is not None else w.new_zeros(w.shape[0]) for b, w in zip(biases, ws)])
    return fused, fb


def fuse_linears(owner, names: tuple[str, ...]) -> None:
    """Fuse ``owner``'s Linears ``names`` (e.g. ``("q_proj", "k_proj", "v_proj")``), ``[out_i, in]`` each, into
    one ``[sum(out_i), in]`` weight (and bias) kept on ``owner``; the Linears' parameters become its row views."""
    owner.__dict__[FUSED_KEY] = _concat_as_views([getattr(owner, n) for n in names])


def fused_weight(owner, names: tuple[str, ...]):
    """The fused ``(weight, bias)`` of ``owner``'s projections ``names`` (built on first use by
    :func:`fuse_linears`), or ``None`` when they are stale (the parameters were replaced, e.g. by ``.to``)."""
    f = owner.__dict__.get(FUSED_KEY)
    if f is None:
        return None
    w = f[0]
    if not isinstance(w, torch.Tensor):     # int8 (tensorpar.decode.quantize.quantize_int8): the fp weights were freed
        return f
    first = getattr(owner, names[0]).weight
    if first.data_ptr() != w.data_ptr() or first.dtype != w.dtype or first.device != w.device:
        return None
    return f
