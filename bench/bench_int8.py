"""int8 decode (``--quantize int8``, Q8_0-style blocks) against fp32 and bf16, side by side in one run.

In one run this script

1. times the candidate int8 matmul kernels at the 1.1B random Llama's decode shapes (:func:`kernels`): our
   kernel (AVX512-VNNI or AVX2), the PyTorch path, ``torch._weight_int8pack_mm``, fbgemm's dynamic linear, fp32 and bf16 ``F.linear``,
   one thread, each call reading its weight from memory; GB/s by wall and by CPU time;
2. measures the memory bandwidth of 1 and of 2 processes (bench_decode.py's GEMV);
3. runs greedy decode of SmolLM2-135M (``--tokens`` new tokens, lean path, 1 thread per rank, each row in fresh
   processes): fp32 tp=1/2, int8 tp=1/2 (fp32 activations), bf16 tp=2, int8 with bf16 activations tp=1/2; each
   row's fraction of the roofline uses the bytes it reads per token (int8 rows: int8 weights + scales + norms);
4. perplexity of the lean path (tp=1) on bench_decode.py's held-out Shakespeare slice for fp32, int8, bf16 and
   int8 + bf16;
5. per-rank memory after loading SmolLM2 (fp32, int8 with fp32 activations, int8 with bf16 activations; tp 1 and
   2; fresh processes per row): the bytes of the distinct storages the model holds
   (:func:`tensorpar.decode.quantize.resident_weight_bytes`: parameters, buffers, fused and int8 tensors, each storage
   once) and the process's resident set (``VmRSS`` of /proc/self/status) before loading, after loading (and
   quantizing), after glibc's ``malloc_trim(0)`` (freed heap memory glibc had kept), after an 8-token generate,
   and the peak (``VmHWM``);
6. a torch.profiler breakdown per token (matmul, attention, collectives, the rest) of int8 + bf16 at tp 1 and 2;
7. greedy tokens of int8 against fp32 (tp=1) for three prompts.

    python bench/bench_int8.py [--tokens 32] [--out bench/results]
    python bench/bench_int8.py --only kernels,quality     # items 1, the 1-process bandwidth, 4 (int8) and 7

Writes ``decode_int8.json`` and ``decode_int8.md`` under ``--out`` with the load average at start and end.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import PROMPT, job_bandwidth, job_tp, perplexity  # noqa: E402


#: the matmuls of one decoder layer of the 1.1B random Llama (TinyLlama's shapes: hidden 2048, 32 q / 4 KV heads of
#: 64, MLP 5632) at tp=1, ``(name, K, N)``; at tp=2 each rank runs half of N (q/k/v, gate/up) or of K (o, down)
SHAPES_1B = [("q/k/v", 2048, 2560), ("o_proj", 2048, 2048), ("gate/up", 2048, 11264), ("down_proj", 5632, 2048)]


def kernels(min_mb: int = 160, sweeps: int = 3) -> dict:
    """Per candidate and 1.1B decode shape (:data:`SHAPES_1B`, one row ``M = 1``, 1 thread): µs per call and GB/s of
    the bytes its weight format holds, cycling over enough distinct weights (>= ``min_mb`` MB, beyond the 32 MB L3)
    that each call reads its weight from memory; best of ``sweeps``. Wall time, and the thread's CPU time (the
    machine is shared: a descheduled thread stops its CPU clock, not the wall clock). Candidates: our kernel
    (blockwise fp16 scales), the same math in PyTorch (the fallback), ``torch._weight_int8pack_mm`` (bf16
    activations, per-channel scales), fbgemm's ``torch.ops.quantized.linear_dynamic`` (per-channel weights,
    per-tensor dynamic uint8 activations), fp32 and bf16 ``F.linear``."""
    import warnings

    import torch.nn.functional as F

    from tensorpar.decode import q8_kernel
    from tensorpar.decode.int8 import int8_linear, int8_linear_reference, quantize_weight
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*quantize_per.*deprecated")
    g = torch.Generator().manual_seed(0)
    out = {"kernel_available": q8_kernel.available(), "shapes": {}}
    for name, K, N in SHAPES_1B:
        n = max(2, (min_mb << 20) // (N * K))
        ws = [torch.randn(N, K, generator=g) * 0.02 for _ in range(n)]
        x = torch.randn(1, K, generator=g)
        xb = x.bfloat16()
        cands = {}
        q8 = [quantize_weight(w, write=False) for w in ws]
        if out["kernel_available"]:
            cands[f"ours: int8 x int8 {q8_kernel.target()}, blockwise fp16 scales"] = (lambda i: int8_linear(x, q8[i]), N * K * 17 / 16)
        cands["PyTorch path (dequantize, fp32 matmul), blockwise"] = (lambda i: int8_linear_reference(x, q8[i]),
                                                                       N * K * 17 / 16)
        chs = [(w.abs().amax(1) / 127) for w in ws]
        qc = [torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8) for w, s in zip(ws, chs)]
        sb = [s.bfloat16() for s in chs]
        cands["torch._weight_int8pack_mm, bf16 x, per-channel"] = (
            lambda i: torch._weight_int8pack_mm(xb, qc[i], sb[i]), N * K + 2 * N)
        packed = [torch.ops.quantized.linear_prepack(torch.quantize_per_channel(
            w, s, torch.zeros(N, dtype=torch.long), 0, torch.qint8), None) for w, s in zip(ws, chs)]
        cands["fbgemm quantized.linear_dynamic, per-channel"] = (
            lambda i: torch.ops.quantized.linear_dynamic(x, packed[i]), N * K + 8 * N)
        nf = max(2, n // 4)         # fp32 weights are 4x larger: fewer of them exceed the caches as well
        cands["fp32 F.linear"] = (lambda i: F.linear(x, ws[i % nf]), 4 * N * K)
        wb = [w.bfloat16() for w in ws[:max(2, n // 2)]]
        cands["bf16 F.linear"] = (lambda i: F.linear(xb, wb[i % len(wb)]), 2 * N * K)
        res = {}
        for _ in range(sweeps):             # sweeps interleave the candidates: load changes hit all alike
            for cname, (f, nbytes) in cands.items():
                f(0)
                t0, c0 = time.perf_counter(), time.thread_time()
                for i in range(n):
                    f(i)
                wall, cpu = (time.perf_counter() - t0) / n, (time.thread_time() - c0) / n
                r = res.setdefault(cname, {"us": float("inf"), "cpu_us": float("inf"), "bytes": nbytes})
                r["us"], r["cpu_us"] = min(r["us"], wall * 1e6), min(r["cpu_us"], cpu * 1e6)
        for cname, r in res.items():
            r["GB_s"], r["cpu_GB_s"] = r["bytes"] / r["us"] / 1e3, r["bytes"] / r["cpu_us"] / 1e3
            print(f"{name:<10} {cname:<52} {r['us']:8.0f} us {r['GB_s']:6.2f} GB/s (CPU time: {r['cpu_GB_s']:6.2f})",
                  flush=True)
        out["shapes"][f"{name} [1, {K}] x [{K}, {N}]"] = res
        del ws, packed, qc
    return out


def greedy_vs_fp32(folder: str, n: int) -> dict:
    """Greedy tokens of the lean path (tp=1, fp32 activations) with ``--quantize int8`` against fp32, for the
    benchmark prompt and two more: how many of ``n`` are equal, and the first that differs."""
    from transformers import AutoTokenizer

    from tensorpar.decode.quantize import quantize_int8
    from tensorpar.generate import SamplingConfig, generate_tokens
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.parallel import ParallelContext
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(folder)
    ctx = ParallelContext.single()
    out = {}
    for prompt in (PROMPT, "Once upon a time, in a small village,", "def fibonacci(n):"):
        ids = tok([prompt], return_tensors="pt")["input_ids"]
        toks = {}
        for q in (False, True):
            model, _ = build_parallel_model(folder, ctx.tp)
            if q:
                quantize_int8(model, ctx.tp)
            toks[q] = generate_tokens(model, ctx.tp, ids, sampling=SamplingConfig(max_new_tokens=n),
                                      path="lean").tokens[0]
        same = toks[True] == toks[False]
        out[prompt] = {"equal": int(same.sum()), "first_diff": None if bool(same.all()) else int((~same).nonzero()[0])}
        print(f"greedy {prompt!r}: {out[prompt]}", flush=True)
    return out


def _status_kb(key: str) -> int:
    """``key`` (``VmRSS``, ``VmHWM``) of /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def job_memory(ctx, folder, dtype, quantize):
    """This rank's weight bytes and RSS after loading (and quantizing) the model; see the module docstring."""
    import ctypes
    import gc

    from tensorpar.generate import SamplingConfig, generate_tokens
    from tensorpar.decode.quantize import apply_quantize
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.decode.quantize import resident_weight_bytes
    torch.set_num_threads(1)
    gc.collect()
    out = {"rss_base": _status_kb("VmRSS")}
    model, _ = build_parallel_model(folder, ctx.tp, dtype=getattr(torch, dtype))
    apply_quantize(model, ctx.tp, quantize)
    gc.collect()
    out.update(weight_bytes=resident_weight_bytes(model), rss_loaded=_status_kb("VmRSS"))
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        out["rss_trimmed"] = _status_kb("VmRSS")
    except OSError:         # not glibc
        out["rss_trimmed"] = None
    ids = torch.tensor([[504, 3458, 282, 4649, 314]])       # six SmolLM2 tokens (no tokenizer: it would add RSS)
    generate_tokens(model, ctx.tp, ids, sampling=SamplingConfig(max_new_tokens=8), path="lean")
    gc.collect()
    out.update(rss_generated=_status_kb("VmRSS"), rss_peak=_status_kb("VmHWM"),
               weight_bytes_generated=resident_weight_bytes(model))
    return out


