"""int8 weight-only decode (``--quantize int8``) against fp32 and bf16, side by side in one run.

In one run this script

1. times the candidate int8 matmul kernels on a ``[1, 576] x [576, 1536]`` GEMV (SmolLM2's gate/up shape), one
   thread, cycling over 90 distinct weights (≈ 80 MB of int8, more than the caches) so each call reads its weight
   from memory: fp32 and bf16 ``F.linear`` (references), ``torch._weight_int8pack_mm`` with fp32 and with bf16
   activations, and ``F.linear(x, q.to(x.dtype)) * s`` (dequantizing) in fp32 and bf16;
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
6. a torch.profiler breakdown per token (matmul, attention, collectives, the rest) of int8 + bf16 at tp 1 and 2.

    python bench/bench_int8.py [--tokens 32] [--out bench/results]

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


def kernels(n_weights: int = 90, reps: int = 5) -> dict:
    """µs per call of each candidate (see the module docstring), best of 3 sweeps."""
    import torch.nn.functional as F

    from tensorpar.decode.int8 import Int8Weight, quantize_rows
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(1536, 576, generator=g) for _ in range(n_weights)]
    qs = [quantize_rows(w.clone(), None) for w in ws]
    qb = [Int8Weight(q.q, q.scale.bfloat16()) for q in qs]
    wb = [w.bfloat16() for w in ws]
    x = torch.randn(1, 576, generator=g)
    xb = x.bfloat16()
    cands = {
        "fp32 F.linear (fp32 weights)": lambda i: F.linear(x, ws[i]),
        "bf16 F.linear (bf16 weights)": lambda i: F.linear(xb, wb[i]),
        "torch._weight_int8pack_mm, fp32 x": lambda i: torch._weight_int8pack_mm(x, qs[i].q, qs[i].scale),
        "torch._weight_int8pack_mm, bf16 x": lambda i: torch._weight_int8pack_mm(xb, qb[i].q, qb[i].scale),
        "F.linear(x, q.float()) * s, fp32 x": lambda i: F.linear(x, qs[i].q.to(x.dtype)) * qs[i].scale,
        "F.linear(x, q.bfloat16()) * s, bf16 x": lambda i: F.linear(xb, qb[i].q.to(xb.dtype)) * qb[i].scale,
    }
    out = {}
    for name, f in cands.items():
        f(0)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(reps):
                for i in range(n_weights):
                    f(i)
            best = min(best, (time.perf_counter() - t0) / (reps * n_weights))
        out[name] = best * 1e6
        print(f"{name:<44} {out[name]:8.1f} us", flush=True)
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
    return {"kernels_us": kern, "bandwidth_bytes_per_s": {"1 process": bw[1], "2 processes": bw[2]}, "rows": rows,
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
             "int8: weight-only, per-output-channel scales, every decoder Linear and the LM head "
             "(tensorpar/decode/quantize.py); fp32 activations run `F.linear(x, q.float()) * s`, bf16 activations "
             "`torch._weight_int8pack_mm`.", "",
             "Kernel candidates, one [1, 576] x [576, 1536] GEMV, 1 thread, 90 distinct weights cycled (from memory), "
             "best of 3 sweeps:", "", "| kernel | µs per call |", "|---|---|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in res["kernels_us"].items()]
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
    a = p.parse_args()
    from tensorpar.hub import resolve_model
    folder = str(resolve_model(a.model))
    if a.memory_only:
        print("\n".join(memory_lines(memory(folder))))
        return
    write(run(folder, a.tokens, a.gemv_mb), Path(a.out), a.tokens)


if __name__ == "__main__":
    main()
