"""Our fp32 / bf16 GEMV for the lean decode path's matmuls at a few rows (csrc/gemv.cpp), built once per machine
and registered as the torch custom op ``tensorpar::gemv`` so a compiled step can call it.

Why our own kernel: at one row (a decode step) the matmul reads every weight once and does two flops per weight,
so it should stream at the memory-read limit. oneDNN's prepacked GEMV (what the lean path ran,
:func:`tensorpar.decode.kernels.packed_linear`) read bf16 weights at well below it on this AMD EPYC (Zen 4:
AVX-512 BF16, no AMX), below its own fp32 rate per byte; measured per shape in bench/bench_gemv.py
(bench/results/gemv.md). Torch 2.13's other CPU paths do not help there: ``F.linear`` on a bf16 weight is the
same oneDNN matmul plus a weight reorder per call, Inductor's CPU GEMM templates (``max_autotune``) need a compiled
step and pack the weight themselves (a second copy).

The layout is the plain weight ``[out, in]`` row-major, the one the modules, checkpoints and verify read, so
nothing is packed and nothing converted. Where rows are at least 2 KB, each group of up to 4 input rows reads
several weight rows at a time (8 for one input row: 8 sequential streams, csrc/gemv.cpp ``f32_stripes``; on the
Xeon the 1.1B Llama's fp32 shapes read 1.29-1.52x faster than one row after the other,
bench/results/gemv-streams-xeon.md, and at 1.07-1.14x oneDNN's prepacked GEMV, bench/results/gemv-xeon-stripes.md;
at 2-4 input rows 1.38-1.67x, gemv-xeon-rows-stripes.md), else one row after the other. There each output is summed
in the same order whatever the rows beside it, so a row's result does not depend on the batch.
Since 2026-12-04 the lean path holds fp32 weights in a blocked layout instead (:class:`BlockedWeight`, mode
:data:`MODE_BLOCKED`: 32 output rows per block, k-major, the inputs broadcast into output vectors; 1.02-1.85x the
plain layout's rate, bench/results/gemv-blocked-epyc.md), which replaces the plain weight on the modules
(:func:`tensorpar.decode.matmuls.use_blocked`); ``--quantize bf16`` holds its bf16 weights of rows of at least
1024 inputs in the same layout's bf16 form (:func:`~tensorpar.decode.bf16_weights.block_bf16`, inputs in pairs,
``tp_gemv_bf16w_blocked``: 1.37-1.91x the plain layout at one row on the 1.1B's shapes,
bench/results/gemv-bf16w-blocked-epyc.md), and so does a bf16 model (``tp_gemv_bf16_blocked``: ``vdpbf16ps`` on
the pairs, :func:`bf16_blocked_linear`); the plain layout stays where a caller keeps the model's parameters.
Sums in fp32 (bf16 x bf16: ``vdpbf16ps`` pairs with AVX512_BF16, else both widened to fp32 in registers, where
each product is exact; or the weights widened to fp32 with the input in fp32: :func:`mode`), rounded to bf16 once
at the end for bf16 weights.

Build: one C++ file (no torch headers), for one of :data:`TARGETS`: the first whose instruction sets /proc/cpuinfo
lists (AVX-512 with BF16: ``-mavx512f -mavx512bw -mavx512vl -mavx512bf16``; else AVX2 with FMA: ``-mavx2
-mfma``), ``g++ -O3 -fopenmp -shared``, cached like :mod:`tensorpar.decode.q8_kernel`'s under a name carrying the
target and a hash of the source and flags; loaded with ctypes. Used where one target's features are listed and the
build succeeded (:func:`available`, ``TENSORPAR_GEMV_KERNEL=0`` turns it off); elsewhere the lean path runs
oneDNN on prepacked weights as before.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import torch

from tensorpar.decode.q8_kernel import _cpu_has_features
from tensorpar.native import load_target

_SRC = Path(__file__).with_name("csrc") / "gemv.cpp"
_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
#: the builds of csrc/gemv.cpp, best first: (name, the /proc/cpuinfo flags it needs, its compiler flags); the
#: source picks its vector primitives from the compiler's macros (``__AVX512F__`` / ``__AVX512BF16__``, else
#: ``__AVX2__`` and ``__FMA__``)
TARGETS = (("avx512", ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
            ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"]),
           ("avx2", ("avx2", "fma"), ["-mavx2", "-mfma"]))
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
#: the kernel's modes: 0 = one weight row at a time (bf16: ``vdpbf16ps`` on the bf16 input; without AVX512_BF16
#: the input and the weights widened to fp32 in registers, even and odd halves, and fma); 1 (bf16) = the
#: weights widened to fp32 (even and odd halves of each 32 with a shift and an and, the input reordered to match once
#: per call) and fma with the input in fp32; 2 = as 0 for one input row, two weight rows at a time for 2-4 input
#: rows (each input vector loaded once for both). bench/bench_gemv.py measures them (bench/results/gemv.md,
#: gemv-0014.md, gemv-bf16.md): :func:`mode` picks the faster.
MODE_ONE_ROW, MODE_WIDEN, MODE_PAIRS = 0, 1, 2
#: fp32 weights in the blocked layout of :func:`block` (csrc/gemv.cpp ``tp_gemv_blocked``)
MODE_BLOCKED = 3
#: output rows per block of :func:`block`'s layout (csrc/gemv.cpp ``NB``)
BLOCK = 32
#: software prefetch distance in elements (0: none: measured slower, the hardware prefetcher follows the one stream)
PREFETCH = 0
#: the most rows the lean path runs through this kernel on fp32 weights, and the most rows of a
#: :class:`~tensorpar.decode.row_step.RowStep` (every format it runs: fp32, and the int8 and bf16 weights of
#: ``--quantize``). Per matmul (bench/results/gemv-xeon-rows-stripes.md, Xeon, one thread, tp=2 shapes): with 2-4
#: input rows against 8, 6 or 4 weight rows at a time (csrc/gemv.cpp ``f32_stripes``) ours reads the 1.1B Llama's
#: weights at 1.38-1.67x oneDNN's prepacked GEMM at 2-4 rows, 0.95-1.21x at 16, 0.81-1.04x at 32 (before the
#: stripes: 0.64-0.87x at 16, gemv-xeon-rows.md); SmolLM2's 1.06-1.68x at 2-32. Per decode step the row step's
#: few C calls per layer add to that: SmolLM2 at tp=2, fp32, batch 4 / 8 / 16 decoded 83 / 134 / 200 tokens/s
#: against 32 / 53 / 98 with MAX_ROWS 2 (prepacked weights, the general loop), the 1.1B 13.0 / 20.4 / 27.4
#: against 8.4 / 14.9 / 25.2 (bench/results/batch-rows-xeon.md, before the stripes). 32 rows
#: (bench/results/batch-rows32-xeon.md, against 16) is what ``bench_serve`` and ``transformers serve`` run at. Not 64:
#: the 1.1B decoded slower at batch 64 than prepacked oneDNN (tp=1 25.2 against 27.5 tokens/s, tp=2 20.1 against 44.2;
#: bench/results/batch64-rows-xeon.md, one round), its ranks waiting on each other for seconds per step.
MAX_ROWS = 32
#: the most rows the lean path runs through this kernel on bf16 weights with bf16 activations (``--dtype
#: bfloat16``: the general loop, no row step): on the 1.1B's shapes ours ran at 1.21-1.99x oneDNN's prepacked bf16
#: GEMM at 4 rows, 0.85x at 8, 0.46-0.70x at 16 (bench/results/gemv-xeon-rows-stripes-bf16.md; oneDNN packed for one
#: row then), so beyond 4 rows such decoders keep oneDNN. Against oneDNN packed for the rows (bench/results/
#: pack-hint-xeon.md) ours still led at 1 and 4 rows: 196 / 231 against 298 / 324 ms per 1.1B step's matmuls.
MAX_ROWS_BF16 = 4


def max_rows(dtype: torch.dtype) -> int:
    """The most input rows the lean path runs through this kernel for weights of ``dtype``:
    :data:`MAX_ROWS_BF16` for bf16 (bf16 x bf16), :data:`MAX_ROWS` otherwise."""
    return MAX_ROWS_BF16 if dtype == torch.bfloat16 else MAX_ROWS


def mode(dtype: torch.dtype, rows: int) -> int:
    """The kernel mode for ``rows`` input rows of ``dtype``: one weight row at a time (bf16: ``vdpbf16ps`` on the
    bf16 input) at every row count. Measured at one row, one thread, weights from memory (bench/bench_gemv.py,
    bench/results/gemv-bf16.md, bench/gemv_probe.cpp; the 1.1B Llama's and SmolLM2's shapes; docs/decode.md): the
    widened weights (:data:`MODE_WIDEN`, for an fp32 input) read at 0.9-1.15x ``vdpbf16ps``'s rate up to 2048
    inputs, within the loaded runs' noise, but at 0.6-0.8 of it at the 1.1B's down projection (5632 inputs): the
    input in fp32 (22 KB, read twice per weight byte) no longer stays in the 32 KB L1 cache beside the weights
    streaming through it (the probe reading the same weights against an 8 KB input ran at ``vdpbf16ps``'s rate).
    Two weight rows at a time was not faster at 2 rows (bench/results/gemv.md). AVX2 (no ``vdpbf16ps``: mode 0
    widens both operands in registers): the widened weights with an fp32 input ran at 1.0-1.06x mode 0 at one row
    (bench/results/gemv-avx2.md, loaded), within the run's noise, so mode 0 stays the default there too."""
    return MODE_ONE_ROW


_mode = mode


def pick_target(targets):
    """The first ``(name, features, flags)`` of ``targets`` whose features /proc/cpuinfo lists, or None."""
    return next((t for t in targets if _cpu_has_features(t[1])), None)


def target() -> str | None:
    """The name of the build of :data:`TARGETS` this CPU runs (``"avx512"``, ``"avx2"``), None where neither; says
    nothing of whether it built (:func:`available`)."""
    t = pick_target(TARGETS)
    return None if t is None else t[0]


@lru_cache(maxsize=1)
def _lib():
    lib = load_target(pick_target(TARGETS), _SRC, _FLAGS, "gemv", "TENSORPAR_GEMV_KERNEL")
    if lib is None:
        return None
    lib.tp_gemv.restype = None
    lib.tp_gemv.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                            ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                            ctypes.c_int64]
    for f in (lib.tp_gemv_bf16w, lib.tp_gemv_bf16w_blocked, lib.tp_gemv_bf16_blocked):
        f.restype = None
        f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
    lib.tp_unblock_bf16.restype = None
    lib.tp_unblock_bf16.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return lib