def memory(folder: str) -> list[dict]:
    """Rows of :func:`job_memory` for fp32 / int8 / int8 + bf16 at tp 1 and 2 (fresh processes each)."""
    from tensorpar.testing import WorkerPool
    rows = []
    for world in (1, 2):
        for name, dtype, q in [("fp32", "float32", "none"), ("int8", "float32", "int8"),
                               ("int8 + bf16", "bfloat16", "int8")]:
            with WorkerPool(world, collective_timeout_s=120, job_timeout_s=1200) as pool:
                ranks = pool.run(job_memory, folder, dtype, q)
            rows.append({"config": f"tp={world}, {name}", "ranks": world, "dtype": dtype, "quantize": q,
                         "per_rank": ranks})
            r0 = ranks[0]
            print(f"memory tp={world} {name:<12} weights {r0['weight_bytes'] / 1e6:7.1f} MB  RSS base "
                  f"{r0['rss_base'] / 1e6:.0f} loaded {r0['rss_loaded'] / 1e6:.0f} trimmed "
                  f"{(r0['rss_trimmed'] or 0) / 1e6:.0f} after generate {r0['rss_generated'] / 1e6:.0f} peak "
                  f"{r0['rss_peak'] / 1e6:.0f} MB (rank 0)", flush=True)
    return rows


