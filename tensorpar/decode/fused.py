"""Fused element-wise kernels of the lean path's decode step (csrc/step.cpp; :mod:`tensorpar.decode.row_step`
runs them): the all-reduce of a row-parallel projection's partial sums fused with the residual add and the next
RMSNorm (:func:`all_reduce_add_rms_norm`), the rotary embedding of the q and k heads with the cache write of k and v
(:func:`rope_store`), attention of one query per row over the cache (:func:`decode_attention`) and the gated
MLP's activation (:func:`silu_mul`). Each replaces framework ops per layer with one call.

Exactness: every add and product is rounded as torch's element-wise kernels round it (the file is built with
``-ffp-contract=off``: no fused multiply-add), so the residual stream (``x + ((p0 + p1) + ...)``, the ranks'
partials in rank order, as :meth:`tensorpar.shm.ShmCommunicator.all_reduce` adds them), the rotated q and k and the
cached v are bitwise the unfused torch ops'. The differences: the RMSNorm's sum of squares is added in another
order than torch's ``mean`` (16 fp32 lanes, then the lanes in order), so the norm's output is within a few units
in the last place of the unfused one; attention sums in another order than torch's CPU flash attention and uses
``expf`` (within fp32 rounding of it), as SiLU does for torch's vectorised exp. tests/decode/test_row_step.py checks each against its reference and greedy
tokens against transformers'.

Build: ``g++ -O3 -ffp-contract=off -shared`` of the one file (plain C++ that the compiler vectorises) with
``-mavx512f`` or, without AVX-512, ``-mavx2`` (:data:`TARGETS`, chosen as
:func:`tensorpar.decode.gemv_kernel.pick_target` chooses; no contraction either way, so the same bits), cached like
:mod:`tensorpar.decode.gemv_kernel`'s and used under the same conditions (it is only called where that kernel runs;
``TENSORPAR_GEMV_KERNEL=0`` turns both off).
"""
from __future__ import annotations

import ctypes
import struct
from functools import lru_cache
from pathlib import Path

import torch

from tensorpar import comm
from tensorpar.comm import Group
from tensorpar.decode.gemv_kernel import pick_target
from tensorpar.native import load_target

_SRC = Path(__file__).with_name("csrc") / "step.cpp"
_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC", "-std=c++17"]
#: the builds of csrc/step.cpp, best first: (name, the /proc/cpuinfo flags it needs, its compiler flags)
TARGETS = (("avx512", ("avx512f",), ["-mavx512f"]), ("avx2", ("avx2",), ["-mavx2"]))
_P = ctypes.c_void_p
_I = ctypes.c_int64


@lru_cache(maxsize=1)
def _lib():
    lib = load_target(pick_target(TARGETS), _SRC, _FLAGS, "step", "TENSORPAR_GEMV_KERNEL")
    if lib is None:
        return None
    lib.tp_add_rms_norm.restype = None
    lib.tp_add_rms_norm.argtypes = [_P, _P, ctypes.c_int, _I, _I, _P, ctypes.c_float, _P]
    lib.tp_rope_store.restype = None
    lib.tp_rope_store.argtypes = [_P, _I, _I, _I, _I, _I, _P, _P, _P, _P, _P, _I, _P]
    lib.tp_silu_mul.restype = None
    lib.tp_silu_mul.argtypes = [_P, _I, _I, _P]
    lib.tp_decode_attention.restype = None
    lib.tp_decode_attention.argtypes = [_P, _I, _I, _I, _P, _P, _I, _P, _I, _I, _I, _P, _I, _P, ctypes.c_float, _P,
                                        _P]
    lib.tp_run_at.restype = _I
    lib.tp_run_at.argtypes = [_P, _P, _P]
    return lib


#: the op kinds of a :func:`program` (csrc/step.cpp ``tp_run_at``), and the words of each op (its kind included)
OP_END, OP_GEMV, OP_GEMV_BF16W, OP_Q8, OP_ROPE, OP_ATTN, OP_SILU, OP_NORM, OP_EXCHANGE = range(9)
#: a bf16 model's (``--dtype bfloat16``): the fp32 ops' words on fp32 buffers holding bf16 values, each result
#: rounded to bf16 where torch's bf16 ops round it, the rotary's cache writes and attention's reads on a bf16 cache;
#: ``(OP_ROUND, x, n)`` rounds ``n`` floats at ``x`` to bf16 in place (after a matmul: torch's bf16 GEMM rounds its
#: fp32 sums once)
OP_NORM_BF16, OP_ROPE_BF16, OP_ATTN_BF16, OP_SILU_BF16, OP_ROUND = range(9, 14)
_WORDS = {OP_GEMV: 13, OP_GEMV_BF16W: 11, OP_Q8: 12, OP_ROPE: 13, OP_ATTN: 15, OP_SILU: 5, OP_NORM: 7, OP_EXCHANGE: 2,
          OP_NORM_BF16: 7, OP_ROPE_BF16: 13, OP_ATTN_BF16: 15, OP_SILU_BF16: 5, OP_ROUND: 3}