def address(name: str) -> int:
    """The address of the library's function ``name`` (``tp_gemv``, ``tp_gemv_bf16w``, ``tp_gemv_bf16w_blocked``),
    for a program that calls it from C (:func:`tensorpar.decode.fused.program`); the library stays loaded."""
    return ctypes.cast(getattr(_lib(), name), ctypes.c_void_p).value


def available() -> bool:
    """Whether this process can run the kernel (the CPU features of one of :data:`TARGETS`, a compiler,
    ``TENSORPAR_GEMV_KERNEL`` not ``0``)."""
    return _lib() is not None


def supports(w: torch.Tensor) -> bool:
    """Whether :func:`gemv` takes weight ``w``: a contiguous 2-D fp32 or bf16 CPU tensor, and :func:`available`."""
    return (w.device.type == "cpu" and w.dim() == 2 and w.dtype in _DTYPES and w.is_contiguous()
            and available())


def gemv_raw(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, *, mode: int | None = None,
             prefetch: int = PREFETCH, threads: int | None = None) -> torch.Tensor:
    """:func:`gemv` with the kernel's settings given (bench/bench_gemv.py). ``x`` ``[M, K]``, ``w`` ``[N, K]``,
    ``bias`` ``[N]`` or None, all of ``w``'s dtype -> ``[M, N]``."""
    M, K = x.shape
    N = w.shape[0]
    if w.shape[1] != K or x.dtype != w.dtype or (bias is not None and (bias.dtype != w.dtype or bias.numel() != N)):
        raise ValueError(f"gemv: x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}, bias "
                         f"{None if bias is None else (tuple(bias.shape), bias.dtype)}: takes x [M, K], w [N, K], "
                         f"bias [N], one dtype (float32 or bfloat16)")
    x, w = x.contiguous(), w.contiguous()
    b = bias.contiguous() if bias is not None else None
    y = torch.empty(M, N, dtype=w.dtype)
    _lib().tp_gemv(_DTYPES[w.dtype], _mode(w.dtype, M) if mode is None else mode, x.data_ptr(), M, K, w.data_ptr(), N,
                   b.data_ptr() if b is not None else None, y.data_ptr(),
                   torch.get_num_threads() if threads is None else threads, prefetch)
    return y


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`gemv` without the custom op's dispatch and :func:`gemv_raw`'s checks (about 45 us less per call, 89
    calls per token for the 1.1B Llama): what the lean path calls, eagerly, on weights it checked with
    :func:`supports`. ``x`` ``[M, K]`` of ``w``'s dtype, ``w`` ``[N, K]`` contiguous, ``bias`` ``[N]`` or None."""
    x = x.contiguous()
    b = None if bias is None else bias.contiguous()                 # kept alive while the kernel reads it
    y = torch.empty(x.shape[0], w.shape[0], dtype=w.dtype)
    _lib().tp_gemv(_DTYPES[w.dtype], _mode(w.dtype, x.shape[0]), x.data_ptr(),
                   x.shape[0], x.shape[1], w.data_ptr(), w.shape[0],
                   None if b is None else b.data_ptr(), y.data_ptr(), torch.get_num_threads(), PREFETCH)
    return y