def run(folder: str, n: int, mb: int) -> dict:
    from tensorpar.testing import WorkerPool

    def pool_run(world, fn, *args):
        with WorkerPool(world, collective_timeout_s=120, job_timeout_s=1200) as pool:
            return pool.run(fn, *args)

    load_start = os.getloadavg()
    kern = kernels()
    bw = {w: pool_run(w, job_bandwidth, mb, 30)[0]["bytes_per_s"] for w in (1, 2)}
    print(f"bandwidth: 1 process {bw[1] / 1e9:.1f} GB/s, 2 processes {bw[2] / 1e9:.1f} GB/s", flush=True)
    rows = []
    for name, world, dtype, q in [("fp32", 1, "float32", "none"), ("fp32", 2, "float32", "none"),
                                  ("int8", 1, "float32", "int8"), ("int8", 2, "float32", "int8"),
                                  ("bf16", 2, "bfloat16", "none"),
                                  ("int8 + bf16", 1, "bfloat16", "int8"), ("int8 + bf16", 2, "bfloat16", "int8")]:
        res = pool_run(world, job_tp, folder, n, dtype, "lean", 1, False, q)
        r = dict(res[0])
        r["tokens_by_rank_equal"] = all(x["tokens"] == res[0]["tokens"] for x in res)
        r.update(config=f"tensorpar tp={world}, lean, {name}", ranks=world, dtype=dtype, quantize=q)
        r["roofline_tok_s"] = bw[world] / r["weight_bytes"]
        r["roofline_fraction"] = r["decode_tok_s"] / r["roofline_tok_s"]
        r["best_step_roofline_fraction"] = r["best_step_tok_s"] / r["roofline_tok_s"]
        rows.append(r)
        print(f"{r['config']:<36} {r['decode_tok_s']:7.1f} tok/s  {r['roofline_fraction']:.2f} of the roofline "
              f"({r['roofline_tok_s']:.1f})", flush=True)
    ppl = {}
    for key, dt, q in [("fp32", "float32", "none"), ("int8", "float32", "int8"), ("bf16", "bfloat16", "none"),
                       ("int8 + bf16", "bfloat16", "int8")]:
        ppl[key], work, count = perplexity(folder, 1024, dt, quantize=q)
        print(f"perplexity {key}: {ppl[key]:.3f} on {count} tokens of {work}", flush=True)
    prof = {}
    for world in (1, 2):        # where the time goes per token, int8 + bf16 (bench_decode.py's profile categories)
        prof[f"tp={world}"] = pool_run(world, job_tp, folder, n, "bfloat16", "lean", 1, True, "int8")[0]["profile"]
        print(f"profile int8 + bf16 tp={world}: {prof[f'tp={world}']}", flush=True)
    mem = memory(folder)
    greedy = greedy_vs_fp32(folder, n)
    return {"kernels": kern, "greedy": greedy, "bandwidth_bytes_per_s": {"1 process": bw[1], "2 processes": bw[2]}, "rows": rows,
            "perplexity": {"work": work, "tokens": count, **ppl}, "profile": prof, "memory": mem, "load_start": load_start,
            "load_end": os.getloadavg()}


