"""One Q8_0 x Q8_0 matmul at decode shapes, one thread: our kernel against the PyTorch path and llama.cpp's Q8_0.

Rows per shape (``M`` input rows of ``K`` features, a weight of ``N`` x ``K`` int8 with one fp16 scale per block of
32, weights cycled through >= ``--mb`` megabytes so each call reads them from memory):

* ours, the C ABI (bench/q8_probe.cpp: tensorpar/decode/csrc/q8_linear.cpp built for this CPU's target,
  :data:`tensorpar.decode.q8_kernel.TARGETS`, called in a C loop);
* llama.cpp's Q8_0 (the same probe linked to the ggml of ``--llama-python``'s ``llama_cpp`` package: GGML_OP_MUL_MAT
  of a Q8_0 weight and an fp32 input with a 1-thread threadpool, as llama.cpp's decode runs it), on the same weights;
  the probe also reports the largest output difference to ours relative to the largest output (llama.cpp rounds the
  activation scales to fp16);
* ours through Python, as the row step calls it (:func:`tensorpar.decode.q8_kernel.linear_into` of prepared
  arguments) and as the general loop does (:func:`tensorpar.decode.int8.int8_linear`, the torch custom op);
* the PyTorch path (:func:`tensorpar.decode.int8.int8_linear_reference`, what ``--quantize int8`` runs without the
  kernel).

µs per call (best of ``--reps`` sweeps over the copies; wall and thread CPU time) and GB/s of the weight bytes
(34 per 32 weights). Writes ``<out>.json`` / ``<out>.md`` with the CPU model and the load average at start and end.

    PYTHONPATH=. python bench/bench_q8_kernel.py [--llama-python ~/.cache/tensorpar/llamacpp-venv/bin/python]
        [--reps 5] [--mb 160] [--out bench/results/q8_kernel]     # --render: rewrite the .md from the .json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
#: ``(name, K, N)``: the 1.1B Llama's (TinyLlama: hidden 2048, MLP 5632) and SmolLM2-135M's (hidden 576, 9 q / 3 KV
#: heads of 64, MLP 1536, vocabulary 49152) decode matmuls at tp=1
SHAPES = [("1.1B o_proj", 2048, 2048), ("1.1B gate or up", 2048, 5632), ("1.1B down_proj", 5632, 2048),
          ("SmolLM2 o_proj", 576, 576), ("SmolLM2 q/k/v", 576, 960), ("SmolLM2 gate/up", 576, 3072),
          ("SmolLM2 down_proj", 1536, 576), ("SmolLM2 LM head", 576, 49152)]
ROWS = (1, 4)


def ggml_dir(llama_python: str) -> Path | None:
    """The folder of the ``llama_cpp`` package's ggml (``include/`` and ``lib/`` beside it) in the interpreter
    ``llama_python``, or None."""
    try:
        r = subprocess.run([llama_python, "-c", "import llama_cpp, os; print(os.path.dirname(llama_cpp.__file__))"],
                           capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    if r.returncode != 0:
        return None
    site = Path(r.stdout.strip()).parent
    return site if (site / "include" / "ggml.h").exists() and (site / "lib").is_dir() else None


def run_probe(target: str, ggml: Path | None, reps: int, mb: float, tmp: Path) -> list[dict]:
    """Build bench/q8_probe.cpp for ``target`` (with ggml if given) and run it on :data:`SHAPES` x :data:`ROWS`."""
    from tensorpar.decode import q8_kernel
    flags = next(f for name, f, _ in q8_kernel.TARGETS if name == target)
    exe = tmp / "q8_probe"
    cmd = ["g++", *flags, "-O3", "-ffp-contract=off", "-fopenmp", "-std=c++17", str(ROOT / "bench" / "q8_probe.cpp"),
           "-o", str(exe)]
    if ggml is not None:
        cmd += ["-DWITH_GGML", f"-I{ggml / 'include'}", f"-L{ggml / 'lib'}", "-lggml-cpu", "-lggml-base",
                f"-Wl,-rpath,{ggml / 'lib'}"]
    subprocess.run(cmd, check=True, capture_output=True)
    args = [str(exe), str(reps), str(mb)]
    for _, k, n in SHAPES:
        for m in ROWS:
            args += [str(m), str(k), str(n)]
    r = subprocess.run(args, check=True, capture_output=True, text=True)
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


def time_python(reps: int, mb: float, reference_mb: float) -> list[dict]:
    """Ours through Python (linear_into, the custom op) and the PyTorch path, one thread, per shape and rows."""
    from tensorpar.decode import q8_kernel
    from tensorpar.decode.int8 import Int8Weight, int8_linear, int8_linear_reference
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    rows = []
    for name, k, n in SHAPES:
        nbytes = n * k * 34 / 32
        copies = max(2, int(mb * 1e6 / nbytes))
        ws = [Int8Weight(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8),
                         (torch.rand(n, k // 32, generator=g) * 2e-4).half(), torch.float32) for _ in range(copies)]
        for m in ROWS:
            x = torch.randn(m, k, generator=g)
            y = torch.empty(m, n)
            cands = {}
            if q8_kernel.available():
                scratch = q8_kernel.scratch(m, k)
                args = [q8_kernel.into_args(x, w.q, w.scale, y, scratch, 1) for w in ws]
                cands["ours via linear_into (row step)"] = (lambda i: q8_kernel.linear_into(args[i]), copies)
                cands["ours via int8_linear (torch op)"] = (lambda i: int8_linear(x, ws[i]), copies)
            # the PyTorch path is ~20x slower: fewer copies (it dequantizes each weight anyway, so from cache or not
            # matters little), at least 2
            cands["PyTorch path (int8_linear_reference)"] = (lambda i: int8_linear_reference(x, ws[i]),
                                                             max(2, int(reference_mb * 1e6 / nbytes)))
            for kname, (fn, cnt) in cands.items():
                fn(0)
                wall, cpu = [], []
                for _ in range(reps):
                    w0, c0 = time.perf_counter(), time.thread_time()
                    for i in range(cnt):
                        fn(i)
                    wall.append((time.perf_counter() - w0) / cnt)
                    cpu.append((time.thread_time() - c0) / cnt)
                wall.sort()
                cpu.sort()
                rows.append({"kernel": kname, "M": m, "K": k, "N": n, "copies": cnt,
                             "us_wall_best": wall[0] * 1e6, "us_wall_median": wall[len(wall) // 2] * 1e6,
                             "us_cpu_best": cpu[0] * 1e6, "us_cpu_median": cpu[len(cpu) // 2] * 1e6,
                             "gbs_wall_best": nbytes / wall[0] * 1e-9, "gbs_cpu_best": nbytes / cpu[0] * 1e-9})
        del ws
    return rows


def render(meta: dict, rows: list[dict]) -> list[str]:
    """The markdown of a run (``meta`` and ``rows`` as the json holds them)."""
    load_start, a_mb, a_reps = meta["load_start"], meta["mb"], meta["reps"]
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    by = {(r["kernel"], r["M"], r["K"], r["N"]): r for r in rows}
    lines = [f"# One Q8_0 x Q8_0 matmul, 1 thread: ours ({meta['target']}) vs the PyTorch path vs llama.cpp",
             "",
             f"CPU: {meta['cpu']} ({meta['cores']} cores), torch {meta['torch']}; load average at start "
             f"{' / '.join(f'{v:.2f}' for v in load_start)}, at end {' / '.join(f'{v:.2f}' for v in meta['load_end'])}"
             f"; weights cycled through >= {a_mb:g} MB per shape (from memory), best of {a_reps} sweeps. "
             f"Each cell: wall / thread-CPU µs per call, and GB/s of the weight bytes (34 per 32 weights) by CPU time "
             f"(on a loaded, shared machine a descheduled thread stops its CPU clock, not the wall clock). "
             f"'{meta['target']}' = our kernel called from C (bench/q8_probe.cpp); llama.cpp = ggml's mul_mat "
             f"of its Q8_0 (its build in the llama-cpp-python venv), the same weights; 'rel diff' = largest "
             f"|ours - llama.cpp| / largest |ours| (llama.cpp keeps the activation scales in fp16, we in fp32).",
             "", "| shape | M | K x N | " + " | ".join(kernels) + " | llama.cpp / ours (C), CPU time | rel diff |",
             "|---|---|---|" + "---|" * len(kernels) + "---|---|"]
    ours_c = meta["target"]
    for name, k, n in SHAPES:
        for m in ROWS:
            cells = []
            for kn in kernels:
                r = by.get((kn, m, k, n))
                cells.append(f"{r['us_wall_best']:.0f} / {r['us_cpu_best']:.0f} µs, {r['gbs_cpu_best']:.1f} GB/s"
                             if r else "-")
            o, g = by.get((ours_c, m, k, n)), by.get(("llama.cpp Q8_0 (ggml mul_mat)", m, k, n))
            ratio = f"{g['us_cpu_best'] / o['us_cpu_best']:.2f}x" if o and g else "-"
            diff = f"{g['max_rel_diff']:.1e}" if g else "-"
            lines.append(f"| {name} | {m} | {k} x {n} | " + " | ".join(cells) + f" | {ratio} | {diff} |")
    if max(meta["load_start"][0], meta["load_end"][0]) > meta["cores"]:
        lines.insert(0, f"**LOADED MACHINE: this run shared the CPUs with other work (1-minute load average "
                        f"{meta['load_start'][0]:.1f} at start, {meta['load_end'][0]:.1f} at end, on {meta['cores']} cores): "
                        f"wall times and bandwidths are not the machine's; the CPU-time columns and the ratios of "
                        f"interleaved candidates are the less disturbed figures.**")
        lines.insert(1, "")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--llama-python", default=str(Path.home() / ".cache/tensorpar/llamacpp-venv/bin/python"))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--mb", type=float, default=160.0, help="weights cycled per shape (> the 32 MB L3)")
    p.add_argument("--reference-mb", type=float, default=40.0, help="the PyTorch path's weights per shape")
    p.add_argument("--out", default="bench/results/q8_kernel")
    p.add_argument("--render", action="store_true", help="only rewrite <out>.md from <out>.json")
    a = p.parse_args()
    if a.render:
        data = json.loads(Path(a.out).with_suffix(".json").read_text())
        write_results(Path(a.out), data["meta"], data["rows"], render(data["meta"], data["rows"]))
        return
    from tensorpar.decode import q8_kernel
    meta = {**machine(), "target": q8_kernel.target(), "kernel_available": q8_kernel.available(), "reps": a.reps,
            "mb": a.mb, "torch": torch.__version__}
    load_start = os.getloadavg()
    ggml = ggml_dir(a.llama_python)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if meta["target"] is not None:
            rows += run_probe(meta["target"], ggml, a.reps, a.mb, Path(tmp))
    rows += time_python(a.reps, a.mb, a.reference_mb)
    meta.update(load_start=list(load_start), load_end=list(os.getloadavg()), ggml=ggml is not None)
    write_results(Path(a.out), meta, rows, render(meta, rows))


if __name__ == "__main__":
    main()