class BlockedWeight(NamedTuple):
    """An fp32 weight ``W`` ``[n, in]`` held only in the kernel's blocked layout: ``p`` ``[ceil(n / BLOCK), in,
    BLOCK]`` (:func:`block`), ``p[i, k, j] = W[i * BLOCK + j, k]``, the last block's rows past ``n`` zero. Every
    block of 32 output rows is one sequential stream of ``in x BLOCK`` floats, read k after k: per input value the
    block's 32 weights are two AVX-512 vectors (four AVX2 ones), multiplied by the broadcast input into output
    vectors (the outer-product form of a GEMM's micro-kernel: no horizontal sums, up to 12 input rows per pass).
    Each output is summed in one lane from ``k = 0`` up by fma, so a row's outputs are bitwise the same at every row
    count and thread split; against ``F.linear`` they differ in the order of the sums (within 1e-5 relative at the
    decode shapes: the probe of :func:`tensorpar.decode.matmuls.use_blocked`). ``shape``, ``dtype`` and ``device``
    are those of ``W``."""
    p: torch.Tensor
    n: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.n, self.p.shape[1]))

    @property
    def dtype(self) -> torch.dtype:
        return self.p.dtype

    @property
    def device(self) -> torch.device:
        return self.p.device

    def dense(self) -> torch.Tensor:
        """``W`` ``[n, in]`` (a new tensor, bit for bit the weight that was blocked)."""
        return unblock(self.p, self.n)

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        """Rows ``idx`` (any shape, values in ``[0, n)``) of ``W`` -> ``[*idx.shape, in]`` (a tied embedding's
        lookup: each row ``in`` floats 32 apart)."""
        return self.p[idx // BLOCK, :, idx % BLOCK]

    def stored_bytes(self) -> int:
        return self.p.numel() * self.p.element_size()


def blockable(w) -> bool:
    """Whether :func:`block` applies to ``w``: a 2-D contiguous fp32 CPU tensor, with the kernel
    :func:`available`."""
    return (isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype == torch.float32 and w.device.type == "cpu"
            and w.is_contiguous() and w.shape[0] > 0 and w.shape[1] > 0 and available())


def block(w: torch.Tensor) -> torch.Tensor:
    """``w`` ``[n, K]`` fp32 reordered into ``[ceil(n / BLOCK), K, BLOCK]`` (a new tensor; the rows past ``n``
    zero: at most ``BLOCK - 1`` rows more than ``w``): the layout :class:`BlockedWeight` holds and ``tp_gemv`` mode
    3 reads. Exact (:func:`unblock` gives ``w`` back)."""
    n, k = w.shape
    nb = -(-n // BLOCK)
    w = w.detach()
    if nb * BLOCK != n:
        w = torch.cat([w, w.new_zeros(nb * BLOCK - n, k)])
    return w.reshape(nb, BLOCK, k).transpose(1, 2).contiguous()


def unblock(p: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of :func:`block`: ``[ceil(n / BLOCK), K, BLOCK]`` -> ``[n, K]`` (a new contiguous tensor)."""
    w = p.transpose(1, 2).contiguous().view(p.shape[0] * p.shape[2], p.shape[1])   # (a single block: no copy
    return w if w.shape[0] == n else w[:n].clone()      # without .contiguous()); a storage of its own rows only


def blocked_linear(x: torch.Tensor, w: BlockedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for ``x`` ``[M, K]`` fp32 and ``W`` held as ``w`` (:class:`BlockedWeight`), any
    ``M``, on ``torch.get_num_threads()`` threads -> ``[M, N]`` fp32. Sums as :class:`BlockedWeight` says."""
    if (x.dtype != torch.float32 or x.dim() != 2 or x.shape[-1] != w.p.shape[1]
            or bias is not None and tuple(bias.shape) != (w.n,)):
        raise ValueError(f"blocked_linear: x {tuple(x.shape)} {x.dtype}, bias "
                         f"{None if bias is None else tuple(bias.shape)} against a blocked fp32 weight "
                         f"{tuple(w.shape)}: takes fp32 x [M, {w.p.shape[1]}] and a bias [{w.n}] or None")
    x = x.contiguous()
    b = None if bias is None else bias.float().contiguous()         # kept alive while the kernel reads it
    y = torch.empty(x.shape[0], w.n, dtype=torch.float32)
    _lib().tp_gemv(0, MODE_BLOCKED, x.data_ptr(), x.shape[0], x.shape[1], w.p.data_ptr(), w.n,
                   None if b is None else b.data_ptr(), y.data_ptr(), torch.get_num_threads(), 0)
    return y


def into_args(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, threads: int | None = None,
              bias: torch.Tensor | None = None) -> tuple:
    """The kernel's arguments for ``y = x @ w.T + bias`` into a preallocated ``y`` (``x`` ``[M, K]``, ``w``
    ``[N, K]``, ``y`` ``[M, N]``, ``bias`` ``[N]`` or None, contiguous, one dtype, :func:`supports` (w)), for
    :func:`linear_into`: the addresses are taken once, so ``x``, ``y`` and ``bias`` must stay the tensors the caller
    keeps (the one-row decode step's buffers, a module's bias). ``threads``: default ``torch.get_num_threads()``
    now. Bitwise :func:`linear`'s result; ``w`` may be a :class:`BlockedWeight` (fp32; bitwise
    :func:`blocked_linear`'s result). Raises ValueError on other shapes or dtypes."""
    M, K = x.shape
    N = w.shape[0]
    if isinstance(w, BlockedWeight):
        if (w.shape[1] != K or tuple(y.shape) != (M, N) or x.dtype != torch.float32 or y.dtype != torch.float32
                or not (x.is_contiguous() and y.is_contiguous()) or not _bias_ok(bias, N, torch.float32)):
            raise ValueError(f"gemv into (blocked): x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)}, y "
                             f"{tuple(y.shape)} {y.dtype}: takes contiguous fp32 x [M, K], y [M, N], bias [N]")
        return (0, MODE_BLOCKED, x.data_ptr(), M, K, w.p.data_ptr(), N, None if bias is None else bias.data_ptr(),
                y.data_ptr(), torch.get_num_threads() if threads is None else threads, 0)
    if (w.shape[1] != K or tuple(y.shape) != (M, N) or not (x.dtype == w.dtype == y.dtype) or w.dtype not in _DTYPES
            or not all(t.is_contiguous() for t in (x, w, y)) or not _bias_ok(bias, N, w.dtype)):
        raise ValueError(f"gemv into: x {tuple(x.shape)}, w {tuple(w.shape)}, y {tuple(y.shape)}, bias "
                         f"{None if bias is None else tuple(bias.shape)}: takes contiguous x [M, K], w [N, K], "
                         f"y [M, N], bias [N] of one dtype (float32 or bfloat16)")
    return (_DTYPES[w.dtype], _mode(w.dtype, M), x.data_ptr(), M, K, w.data_ptr(), N,
            None if bias is None else bias.data_ptr(), y.data_ptr(),
            torch.get_num_threads() if threads is None else threads, PREFETCH)


def _bias_ok(bias: torch.Tensor | None, n: int, dtype: torch.dtype) -> bool:
    return bias is None or (tuple(bias.shape) == (n,) and bias.dtype == dtype and bias.is_contiguous()
                            and bias.device.type == "cpu")


def linear_into(args: tuple) -> None:
    """:func:`linear` into a preallocated output with the arguments :func:`into_args` prepared: no allocation, no
    per-call checks (the lean path's one-row decode step, :mod:`tensorpar.decode.row_step`)."""
    _lib().tp_gemv(*args)


def bf16w_into_args(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, threads: int | None = None,
                    bias: torch.Tensor | None = None, n: int | None = None, k: int | None = None) -> tuple:
    """:func:`into_args` for bf16 weights computing in fp32 (``--quantize bf16``): ``x`` ``[M, K]`` float32, ``w``
    ``[N, K]`` bfloat16, ``y`` ``[M, N]`` float32, contiguous CPU tensors; the weights widened to fp32 as
    :data:`MODE_WIDEN` does, ``y`` not rounded to bf16 (fp32 sums in another order than ``F.linear(x, w.float())``:
    within 1e-5 relative of it; ``bias`` ``[N]`` float32 or None, as :func:`bf16w_linear` adds it). ``n`` given:
    ``w`` is ``N = n`` rows in the bf16 blocked layout of :func:`~tensorpar.decode.bf16_weights.block_bf16`
    (``[ceil(n / BLOCK), K + K % 2, BLOCK]``; ``k``: the weight's inputs where the layout padded an odd count, else
    ``w.shape[1]``; ``K`` must equal it), for :func:`bf16w_blocked_linear_into`; else for :func:`bf16w_linear_into`.
    Raises ValueError on other shapes or dtypes."""
    M, K = x.shape if x.dim() == 2 else (-1, -1)
    N = w.shape[0] if n is None else n
    kin = k if k is not None else (w.shape[1] if w.dim() == 3 else -1)      # the blocked weight's inputs
    shape_ok = (w.dim() == 2 and w.shape[1] == K if n is None else isinstance(n, int) and n > 0 and K == kin
                and w.dim() == 3 and tuple(w.shape) == (-(-n // BLOCK), K + K % 2, BLOCK))
    if (not shape_ok or tuple(y.shape) != (M, N) or x.dtype != torch.float32 or y.dtype != torch.float32
            or w.dtype != torch.bfloat16 or not all(t.is_contiguous() and t.device.type == "cpu" for t in (x, w, y))
            or not _bias_ok(bias, N, torch.float32)):
        raise ValueError(f"gemv bf16w into: x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype} (n {n}, k {k}), "
                         f"y {tuple(y.shape)} {y.dtype}: takes contiguous CPU x [M, K] float32, w [N, K] bfloat16 "
                         f"(or [ceil(n / {BLOCK}), K + K % 2, {BLOCK}] blocked with n = N), y [M, N] float32")
    return (x.data_ptr(), M, K, w.data_ptr(), N, None if bias is None else bias.data_ptr(), y.data_ptr(),
            torch.get_num_threads() if threads is None else threads, PREFETCH)


def bf16w_linear_into(args: tuple) -> None:
    """The bf16-weight, fp32-activation GEMV into a preallocated output, with :func:`bf16w_into_args`' arguments."""
    _lib().tp_gemv_bf16w(*args)


def bf16w_blocked_linear_into(args: tuple) -> None:
    """:func:`bf16w_linear_into` on the bf16 blocked layout (:func:`bf16w_into_args` with ``n``)."""
    _lib().tp_gemv_bf16w_blocked(*args)


def bf16_blocked_linear_into(args: tuple) -> None:
    """A bf16 model's matmul on the bf16 blocked layout into a preallocated fp32 output (:func:`bf16w_into_args`
    with ``n``; ``x``'s fp32 values must be bf16 values, read as their upper 16 bits): ``vdpbf16ps`` on pairs of
    inputs where the CPU has AVX512_BF16 (the fp32 sums in pairs, denormals read as zero), else bitwise
    :func:`bf16w_blocked_linear_into`; ``y`` the fp32 sums plus bias, not rounded."""
    _lib().tp_gemv_bf16_blocked(*args)


def bf16w_blocked_linear(x: torch.Tensor, p: torch.Tensor, n: int, bias: torch.Tensor | None,
                         k: int | None = None) -> torch.Tensor:
    """``F.linear(x, W.float(), bias)`` -> ``[M, n]`` float32 for ``x`` ``[M, K]`` float32, ``W`` ``[n, K = k]`` bf16
    held as ``p`` in the bf16 blocked layout (:func:`~tensorpar.decode.bf16_weights.block_bf16`), any ``M``, on
    ``torch.get_num_threads()`` threads; bitwise :func:`blocked_linear` on ``W.float()`` blocked."""
    return _bf16w_call(x, p, n, bias, n, k=k)


def bf16_blocked_linear(x: torch.Tensor, p: torch.Tensor, n: int, bias: torch.Tensor | None,
                        k: int | None = None) -> torch.Tensor:
    """A bf16 model's matmul, :func:`bf16w_blocked_linear`'s arguments with ``x`` bfloat16: the fp32 sums of
    :func:`bf16_blocked_linear_into` (the caller rounds them to bf16 once, as oneDNN's bf16 GEMM rounds its sums)."""
    return _bf16w_call(x.float(), p, n, bias, n, bf16_blocked_linear_into, k)


def _bf16w_call(x, w, rows: int, bias, n, run=None, k=None):     # y [M, rows] of x [M, K], checked by bf16w_into_args
    x = x.contiguous() if x.dim() == 2 else x
    b = None if bias is None else bias.float().contiguous()         # kept alive while the kernel reads it
    y = torch.empty(x.shape[0] if x.dim() == 2 else 0, max(0, rows) if isinstance(rows, int) else 0,
                    dtype=torch.float32)
    run = run or (bf16w_linear_into if n is None else bf16w_blocked_linear_into)
    run(bf16w_into_args(x, w, y, bias=b, n=n, k=k))
    return y


def bf16w_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, w.float(), bias)`` for ``x`` ``[M, K]`` float32, ``w`` ``[N, K]`` bfloat16 contiguous (CPU,
    :func:`available`), ``bias`` ``[N]`` float32 or None -> ``[M, N]`` float32, without the fp32 copy of ``w``:
    the weights widened in registers (sums in fp32 in another order: within 1e-5 relative of it)."""
    return _bf16w_call(x, w, w.shape[0] if w.dim() == 2 else 0, bias, None)


@torch.library.custom_op("tensorpar::gemv", mutates_args=())
def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` for ``x`` ``[M, K]``, ``w`` ``[N, K]`` (plain row-major), ``bias`` ``[N]`` or None,
    one dtype, float32 or bfloat16 (CPU) -> ``[M, N]``: sums in fp32 in another order than oneDNN/MKL (fp32: within
    1e-5 relative of ``F.linear``; bf16: the fp32 sum rounded to bf16 once, so within one bf16 rounding of it).
    Runs on ``torch.get_num_threads()`` threads. Requires :func:`supports` (w)."""
    return gemv_raw(x, w, bias)


@gemv.register_fake
def _(x, w, bias):
    return x.new_empty(x.shape[0], w.shape[0])
