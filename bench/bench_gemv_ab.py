"""Our blocked GEMV kernels of two checkouts side by side, interleaved in one process, one thread: the current
``tensorpar/decode/csrc/gemv.cpp`` against the one of ``--before`` (a checkout's folder), both compiled for this
CPU's best target (``gemv_kernel.TARGETS``), at a few input rows.

The 1.1B Llama's tp=2 matrices (QKV 1280 x 2048, O 2048 x 1024, gate-up 5632 x 2048, down 2048 x 2816), ``--copies``
random copies each so that the weights come from memory, through the three blocked entries: fp32
(``tp_gemv`` mode 3), bf16 weights with fp32 inputs (``tp_gemv_bf16w_blocked``) and a bf16 model's bf16 x bf16
(``tp_gemv_bf16_blocked``). Before timing, both builds' outputs are compared (bitwise: a kernel change that moves
the sums says so). Per kernel and row count: ms per layer (the four matrices), best and median over ``--reps``
interleaved repetitions (the order reversed every other one), and new / old.

    BEFORE=$(mktemp -d) && git archive <rev> | tar -x -C "$BEFORE"
    PYTHONPATH=.:bench python bench/bench_gemv_ab.py --before "$BEFORE" [--rows 1 2 4] [--out ...]
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from machine import cpu_account, cpu_model, describe, other_work, write_results  # noqa: E402
from tensorpar import native  # noqa: E402
from tensorpar.decode import bf16_weights, gemv_kernel  # noqa: E402

SHAPES = {"qkv": (1280, 2048), "o": (2048, 1024), "gate-up": (5632, 2048), "down": (2048, 2816)}
KINDS = ("fp32", "bf16 weights, fp32 inputs", "bf16 x bf16")
ENTRIES = ("tp_gemv", "tp_gemv_bf16w_blocked", "tp_gemv_bf16_blocked")


def load(src: Path, tag: str):
    """``src`` (a gemv.cpp) built for this CPU's target as its own library, its three blocked entries typed."""
    target = native.pick_target(gemv_kernel.TARGETS)
    if target is None:
        raise SystemExit("bench_gemv_ab: no target of gemv_kernel.TARGETS runs on this CPU")
    name, _, extra = target
    path = native.build(src, [*gemv_kernel._FLAGS, *extra], f"gemv_{name}")
    if path is None:
        raise SystemExit(f"bench_gemv_ab: {src} ({tag}) did not compile")
    lib = ctypes.CDLL(str(path))
    missing = [f for f in ENTRIES if not hasattr(lib, f)]
    if missing:
        raise SystemExit(f"bench_gemv_ab: {src} ({tag}) has no {', '.join(missing)} (a checkout from before "
                         "2026-12-04 late, f9dd250); give a newer one")
    v, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.tp_gemv.argtypes = [ctypes.c_int, ctypes.c_int, v, i64, i64, v, i64, v, v, ctypes.c_int, i64]
    for f in (lib.tp_gemv_bf16w_blocked, lib.tp_gemv_bf16_blocked):
        f.argtypes = [v, i64, i64, v, i64, v, v, ctypes.c_int, i64]
    return lib, target[0]