#: what :func:`run_at` returns: the program ended; an exchange for the caller (:mod:`tensorpar.decode.step_exchange`);
#: a shared-memory exchange whose peers were late past the spin, or described another collective; an unknown kind
RUN_END, RUN_EXCHANGE, RUN_WAIT, RUN_MISMATCH, RUN_BAD_OP = range(5)
#: ``step`` words of a program's run: attention's length, its mask's address (0: none) and row stride, the address
#: and count of the partial sums the next ``OP_NORM`` adds (:func:`all_reduce_exchange`), then per rotary table the
#: addresses of its cos and sin_sign rows
STEP_LENGTH, STEP_MASK, STEP_MASK_STRIDE, STEP_PARTS, STEP_NPARTS, STEP_TABLES = range(6)


def float_bits(x: float) -> int:
    """``x`` rounded to fp32 (as ctypes passes a ``c_float``), as the int of its 32 bits: a program's float word."""
    return struct.unpack("<I", struct.pack("<f", x))[0]


def program(ops: list[tuple]):
    """The int64 C array of a :func:`run_program` program: each op ``(kind, *words)`` (``None``: a null address), then
    ``OP_END``. The kinds and their words (csrc/step.cpp ``tp_run_at``): ``(OP_GEMV, kernel address, *gemv args)``
    (:func:`tensorpar.decode.gemv_kernel.into_args`' 11), ``(OP_GEMV_BF16W, address, *9 args)``
    (``bf16w_into_args``), ``(OP_Q8, address, *10 args)`` (:func:`tensorpar.decode.q8_kernel.into_args`),
    ``(OP_ROPE, qkv, rows, nq, nkv, d, rd, table, q_out, k_layer, v_layer, head_stride, row_offsets)`` (the cos and
    sin_sign of rotary table ``table`` from the step words), ``(OP_ATTN, q, rows, nq, d, k_layer, v_layer,
    head_stride, blocks, blocks_stride, block_size, kv_of, float_bits(scale), scratch, out)`` (each row's block
    table: ``blocks`` a C array, a row's table ``blocks_stride`` apart; length and mask from the step words),
    ``(OP_SILU, gu, rows, f, out)``, ``(OP_NORM, x, rows, H, weight, float_bits(eps), out)`` (the partial sums from
    the step words): the arguments of :func:`rope_store`, :func:`decode_attention`, :func:`silu_mul`,
    :func:`all_reduce_add_rms_norm`'s kernel; ``(OP_EXCHANGE, context)`` (an all-reduce's exchange between two
    parts: :class:`tensorpar.decode.step_exchange.StepExchange`; only :func:`run_at` runs it). Raises ValueError for
    an unknown kind or a wrong word count."""
    words = []
    for op in ops:
        if len(op) != _WORDS.get(op[0], -1):
            raise ValueError(f"program op {op[:1]} of {len(op)} words; kinds and words: {_WORDS}")
        words += [0 if w is None else int(w) for w in op]
    words.append(OP_END)
    return (ctypes.c_int64 * len(words))(*words)


def run_program(prog: int, step: int) -> None:
    """Run the ops of program ``prog`` (the address of a :func:`program` array without ``OP_EXCHANGE``) in order, in
    one call: the matmuls through their kernels' addresses, the other ops as :func:`rope_store`,
    :func:`decode_attention`, :func:`silu_mul` with the same arguments (bitwise the same results as those calls).
    ``step``: the address of the int64 step words (``STEP_*``: attention's length and mask, each rotary table's rows).
    No collectives. Raises RuntimeError if the program stopped before its end (an exchange, an unknown kind)."""
    at = ctypes.c_int64(0)
    r = run_at(prog, step, at)
    if r != RUN_END:
        raise RuntimeError(f"program stopped at word {at.value} ({r}): run_program runs no exchange or unknown op")


