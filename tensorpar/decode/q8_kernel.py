"""Our int8 x int8 matmul with blockwise scales (csrc/q8_linear.cpp), built once per machine and registered as the
torch custom op ``tensorpar::q8_linear`` so a compiled step can call it.

Why our own kernel: the library int8 kernels of torch 2.13 (CPU) take per-output-channel weight scales, none takes
a scale per block of 32 inputs: ``torch._weight_int8pack_mm`` (bf16 activations, weight-only: it converts every
weight to bf16), ``torch.ops.quantized.linear_dynamic`` (fbgemm; one activation scale per tensor) and
``torch.ops.onednn.qlinear_pointwise`` (static activation scales). bench/bench_int8.py measures them at the 1.1B
decode shapes against this kernel (bench/results/decode_int8.md).

Build: ``g++ -O3 <target flags> -ffp-contract=off -fopenmp -shared`` of the one C++ file (no torch headers: about a
second), for the first of :data:`TARGETS` whose features /proc/cpuinfo lists: AVX512-VNNI (``-mavx512f -mavx512bw
-mavx512vl -mavx512vnni -mf16c``; the int8 products on vpdpbusd) or AVX2 (``-mavx2 -mfma -mf16c``; the products on
vpmaddubsw / vpmaddwd, as ggml's AVX2 Q8_0 dot product). Both targets sum the same exact int32 lane sums in the same
fp32 order, so they give bitwise the same result (csrc/q8_linear.cpp's header). The library goes into torch's
extension cache (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) under a name carrying the target
and a hash of the source and flags, written atomically; loaded with ctypes. Used only where a target's features are
listed and the build succeeded (:func:`available`); elsewhere (no compiler, a CPU without AVX2, CUDA)
:func:`tensorpar.decode.int8.int8_linear` runs the same math in PyTorch.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch

from tensorpar.native import cpu_has_features, load_kernel

_SRC = Path(__file__).with_name("csrc") / "q8_linear.cpp"
_COMMON = ("-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
#: the kernel's build targets, best first: ``(name, compiler flags, /proc/cpuinfo flags the CPU must list)``
TARGETS = (("avx512vnni", ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c"),
            ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c")),
           ("avx2", ("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c")))
#: the AVX512-VNNI target's features (the default of :func:`_cpu_has_features`)
_FEATURES = TARGETS[0][2]


def _cpu_has_features(features=_FEATURES) -> bool:
    """Whether this CPU lists ``features`` (:func:`tensorpar.native.cpu_has_features`; tests replace this one)."""
    return cpu_has_features(features)


def target() -> str | None:
    """The name of the first of :data:`TARGETS` whose features this CPU lists (``None``: none; the kernel's build
    and ``TENSORPAR_Q8_KERNEL`` are not looked at)."""
    return next((name for name, _, features in TARGETS if _cpu_has_features(features)), None)


@lru_cache(maxsize=None)
def _lib_of(name: str):
    """The ctypes library of target ``name`` (of :data:`TARGETS`), or None where it cannot run (see
    :func:`load_kernel`)."""
    _, flags, features = next(t for t in TARGETS if t[0] == name)
    lib = load_kernel(_SRC, [*flags, *_COMMON], f"q8_{name}", features, "TENSORPAR_Q8_KERNEL")
    if lib is None:
        return None
    lib.tp_q8_target.restype = ctypes.c_char_p
    lib.tp_q8_target.argtypes = []
    lib.tp_q8_linear.restype = None
    lib.tp_q8_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.tp_q8_linear_into.restype = None
    lib.tp_q8_linear_into.argtypes = lib.tp_q8_linear.argtypes + [ctypes.c_void_p]
    lib.tp_q8_scratch_bytes.restype = ctypes.c_int64
    lib.tp_q8_scratch_bytes.argtypes = [ctypes.c_int64, ctypes.c_int64]
    return lib


@lru_cache(maxsize=1)
def _lib():
    """The library of this CPU's best target (:func:`target`), or None."""
    name = target()
    return None if name is None else _lib_of(name)


def address(name: str) -> int:
    """The address of the library's function ``name`` (``tp_q8_linear_into``), for a program that calls it from C
    (:func:`tensorpar.decode.fused.program`); the library stays loaded."""
    return ctypes.cast(getattr(_lib(), name), ctypes.c_void_p).value


def available() -> bool:
    """Whether this process can run the kernel (the CPU features of one of :data:`TARGETS`, a compiler,
    ``TENSORPAR_Q8_KERNEL`` not ``0``)."""
    return _lib() is not None


