"""Compressed tensor-parallel all-reduce for slow links: blockwise int8 partial sums, one all-gather hop.

Selected per group by ``Group.compression`` (``"fp32"``: the exact all-reduce; ``"int8"``: :func:`all_reduce_int8`),
which ``--tp-comm`` sets on the tp group of ``generate``, ``serve`` and ``verify``. Only the all-reduce of the
partial sums of tensor-parallel regions (:func:`tensorpar.comm.reduce_partial`: row-parallel outputs, the
vocab-parallel embedding, the lean decode loop) is compressed; every other all-reduce (norms, softmax maxima and
sums, counts, timings) stays exact.

Format of one rank's partial ``x`` (``n`` elements, any shape, any float dtype): ``ceil(n / 32)`` blocks of 32
consecutive elements of ``x.flatten()`` (the last block may be shorter); per block a float32 scale
``s = absmax / 127`` and int8 values ``q = round(x * 127 / absmax)`` in ``[-127, 127]`` (symmetric, no zero point;
a block of zeros has ``s = 0``). Bytes on the wire per rank: ``4 * ceil(n / 32) + n`` (``1.125 n``; the int8
values padded to 4 bytes) against ``4 n`` for fp32 (0.28x) or ``2 n`` for bf16 (0.56x) payload.

On a CPU the quantization and the dequantized sum run in one C++ file of ours (csrc/q8_comm.cpp, built once per
machine by :mod:`tensorpar.native`; ``TENSORPAR_COMM_KERNEL=0`` turns it off): the same fp32 operations in the same
order as the PyTorch path here, so the same bits (a test compares them, nan, inf and tiny blocks included: a block
whose ``x * 127 / absmax`` is not finite is stored as 0 on both paths, a NaN scale is the default quiet NaN). One rank's work per call (its encode, the
sum of 2 payloads), one thread on the Xeon (bench/results/q8-comm-xeon.md): 16-29 us against 112-161 us at a
decode step's ``[1, 576-4096]``, 0.63 against 5.2 ms at a 512-token prefill's ``[512, 576]``, 2.6 against 18.5 ms at
``[512, 2048]``. Elsewhere (CUDA, no compiler) the PyTorch path runs.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch

BLOCK = 32
QMAX = 127
_SRC = Path(__file__).with_name("csrc") / "q8_comm.cpp"
_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC", "-std=c++17"]
#: the builds of csrc/q8_comm.cpp, best first: (name, the /proc/cpuinfo flags it needs, its extra compiler flags)
TARGETS = (("avx512", ("avx512f", "avx512bw"), ["-mavx512f", "-mavx512bw"]), ("avx2", ("avx2",), ["-mavx2"]),
           ("plain", (), []))


@lru_cache(maxsize=1)
def _lib():
    """The ctypes library of csrc/q8_comm.cpp for this CPU's best target, or None where it cannot run."""
    from tensorpar.native import load_target, pick_target
    lib = load_target(pick_target(TARGETS), _SRC, _FLAGS, "q8comm", "TENSORPAR_COMM_KERNEL")   # "plain": any CPU
    if lib is None:
        return None
    p, i = ctypes.c_void_p, ctypes.c_int64
    lib.tp_q8c_quantize.restype = lib.tp_q8c_dequant_sum.restype = None
    lib.tp_q8c_quantize.argtypes = [p, i, p, p, i]
    lib.tp_q8c_dequant_sum.argtypes = [p, i, i, i, p]
    return lib


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def payload_bytes(numel: int) -> int:
    """Bytes of one rank's compressed partial of ``numel`` elements: one float32 scale per block, then the int8
    values padded to a multiple of 4 bytes (so that every rank's scales stay 4-byte aligned in the gathered
    buffer): ``4 * ceil(n / 32) + 4 * ceil(n / 4)``."""
    return 4 * _blocks(numel) + 4 * -(-numel // 4)


def _quantize_into(x: torch.Tensor, scales: torch.Tensor, q: torch.Tensor) -> None:
    """Write the float32 ``scales [nb]`` and int8 ``q [n]`` of ``x`` (see :func:`quantize_int8`)."""
    n = x.numel()
    nb = scales.numel()
    if nb * BLOCK == n:
        flat = x.detach().reshape(-1).float()
    else:                                               # the last partial block, padded with zeros
        flat = x.new_zeros(nb * BLOCK, dtype=torch.float32)
        flat[:n].copy_(x.detach().reshape(-1))
    blocks = flat.view(nb, BLOCK)
    amax = torch.linalg.vector_norm(blocks, float("inf"), dim=1, keepdim=True)      # [nb, 1]
    torch.div(amax.view(nb), QMAX, out=scales)
    # x * (127 / absmax) lies in [-127, 127] up to a rounding, so round() needs no clamp; where 127 / absmax is not
    # finite (absmax below 127 / FLT_MAX, ~3.7e-37: every zero block) or absmax is (a nan or inf element), the
    # product is not finite and its block is stored as 0 (the C kernel's rule; a cast of inf or nan is undefined)
    qf = torch.round(blocks * (QMAX / amax.clamp_min(torch.finfo(torch.float32).tiny)))
    qf = torch.nan_to_num(qf, nan=0.0, posinf=0.0, neginf=0.0)
    q.copy_(qf.view(-1)[:n])


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise symmetric absmax int8 quantization of ``x.flatten()``.

    Shapes: ``x`` any shape with ``n`` elements -> ``(q, scales)``: ``q`` int8 ``[n]``, ``scales`` float32
    ``[ceil(n / 32)]``. Element ``i`` is ``q[i] * scales[i // 32]`` up to ``scales[i // 32] / 2`` (round to
    nearest), i.e. ``absmax / 254`` of its block; a block whose absmax is below ``127 / FLT_MAX`` (about 3.7e-37:
    all zeros, or values that small) is stored as 0, an error of at most its absmax. A non-finite element makes its
    block's scale non-finite, so the dequantized block is non-finite too (as the exact sum would be).
    """
    n = x.numel()
    scales = torch.empty(_blocks(n), dtype=torch.float32, device=x.device)
    q = torch.empty(n, dtype=torch.int8, device=x.device)
    _quantize_into(x, scales, q)
    return q, scales


def _dequantize_rows(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``q`` int8 ``[t, n]``, ``scales`` float32 ``[t, nb]`` -> float32 ``[t, nb * 32]`` (zeros past ``n``)."""
    t, n = q.shape
    nb = scales.shape[1]
    if nb != _blocks(n):
        raise ValueError(f"dequantize_int8: {nb} scales for {n} values (blocks of {BLOCK} need {_blocks(n)})")
    qf = torch.empty(t, nb * BLOCK, dtype=torch.float32, device=q.device)
    if nb * BLOCK != n:
        qf[:, n:].zero_()
    qf[:, :n].copy_(q)
    qf.view(t, nb, BLOCK).mul_(scales.unsqueeze(-1))
    return qf


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_int8`: float32 ``[n]`` from int8 ``q [n]`` and float32 ``scales [ceil(n/32)]``."""
    return _dequantize_rows(q.view(1, -1), scales.view(1, -1))[0, :q.numel()]


def all_reduce_int8(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of ``x`` over ``group`` with every rank's partial compressed to blockwise int8 on the wire.

    Shapes: ``x`` any shape and float dtype, same on every rank -> a new tensor of ``x``'s shape, dtype and device.

    Collectives: one all-gather over ``group`` of a uint8 payload of :func:`payload_bytes` ``(x.numel())`` bytes
    per rank (float32 scales, then the int8 values; counted as ``all_gather`` by the group's counter). Each rank
    then dequantizes every rank's payload, its own included, and sums them in float32 in rank order, so every
    rank gets the same bits. Wire bytes per rank: ``(t - 1) * 1.125 n`` against the ring all-reduce's
    ``2 (t - 1) / t * 4 n`` in fp32: 0.28x at ``t = 2``, 0.42x at ``t = 3``; it stops paying at ``t >= 8``.

    Error: per block, per rank ``|err| <= scale / 2 = absmax / 254`` of that rank's block (a block below about
    3.7e-37 is sent as 0: ``|err| <= absmax``); the sum's error is at most the sum of those over the ranks (plus
    float32 rounding of the sum and of the result's dtype).

    Inference only: no autograd of its own (the input is detached); :func:`tensorpar.comm.reduce_from_tp_region`
    passes the gradient through unchanged, as the exact all-reduce's backward does (straight-through).

    Raises:
        ValueError: ``x`` is not a floating-point tensor.
        CollectiveError: the all-gather failed.
    """
    if not x.is_floating_point():
        raise ValueError(f"all_reduce_int8 on {group.name}: needs a floating-point tensor, got {x.dtype}")
    if group.size == 1:
        return x
    from tensorpar import comm

    g = comm.all_gather(encode(x), group, dim=0).view(group.size, -1)    # rank order
    y = decode_sum(g, x.numel()).view(x.shape)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def encode(x: torch.Tensor) -> torch.Tensor:
    """One rank's payload of :func:`all_reduce_int8`: uint8 ``[payload_bytes(n)]``, the float32 scales of
    :func:`quantize_int8` then its int8 values, zero-padded to 4 bytes (the C kernel on a CPU where it runs)."""
    n = x.numel()
    nb, m = _blocks(n), payload_bytes(n)
    payload = torch.empty(m, dtype=torch.uint8, device=x.device)
    lib = _lib() if x.device.type == "cpu" else None
    if lib is not None:             # few torch calls: at a decode step's size each costs about as much as the kernel
        xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.detach().to(torch.float32).contiguous()
        at = payload.data_ptr()
        lib.tp_q8c_quantize(xf.data_ptr(), n, at, at + 4 * nb, m - 4 * nb - n)
        return payload
    _quantize_into(x, payload[:4 * nb].view(torch.float32), payload[4 * nb:4 * nb + n].view(torch.int8))
    if m > 4 * nb + n:
        payload[4 * nb + n:].zero_()
    return payload


def decode_sum(g: torch.Tensor, n: int) -> torch.Tensor:
    """The float32 sum ``[n]`` of the gathered payloads ``g`` uint8 ``[t, payload_bytes(n)]`` (rank order): each
    dequantized, added in rank order (the C kernel on a CPU where it runs: the same bits)."""
    t, m = g.shape
    nb = _blocks(n)
    if g.dtype != torch.uint8 or m != payload_bytes(n):
        raise ValueError(f"decode_sum: payloads of {m} bytes ({g.dtype}) for {n} values; expected uint8 rows of "
                         f"payload_bytes({n}) = {payload_bytes(n)}")
    if n == 0:
        return torch.zeros(0, dtype=torch.float32, device=g.device)
    lib = _lib() if g.device.type == "cpu" else None
    if lib is not None:
        g = g if g.is_contiguous() else g.contiguous()
        out = torch.empty(n, dtype=torch.float32)
        lib.tp_q8c_dequant_sum(g.data_ptr(), t, m, n, out.data_ptr())
        return out
    d = _dequantize_rows(g[:, 4 * nb:4 * nb + n].view(torch.int8), g[:, :4 * nb].view(torch.float32))
    acc = d[0]
    for r in range(1, t):
        acc = acc + d[r]
    return acc[:n]