def write(res: dict, out: Path, n: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    meta = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "torch": torch.__version__,
            "new_tokens": n, "prompt": PROMPT, "date": time.strftime("%Y-%m-%d %H:%M")}
    res = {"meta": meta, **res}
    tmp = out / "decode_int8.json.tmp"
    tmp.write_text(json.dumps(res, indent=2))
    os.replace(tmp, out / "decode_int8.json")
    rows, bw = res["rows"], res["bandwidth_bytes_per_s"]
    by = {r["config"]: r for r in rows}
    ls, le = res["load_start"], res["load_end"]
    lines = [f"SmolLM2-135M greedy decode, lean path, {n} new tokens, prompt {PROMPT!r}; {meta['machine']}, torch "
             f"{meta['torch']}, {meta['date']}. Load average at start {ls[0]:.2f} / {ls[1]:.2f} / {ls[2]:.2f}, at "
             f"end {le[0]:.2f} / {le[1]:.2f} / {le[2]:.2f} (shared machine: 2 cores; rows measured under load are "
             f"slower than they could be).", "",
             FORMAT, ""]
    lines += kernel_lines(res["kernels"])
    lines += ["", f"Memory bandwidth (bench_decode.py's GEMV, 1 thread per process, best of 30): 1 process "
              f"{bw['1 process'] / 1e9:.2f} GB/s, 2 processes {bw['2 processes'] / 1e9:.2f} GB/s.", "",
              "| configuration | weight MB/token | tokens/s | best step tokens/s | roofline tokens/s | fraction of "
              "roofline (mean / best step) | vs fp32 tp=2 (mean / best step) | ranks' tokens equal |",
              "|---|---|---|---|---|---|---|---|"]
    base = by["tensorpar tp=2, lean, fp32"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['weight_bytes'] / 1e6:.0f} | {r['decode_tok_s']:.1f} | "
                     f"{r['best_step_tok_s']:.1f} | {r['roofline_tok_s']:.1f} | {r['roofline_fraction']:.2f} / "
                     f"{r['best_step_roofline_fraction']:.2f} | {r['decode_tok_s'] / base['decode_tok_s']:.2f}x / "
                     f"{r['best_step_tok_s'] / base['best_step_tok_s']:.2f}x | {r['tokens_by_rank_equal']} |")
    i1, i2 = by["tensorpar tp=1, lean, int8"], by["tensorpar tp=2, lean, int8"]
    b1, b2 = by["tensorpar tp=1, lean, int8 + bf16"], by["tensorpar tp=2, lean, int8 + bf16"]
    f1 = by["tensorpar tp=1, lean, fp32"]
    lines += ["", f"* int8 greedy tokens, tp=2 == tp=1: {i1['tokens'] == i2['tokens']}; int8 + bf16, tp=2 == tp=1: "
              f"{b1['tokens'] == b2['tokens']}; int8 == fp32 (tp=1): {i1['tokens'] == f1['tokens']}."]
    p = res["perplexity"]
    ppl = ", ".join(f"{k} {p[k]:.3f} ({(p[k] / p['fp32'] - 1) * 100:+.2f}%)" for k in ("fp32", "int8", "bf16",
                                                                                          "int8 + bf16"))
    lines += [f"* Quality: perplexity of the lean path (tp=1) on {p['tokens']} held-out tokens of Shakespeare "
              f"({p['work']}, the corpus' validation split, as in decode.md): {ppl}."]
    lines += greedy_lines(res["greedy"], n)
    pr = res["profile"]
    keys = list(pr["tp=1"])
    lines += ["", "Where the time goes per token, int8 + bf16 (rank 0; torch.profiler over one generate call of the "
              "same length, CPU self times, ms per token; bench_decode.py's categories: matmul = aten mm/addmm/"
              "_weight_int8pack_mm, collectives = tensorpar's all-reduce incl. its shared-memory copies):", "",
              "| | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    lines += [f"| {k} | " + " | ".join(str(v[c]) for c in keys) + " |" for k, v in pr.items()]
    lines += memory_lines(res["memory"])
    tmp = out / "decode_int8.md.tmp"
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, out / "decode_int8.md")
    print("\n".join(lines))