def run_at(prog: int, step: int, at) -> int:
    """Run program ``prog`` (an address) from word ``at.value`` (a ``ctypes.c_int64``) until it ends or an
    ``OP_EXCHANGE`` needs the caller: returns one of :data:`RUN_END` ... :data:`RUN_BAD_OP`, ``at`` then the word after
    the op that stopped it (csrc/step.cpp ``tp_run_at``). Collectives: the shared-memory exchanges it runs itself
    (:class:`tensorpar.decode.step_exchange.StepExchange` counts them)."""
    return _lib().tp_run_at(prog, step, ctypes.addressof(at))


def available() -> bool:
    """Whether this process can run the kernels (AVX-512 F or AVX2, a C++ compiler, ``TENSORPAR_GEMV_KERNEL`` not
    ``0``)."""
    return _lib() is not None


def _parts(addresses: tuple[int, ...]):
    """``addresses`` as a C array of pointers (built per call: no cache at module level)."""
    return (_P * len(addresses))(*addresses)


def add_rms_norm(x: torch.Tensor, parts: list[torch.Tensor], weight: torch.Tensor | None, eps: float,
                 out: torch.Tensor | None) -> None:
    """In place on ``x`` ``[rows, H]`` (fp32, contiguous): ``x += ((parts[0] + parts[1]) + ...)`` (each ``[rows, H]``;
    none: no add), then ``out = weight * (x * rsqrt(mean(x^2) + eps))`` (skipped when ``out`` is None). The
    reference entry of the kernel (tests); the decode step calls :func:`all_reduce_add_rms_norm`."""
    rows, H = x.shape
    for t in [x, *parts] + ([out, weight] if out is not None else []):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError("add_rms_norm takes contiguous fp32 CPU tensors")
    _lib().tp_add_rms_norm(x.data_ptr(), _parts(tuple(p.data_ptr() for p in parts)), len(parts), rows, H,
                           None if out is None else weight.data_ptr(), eps, None if out is None else out.data_ptr())


def all_reduce_exchange(partial: torch.Tensor, tp: Group, arrays: dict | None = None,
                        dtype: torch.dtype = torch.float32) -> tuple[int, int, object]:
    """The exchange of :func:`all_reduce_add_rms_norm` without the add and norm: ``(address of a C array of the
    addresses of the ranks' partial sums in rank order, their count, what must stay alive until they are read)``,
    for a program's ``OP_NORM`` (the step words :data:`STEP_PARTS`, :data:`STEP_NPARTS`). Shared memory: the slots
    the exchange left them in (read before the next collective on the group); gloo: :func:`tensorpar.comm.all_reduce`'s
    result (one part); ``--tp-comm int8`` (``tp.compression``): :func:`tensorpar.comm.reduce_partial`'s result (one
part, counted as its all-gather); one rank: ``partial`` itself. ``arrays``: a dict the caller keeps in which each set of
    addresses' C array is built once (the exchange's slots alternate between two). ``dtype``: the dtype the general
    loop all-reduces in; bf16 (a bf16 model's step, ``partial`` holding bf16 values): gloo and ``--tp-comm int8``
    reduce a bf16 copy, so that the sum is rounded as the general loop's (gloo's order, each add in bf16; the
    shared-memory slots are added in rank order, in bf16, by ``OP_NORM_BF16``). Collectives: one all-reduce of
    ``partial`` ``[rows, H]`` (counted and fingerprinted as :func:`tensorpar.comm.all_reduce`'s)."""
    keep = None

    def in_dtype(t: torch.Tensor) -> torch.Tensor:
        return t if dtype == torch.float32 else t.to(dtype)

    def back(t: torch.Tensor) -> torch.Tensor:
        return t if t.dtype == torch.float32 else t.float()
    if tp.size == 1:
        parts = (partial.data_ptr(),)
    elif tp.compression != "fp32":          # --tp-comm int8: the compressed sum, as the general loop adds it
        keep = back(comm.reduce_partial(in_dtype(partial), tp))
        parts = (keep.data_ptr(),)
    else:
        fast = tp.fast
        if fast is not None and hasattr(fast, "all_reduce_parts"):
            counter = tp.counter
            counter.record("all_reduce", partial.numel(), 4, tp.size)
            t0 = counter.start()
            parts = fast.all_reduce_parts(partial)
            counter.blocked("all_reduce", t0)
        else:
            keep = back(comm.all_reduce(in_dtype(partial), tp))
            parts = (keep.data_ptr(),)
    got = None if arrays is None or keep is not None else arrays.get(parts)
    if got is None:
        arr = _parts(parts)
        got = (ctypes.addressof(arr), len(parts), arr)
        if arrays is not None and keep is None:
            arrays[parts] = got
    return got[0], got[1], (got[2], keep)