def layer(lib, kind: str, mats: dict, xs: dict, ys: dict, m: int, copies: int) -> float:
    """Seconds per layer (the four matrices of every copy once, divided by the copies)."""
    t0 = time.perf_counter()
    for c in range(copies):
        for k, (n, kk) in SHAPES.items():
            x, y, w = xs[k], ys[k], mats[k][c]
            if kind == "fp32":
                lib.tp_gemv(0, gemv_kernel.MODE_BLOCKED, x.data_ptr(), m, kk, w.data_ptr(), n, None, y.data_ptr(),
                            1, 0)
            else:
                f = lib.tp_gemv_bf16w_blocked if kind == "bf16 weights, fp32 inputs" else lib.tp_gemv_bf16_blocked
                f(x.data_ptr(), m, kk, w.data_ptr(), n, None, y.data_ptr(), 1, 0)
    return (time.perf_counter() - t0) / copies


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="the old checkout's folder (its tensorpar/decode/csrc/gemv.cpp)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--copies", type=int, default=6)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "gemv-ab"))
    a = p.parse_args()
    old_src = Path(a.before) / "tensorpar" / "decode" / "csrc" / "gemv.cpp"
    if not old_src.is_file():
        p.error(f"--before {a.before}: no tensorpar/decode/csrc/gemv.cpp there")
    if min(a.rows) < 1 or a.copies < 1 or a.reps < 1:
        p.error(f"--rows {a.rows} / --copies {a.copies} / --reps {a.reps}: each must be at least 1")
    torch.set_num_threads(1)
    libs = {"old": load(old_src, "old"), "new": load(gemv_kernel._SRC, "new")}
    g = torch.Generator().manual_seed(0)
    mats = {"fp32": {k: [gemv_kernel.block(torch.randn(n, kk, generator=g)) for _ in range(a.copies)]
                     for k, (n, kk) in SHAPES.items()}}
    mats["bf16 weights, fp32 inputs"] = mats["bf16 x bf16"] = {
        k: [bf16_weights.block_bf16(torch.randn(n, kk, generator=g).bfloat16()) for _ in range(a.copies)]
        for k, (n, kk) in SHAPES.items()}
    cpu0, rows, load0 = cpu_account(), [], list(os.getloadavg())
    for m in a.rows:
        xs = {k: torch.randn(m, kk, generator=g).bfloat16().float() for k, (_, kk) in SHAPES.items()}
        ys = {k: torch.empty(m, n) for k, (n, _) in SHAPES.items()}
        for kind in KINDS:
            outs = []
            for tag in ("old", "new"):
                layer(libs[tag][0], kind, mats[kind], xs, ys, m, 1)
                outs.append({k: y.clone() for k, y in ys.items()})
            same = all(torch.equal(outs[0][k], outs[1][k]) for k in SHAPES)
            times = {"old": [], "new": []}
            for r in range(a.reps):
                for tag in (("old", "new") if r % 2 == 0 else ("new", "old")):
                    times[tag].append(layer(libs[tag][0], kind, mats[kind], xs, ys, m, a.copies))
            row = {"rows": m, "kernel": kind, "bitwise_equal": same,
                   **{f"{t}_{s}_ms": f(times[t]) * 1e3 for t in ("old", "new")
                      for s, f in (("best", min), ("median", statistics.median))}}
            row["new_over_old"] = row["new_median_ms"] / row["old_median_ms"]
            rows.append(row)
            print(f"{m} rows, {kind}: old {row['old_median_ms']:.3f} new {row['new_median_ms']:.3f} ms/layer "
                  f"({row['new_over_old']:.3f}), bitwise equal {same}", flush=True)
    work = other_work(cpu0, cpu_account())
    sha = {t: hashlib.sha256(f.read_bytes()).hexdigest()[:12] for t, f in (("old", old_src), ("new", gemv_kernel._SRC))}
    meta = {"cpu": cpu_model(), "target": libs["new"][1], "before": Path(a.before).name, "gemv_cpp_sha256": sha,
            "copies": a.copies, "reps": a.reps, "torch": torch.__version__, "other_work": work,
            "load_start": load0, "load_end": list(os.getloadavg()),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    lines = [f"# Blocked GEMV kernels, this checkout against an older one ({meta['cpu']}, {meta['target']} build)", "",
             f"{meta['date']}; one thread; the 1.1B's tp=2 matrices, {a.copies} copies each (from memory); "
             f"{a.reps} interleaved repetitions; gemv.cpp sha256 old {sha['old']}, new {sha['new']}; load average "
             f"{load0[0]:.2f} at start, {meta['load_end'][0]:.2f} at end; {describe(work)}.", "",
             "| rows | kernel | old ms / layer (median / best) | new ms / layer (median / best) | new / old (median) "
             "| outputs bitwise equal |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['rows']} | {r['kernel']} | {r['old_median_ms']:.3f} / {r['old_best_ms']:.3f} | "
              f"{r['new_median_ms']:.3f} / {r['new_best_ms']:.3f} | {r['new_over_old']:.3f} | {r['bitwise_equal']} |"
              for r in rows]
    write_results(Path(a.out), meta, rows, lines)


if __name__ == "__main__":
    main()
