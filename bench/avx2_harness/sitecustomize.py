"""A verification harness for a CPU without AVX-512 (not used by tensorpar itself): with ``TP_AVX2_HARNESS=1`` and
this folder on ``PYTHONPATH``, every Python process (pytest, its rank workers, the bench scripts' fresh processes)
builds ``tensorpar/decode/csrc/step.cpp`` for AVX2 (same ``-ffp-contract=off``) and ``fake_gemv.cpp``, a plain fp32
GEMV with the signature of ``csrc/gemv.cpp``, in place of the AVX-512 GEMV; the int8 kernel stays off. The lean
path's row step then runs here, so its tests and its framework work can be checked (its GEMV times are the
stand-in's, not the real kernel's):

    TP_AVX2_HARNESS=1 PYTHONPATH=bench/avx2_harness:. python -m pytest tests/decode/test_row_step.py
    TP_AVX2_HARNESS=1 PYTHONPATH=bench/avx2_harness:. python bench/bench_step_overhead.py --before OLD_CHECKOUT

(bench/results/step_overhead-standin.md was measured so.) The libraries are cached beside the real ones under
other names (``*_harness_*``)."""
import os

if os.environ.get("TP_AVX2_HARNESS"):
    import ctypes
    from pathlib import Path

    import tensorpar.decode.q8_kernel as q8

    HERE = Path(__file__).parent

    def load_kernel(src_path, flags, name, features, env):
        if os.environ.get(env, "1") == "0":
            return None
        if name == "gemv":
            src_path, flags = HERE / "fake_gemv.cpp", ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-shared",
                                                        "-fPIC", "-std=c++17"]
        elif name == "step":
            flags = [f for f in flags if not f.startswith("-mavx512")] + ["-mavx2"]
        else:
            return None
        path = q8._build(Path(src_path), flags, name + "_harness")
        return None if path is None else ctypes.CDLL(str(path))

    q8.load_kernel = load_kernel