FORMAT = ("int8: every decoder Linear and the LM head as int8 with one fp16 scale per block of 32 inputs (llama.cpp's "
          "Q8_0), activations quantized per row and block of 32 in each matmul, int8 x int8 products "
          "(tensorpar/decode/int8.py; on AVX512-VNNI or AVX2 our kernel, tensorpar/decode/q8_kernel.py).")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        return platform.processor() or "?"


def kernel_lines(k: dict) -> list[str]:
    """The kernel table (see :func:`kernels`)."""
    lines = ["Kernel candidates at the 1.1B random Llama's decode shapes (one row, 1 thread), each call reading its "
             "weight from memory (distinct weights cycled, >= 160 MB), best of 3 interleaved sweeps; GB/s of the "
             "bytes the format holds (int8 + scales; fp32/bf16 weights), from wall time and from the thread's CPU "
             "time (less disturbed by the other processes on a shared machine)"
             + ("" if k["kernel_available"] else "; our kernel is not available on this machine") + ":", "",
             "| shape | kernel | µs per call | GB/s | GB/s (CPU time) |", "|---|---|---|---|---|"]
    for shape, res in k["shapes"].items():
        for name, r in res.items():
            lines.append(f"| {shape} | {name} | {r['us']:.0f} | {r['GB_s']:.2f} | {r['cpu_GB_s']:.2f} |")
    return lines


def greedy_lines(g: dict, n: int) -> list[str]:
    return [f"* Greedy tokens, int8 against fp32 (tp=1, lean path, {n} new tokens): "
            + "; ".join(f"{p!r}: {r['equal']} of {n} equal" + ("" if r["first_diff"] is None else
                                                             f" (first difference at token {r['first_diff']})")
                        for p, r in g.items()) + "."]