def scratch(rows: int, k: int) -> torch.Tensor:
    """The activation-quantization scratch of :func:`into_args` for up to ``rows`` input rows of up to ``k``
    features (``k % 32 == 0``): a uint8 CPU tensor (``|xq|``, the sign masks and the scales of each row). One may
    serve several matmuls run one after the other. Requires :func:`available`."""
    return torch.zeros(int(_lib().tp_q8_scratch_bytes(rows, k)), dtype=torch.uint8)


def into_args(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, y: torch.Tensor, scratch: torch.Tensor,
              threads: int | None = None, bias: torch.Tensor | None = None) -> tuple:
    """The kernel's arguments for ``y = q8_linear(x, q, scale, bias)`` (``bias`` ``[N]`` float32 or None) into a
    preallocated ``y`` (``x`` ``[M, K]``
    float32, ``q`` ``[N, K]`` int8, ``scale`` ``[N, K / 32]`` float16, ``y`` ``[M, N]`` float32, all contiguous
    CPU tensors; ``scratch`` from :func:`scratch` for at least ``M`` rows of ``K``), for :func:`linear_into`: the
    addresses are taken once, so ``x``, ``y`` and ``scratch`` must stay the tensors the caller reuses (the one-row
    decode step's buffers, :mod:`tensorpar.decode.row_step`). ``threads``: default ``torch.get_num_threads()`` now.
    Raises ValueError on other shapes or dtypes."""
    M, K = x.shape
    N = q.shape[0]
    ok = (q.shape[1] == K and K % 32 == 0 and tuple(scale.shape) == (N, K // 32) and tuple(y.shape) == (M, N)
          and x.dtype == y.dtype == torch.float32 and q.dtype == torch.int8 and scale.dtype == torch.float16
          and scratch.dtype == torch.uint8 and all(t.is_contiguous() and t.device.type == "cpu"
                                                   for t in (x, q, scale, y, scratch))
          and (bias is None or (tuple(bias.shape) == (N,) and bias.dtype == torch.float32 and bias.is_contiguous()
                                and bias.device.type == "cpu")))
    if not ok or scratch.numel() < _lib().tp_q8_scratch_bytes(M, K):
        raise ValueError(f"q8 into: x {tuple(x.shape)} {x.dtype}, q {tuple(q.shape)} {q.dtype}, scale "
                         f"{tuple(scale.shape)} {scale.dtype}, y {tuple(y.shape)} {y.dtype}, scratch "
                         f"{scratch.numel()} bytes: takes contiguous CPU x [M, K] float32, q [N, K] int8, scale "
                         f"[N, K/32] float16, y [M, N] float32, K % 32 == 0, scratch(M, K)")
    return (x.data_ptr(), M, K, q.data_ptr(), scale.data_ptr(), N, None if bias is None else bias.data_ptr(),
            y.data_ptr(), torch.get_num_threads() if threads is None else threads, scratch.data_ptr())


def linear_into(args: tuple) -> None:
    """:func:`q8_linear` into a preallocated output with the arguments :func:`into_args` prepared: no allocation,
    no per-call checks (the same kernel and activation quantization: bitwise :func:`q8_linear`'s result)."""
    _lib().tp_q8_linear_into(*args)


@torch.library.custom_op("tensorpar::q8_linear", mutates_args=())
def q8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` ``[M, K]`` float32 (CPU), ``q`` ``[N, K]`` int8, ``scale`` ``[N, K/32]`` float16, ``bias`` ``[N]``
    float32 or None -> ``[M, N]`` float32: ``x`` quantized per row and block of 32 (absmax / 127, round half to
    even), int8 dot products per block, times both scales, summed in fp32 (see the module docstring). Runs on
    ``torch.get_num_threads()`` threads. Requires :func:`available`."""
    M, K = x.shape
    N = q.shape[0]
    x, q, scale = x.contiguous(), q.contiguous(), scale.contiguous()
    y = torch.empty(M, N, dtype=torch.float32)
    b = bias.contiguous() if bias is not None else None
    _lib().tp_q8_linear(x.data_ptr(), M, K, q.data_ptr(), scale.data_ptr(), N,
                        b.data_ptr() if b is not None else None, y.data_ptr(), torch.get_num_threads())
    return y


@q8_linear.register_fake
def _(x, q, scale, bias):
    return x.new_empty(x.shape[0], q.shape[0])