def all_reduce_add_rms_norm(partial: torch.Tensor, tp: Group, args: tuple, arrays: dict | None = None) -> None:
    """The sum of ``partial`` ``[rows, H]`` over ``tp`` added to the residual stream and normalised, in one pass:
    ``args`` = ``(x, rows, H, weight, eps, out)`` as the kernel takes them (addresses of ``x`` ``[rows, H]``, the
    norm's weight ``[H]``, ``out`` ``[rows, H]``, all fp32). ``x`` becomes bitwise ``x + all_reduce(partial)``;
    ``out`` the RMSNorm of it (see the module docstring). On a shared-memory group the ranks' partials are read where
    the all-reduce's exchange left them (:meth:`~tensorpar.shm.ShmCommunicator.all_reduce_parts`, no sum tensor);
    otherwise :func:`tensorpar.comm.all_reduce` and the kernel reads its result (:func:`all_reduce_exchange`; the
    row step runs the add and norm inside its programs, ``OP_NORM``). Collectives: one all-reduce of ``[rows, H]``
    (counted and fingerprinted as :func:`tensorpar.comm.all_reduce`'s)."""
    addr, n, keep = all_reduce_exchange(partial, tp, arrays)
    x, rows, H, w, eps, out = args
    _lib().tp_add_rms_norm(x, addr, n, rows, H, w, eps, out)
    del keep


def rms_norm_raw(args: tuple) -> None:
    """``out = weight * (x * rsqrt(mean(x^2) + eps))`` with no add: ``args`` = ``(x, rows, H, weight, eps, out)``
    as :func:`all_reduce_add_rms_norm` takes them (the first layer's input norm of a decode step)."""
    x, rows, H, w, eps, out = args
    _lib().tp_add_rms_norm(x, None, 0, rows, H, w, eps, out)


def rope_store(args: tuple) -> None:
    """Rotate the q and k heads of a fused QKV row and write k and v into the KV cache: ``args`` =
    ``(qkv, rows, nq, nkv, d, rd, cos, sin_sign, q_out, k_layer, v_layer, head_stride, row_offsets)`` as the kernel
    takes them (csrc/step.cpp ``tp_rope_store``: addresses of ``qkv`` ``[rows, (nq + 2 nkv) d]``, ``cos`` /
    ``sin_sign`` ``[rows, rd]``, ``q_out`` ``[rows, nq, d]``, the layer's K and V pools, and a C array of each row's
    element offset in them). Bitwise the lean path's ``rotate`` and cache copies. No collectives."""
    _lib().tp_rope_store(*args)


def decode_attention(args: tuple) -> None:
    """Attention of one query per row over a paged KV cache, into a preallocated output: ``args`` = ``(q, rows, nq,
    d, k_layer, v_layer, head_stride, blocks, blocks_stride, block_size, L, mask, mask_stride, kv_of, scale,
    scratch, out)`` as the kernel takes them (csrc/step.cpp ``tp_decode_attention``): addresses of ``q`` ``[rows,
    nq, d]`` and of the layer's K and V pools ``[kv_local, num_blocks, block_size, d]`` (``head_stride`` elements
    per KV head), each row's block table (int64, ``blocks_stride`` apart: position ``t`` is in block
    ``table[t // block_size]`` at offset ``t % block_size``; the static cache: one block per row), the ``L``
    positions read, a ``[rows, L]`` bool mask with its row stride or None, each query head's KV head (int64),
    ``scratch`` of at least ``L`` floats, ``out`` ``[rows, nq * d]``. Each query head reads its KV head's blocks in
    place: no gathers, no copies per query head (uneven head splits), no call per run of heads. Within fp32
    rounding of ``scaled_dot_product_attention`` (another order of the sums, ``expf``). No collectives."""
    _lib().tp_decode_attention(*args)


def silu_mul(args: tuple) -> None:
    """The gated MLP's activation into a preallocated output: ``args`` = ``(gu, rows, f, out)`` (addresses of ``gu``
    ``[rows, 2 f]``, gate then up, and ``out`` ``[rows, f]``): ``out = silu(gate) * up``, ``silu(g) = g / (1 +
    exp(-g))`` with ``expf`` for torch's vectorised exp, so within a few units in the last place of
    ``F.silu(gate) * up``. No collectives."""
    _lib().tp_silu_mul(*args)