def run_parts(folder: str, parts: set[str], n: int, mb: int, out: Path) -> None:
    """``--only``: the kernel table and the memory bandwidth of one process (``kernels``), and/or the greedy and
    perplexity comparison of int8 against fp32 (``quality``); writes decode_int8.md / .json with those sections
    only (the decode rows, profile and memory tables need the full run)."""
    from tensorpar.testing import WorkerPool
    load_start = os.getloadavg()
    res: dict = {}
    if "kernels" in parts:
        res["kernels"] = kernels()
        with WorkerPool(1, collective_timeout_s=120, job_timeout_s=1200) as pool:
            res["bandwidth_1_process"] = pool.run(job_bandwidth, mb, 30)[0]["bytes_per_s"]
    if "quality" in parts:
        res["greedy"] = greedy_vs_fp32(folder, n)
        ppl = {}
        for key, dt, q in [("fp32", "float32", "none"), ("int8", "float32", "int8"),
                           ("int8 + bf16", "bfloat16", "int8")]:
            ppl[key], work, count = perplexity(folder, 1024, dt, quantize=q)
            print(f"perplexity {key}: {ppl[key]:.3f} on {count} tokens of {work}", flush=True)
        res["perplexity"] = {"work": work, "tokens": count, **ppl}
    le = os.getloadavg()
    meta = {"machine": f"{cpu_model()}, {platform.machine()}, {os.cpu_count()} cores", "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M"), "load_start": load_start, "load_end": le, "parts": sorted(parts)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_int8.json.tmp").write_text(json.dumps({"meta": meta, **res}, indent=2))
    os.replace(out / "decode_int8.json.tmp", out / "decode_int8.json")
    ls = load_start
    lines = [f"bench/bench_int8.py --only {','.join(sorted(parts))}; {meta['machine']}, torch {meta['torch']}, "
             f"{meta['date']}. Load average at start {ls[0]:.2f} / {ls[1]:.2f} / {ls[2]:.2f}, at end {le[0]:.2f} / "
             f"{le[1]:.2f} / {le[2]:.2f} (shared machine: 2 cores, other jobs running; wall-time rows are slower than "
             f"the machine can do). The SmolLM2 decode rows, profile and memory tables need the full run (no --only).",
             "", FORMAT, ""]
    if "kernels" in res:
        lines += kernel_lines(res["kernels"])
        lines += ["", f"Memory bandwidth of one process (bench_decode.py's fp32 GEMV, 1 thread, best of 30): "
                      f"{res['bandwidth_1_process'] / 1e9:.2f} GB/s."]
    if "perplexity" in res:
        p = res["perplexity"]
        ppl = ", ".join(f"{k} {p[k]:.3f} ({(p[k] / p['fp32'] - 1) * 100:+.2f}%)" for k in ("fp32", "int8",
                                                                                              "int8 + bf16"))
        lines += ["", f"* Quality, SmolLM2-135M: perplexity of the lean path (tp=1) on {p['tokens']} held-out tokens "
                      f"of Shakespeare ({p['work']}, the corpus' validation split, as in decode.md): {ppl}."]
        lines += greedy_lines(res["greedy"], n)
    (out / "decode_int8.md.tmp").write_text("\n".join(lines) + "\n")
    os.replace(out / "decode_int8.md.tmp", out / "decode_int8.md")
    print("\n".join(lines))


def memory_lines(mem: list[dict]) -> list[str]:
    """The memory table of the results file (MB = 10^6 bytes; per rank, ranks separated by '/')."""
    def col(r, key):
        return " / ".join("n/a" if x[key] is None else f"{x[key] / 1e6:.0f}" for x in r["per_rank"])

    fp = {r["ranks"]: r for r in mem if r["quantize"] == "none"}
    lines = ["", "Memory per rank after loading SmolLM2-135M (fresh processes per row; MB = 10^6 bytes; ranks "
             "separated by '/'). *Weights*: the distinct storages the model holds (parameters, buffers, the lean "
             "path's fused tensors, int8 weights and scales; tensorpar.decode.quantize.resident_weight_bytes). *RSS*: VmRSS "
             "of the rank's process: before loading (torch and the libraries), after loading and quantizing, after "
             "glibc's malloc_trim(0), after an 8-token generate (KV cache, activations); *peak*: VmHWM.", "",
             "| configuration | weights MB | weights / fp32 | RSS before load | RSS loaded | RSS after malloc_trim | "
             "RSS after generate | peak RSS |", "|---|---|---|---|---|---|---|---|"]
    for r in mem:
        base = fp[r["ranks"]]["per_rank"]
        ratio = " / ".join(f"{x['weight_bytes'] / b['weight_bytes']:.3f}" for x, b in zip(r["per_rank"], base))
        lines.append(f"| {r['config']} | {col(r, 'weight_bytes')} | {ratio} | {col(r, 'rss_base')} | "
                     f"{col(r, 'rss_loaded')} | {col(r, 'rss_trimmed')} | {col(r, 'rss_generated')} | "
                     f"{col(r, 'rss_peak')} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--gemv-mb", type=int, default=256, help="MB of the matrix each process streams")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--memory-only", action="store_true", help="print the memory table only (writes no files)")
    p.add_argument("--only", default=None, help="comma-separated parts: kernels (the 1.1B-shape kernel table and "
                                                "one process's bandwidth), quality (greedy and perplexity, int8 "
                                                "against fp32); writes decode_int8.md with those sections only")
    a = p.parse_args()
    from tensorpar.hub import resolve_model
    folder = str(resolve_model(a.model))
    if a.only:
        parts = set(a.only.split(","))
        if not parts <= {"kernels", "quality"}:
            p.error(f"--only {a.only}: the parts are kernels and quality")
        run_parts(folder, parts, a.tokens, a.gemv_mb, Path(a.out))
        return
    if a.memory_only:
        print("\n".join(memory_lines(memory(folder))))
        return
    write(run(folder, a.tokens, a.gemv_mb), Path(a.out), a.tokens)


if __name__ == "__main__":
    main()
