"""Bytes/s of the decode matmuls at a few rows, one thread, against the memory-read limit (issue 28: weights that
stream at the limit): oneDNN on prepacked weights (``torch.ops.mkldnn._linear_pointwise``, what the lean path ran)
and plain ``F.linear`` against our GEMV on the plain weight (:mod:`tensorpar.decode.gemv_kernel`; bf16 with
``vdpbf16ps``, or both widened where the CPU has no AVX512_BF16, and with the weights widened to fp32, with and
without software prefetch), fp32 and bf16, interleaved in one run. ``--dtypes bf16w``: ``--quantize bf16``'s matmul
(bf16 weights, fp32 input and output): our GEMV's bf16-weight entry (``gemv_kernel.bf16w_linear``) against
``bf16_weights.chunked_linear`` (what runs without the kernel) and ``F.linear(x, w.float())``.

Shapes: one rank's matrices of the 1.1B Llama (TinyLlama's shape: hidden 2048, 32 query / 4 KV heads of 64, MLP
5632, vocab 32000) and, with ``--models llama smollm2``, of SmolLM2-135M (hidden 576, 9 query / 3 KV heads of 64, MLP
1536, vocab 49152) at tp=1 and tp=2: fused QKV, o_proj, fused gate-up, down, LM head. Each measurement runs
through enough distinct copies of a matrix (>= ``--mb`` MB) that they are read from memory, as in a decode step.
fp32 also runs ``blocked``: our GEMV on the blocked layout that replaces the plain weight in the lean path since
2026-12-04 (``gemv_kernel.BlockedWeight``); bf16w too, on the bf16 blocked layout of ``--quantize bf16``
(``bf16_weights.block_bf16``). GB/s = weight bytes / time (median and best of ``--repeats``), from wall time and from the calling thread's CPU
time (``time.thread_time``: one thread runs the matmul, so on a shared machine the CPU time counts less of the
other processes' load than the wall time does); the limit is bench/stream_read.c (8 streams) with one thread
(bench_llamacpp's), best of its start and end runs. A run whose 1-minute load average reached 1 (2 cores) is
labelled loaded in its title. Results: ``--out`` (default bench/results/gemv).{md,json}, written with
bench/machine.py's ``write_results``.

    PYTHONPATH=. python bench/bench_gemv.py [--rows 1 4] [--mb 128] [--models llama smollm2] [--variants ours ...]
        [--dtypes fp32 bf16 bf16w]

``--e2e``: instead, greedy decode of the 1.1B random Llama (bench_llamacpp's ``tinyllama-random``, 1 thread per
rank, ``bench_decode.job_tp``) at tp=1 and tp=2, fp32 and bf16, with our kernel (the lean path's default) and
without it (``TENSORPAR_GEMV_KERNEL=0``: oneDNN on prepacked weights, as before), the rows interleaved over
``--rounds`` (order reversed every other round), each row in fresh processes; tokens/s as a fraction of the
memory-read limit (1 thread for tp=1, 2 for tp=2; bench/stream_read.c at start and end, the better). Results:
bench/results/gemv_decode.{md,json}.

    PYTHONPATH=. python bench/bench_gemv.py --e2e [--tokens 8] [--rounds 1]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_llamacpp import STREAM_READ_STREAMS, _stream_binary, _stream_read  # noqa: E402
from bench_serve import atomic_write  # noqa: E402
from machine import machine, write_results  # noqa: E402

H, F_, V, D, NQ, NKV = 2048, 5632, 32000, 64, 32, 4
#: (hidden, MLP, vocab, head dim, query heads, KV heads) per ``--models`` name
MODELS = {"llama": (H, F_, V, D, NQ, NKV), "smollm2": (576, 1536, 49152, 64, 9, 3)}


def shapes(tp: int, model: str = "llama") -> list[tuple[str, int, int]]:
    """``(name, out, in)`` of one rank's matrices at ``tp`` for ``model`` (a :data:`MODELS` key)."""
    h, f, v, d, nq, nkv = MODELS[model]
    return [("qkv", (nq + 2 * nkv) * d // tp, h), ("o_proj", h, nq * d // tp), ("gate_up", 2 * f // tp, h),
            ("down", h, f // tp), ("lm_head", v // tp, h)]


def e2e(args) -> None:
    """The ``--e2e`` run (module docstring)."""
    import argparse as _ap

    from bench_decode import job_tp
    from bench_llamacpp import TINYLLAMA_RANDOM, prepare_model
    from tensorpar.testing import WorkerPool

    m = prepare_model(_ap.Namespace(model=TINYLLAMA_RANDOM, gguf=None))
    folder, prompt_ids = str(m["folder"]), m["prompt_ids"]
    exe = _stream_binary()
    m0 = machine()
    sr0 = _stream_read(exe, 256)
    configs = [(dt, tp, kernel) for dt in ("float32", "bfloat16") for tp in (1, 2) for kernel in (False, True)]
    res = {c: [] for c in configs}
    loads = []
    for rnd in range(args.rounds):
        for dt, tp, kernel in (configs if rnd % 2 == 0 else configs[::-1]):
            os.environ["TENSORPAR_GEMV_KERNEL"] = "1" if kernel else "0"     # read by the spawned ranks
            loads.append(os.getloadavg()[0])
            with WorkerPool(tp, collective_timeout_s=600, job_timeout_s=3600) as pool:
                out = pool.run(job_tp, folder, args.tokens, dt, "lean", 1, False, "none", prompt_ids, False)
            r = dict(out[0], load=loads[-1], ranks_agree=all(o["tokens"] == out[0]["tokens"] for o in out))
            res[(dt, tp, kernel)].append(r)
            print(f"round {rnd + 1} {dt} tp={tp} {'ours' if kernel else 'oneDNN'}: {r['decode_tok_s']:.2f} tok/s, "
                  f"best step {r['best_step_tok_s']:.2f}, load {loads[-1]:.2f}", flush=True)
    os.environ.pop("TENSORPAR_GEMV_KERNEL", None)
    sr1 = _stream_read(exe, 256)
    limit = {t: max(sr0[t], sr1[t]) for t in (1, 2)} if sr0 else None
    m1 = machine()
    rows = []
    for (dt, tp, kernel), rs in res.items():
        read = rs[0]["weight_bytes"] - rs[0]["untied_embedding_bytes"]
        med = statistics.median(x["decode_tok_s"] for x in rs)
        best = max(x["best_step_tok_s"] for x in rs)
        rows.append(dict(dtype=dt, tp=tp, matmuls="ours" if kernel else "oneDNN prepacked", read_bytes=read,
                         median_tok_s=med, best_step_tok_s=best, rounds=[x["decode_tok_s"] for x in rs],
                         limit_tok_s=limit[tp] / read if limit else None, tokens=rs[0]["tokens"],
                         same_tokens_every_round=all(x["tokens"] == rs[0]["tokens"] for x in rs),
                         ranks_agree=all(x["ranks_agree"] for x in rs), loads=[x["load"] for x in rs]))
    meta = dict(machine=m0, machine_end=m1, stream_read_start=sr0, stream_read_end=sr1, limit=limit,
                tokens=args.tokens, rounds=args.rounds, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    out = Path(args.out).with_name("gemv_decode")
    atomic_write(out.with_suffix(".json"), json.dumps(dict(meta=meta, rows=rows), indent=1))
    la0, la1 = m0["loadavg"], m1["loadavg"]
    lines = [f"# 1.1B random Llama decode: our GEMV against oneDNN prepacked ({meta['date']})", "",
             f"{m0['cpu']}, {m0['cores']} cores; bench/bench_gemv.py --e2e: greedy decode of {args.tokens} new "
             f"tokens (1 thread per rank, bench_decode.job_tp, the first token not timed), {args.rounds} round(s), "
             f"rows interleaved, each in fresh processes. Load average {la0[0]:.2f} / {la0[1]:.2f} / {la0[2]:.2f} "
             f"at start, {la1[0]:.2f} / {la1[1]:.2f} / {la1[2]:.2f} at end, 1-minute value before each row "
             f"{min(loads):.2f} to {max(loads):.2f}: the machine was shared (2 cores), so these are not the "
             f"machine's numbers; compare the rows of one run only.",
             "", f"Memory-read limit (bench/stream_read.c, {STREAM_READ_STREAMS} streams per thread): " + (
                 f"1 thread {limit[1] / 1e9:.1f} GB/s, 2 threads {limit[2] / 1e9:.1f} GB/s (start {sr0[1] / 1e9:.1f}"
                 f" / {sr0[2] / 1e9:.1f}, end {sr1[1] / 1e9:.1f} / {sr1[2] / 1e9:.1f})." if limit else "not measured"),
             "", "| dtype | tp | matmuls | MB read per token | tokens/s (median) | best step tokens/s | "
             "limit tokens/s | "
             "fraction of limit (median / best step) | tokens equal across rounds, ranks |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lim = r["limit_tok_s"]
        frac = f"{r['median_tok_s'] / lim:.2f} / {r['best_step_tok_s'] / lim:.2f}" if lim else "-"
        lines.append(f"| {r['dtype']} | {r['tp']} | {r['matmuls']} | {r['read_bytes'] / 1e6:.0f} | "
                     f"{r['median_tok_s']:.2f} | {r['best_step_tok_s']:.2f} | {lim or 0:.2f} | {frac} | "
                     f"{r['same_tokens_every_round']}, {r['ranks_agree']} |")
    same = {(r["dtype"], r["tp"]): r["tokens"] for r in rows if r["matmuls"] == "oneDNN prepacked"}
    lines += ["", "Greedy tokens, ours against oneDNN's at the same dtype and tp (positions equal, of "
              f"{args.tokens}): " + ", ".join(
                  f"{r['dtype']} tp={r['tp']} {sum(a == b for a, b in zip(r['tokens'], same[(r['dtype'], r['tp'])]))}"
                  for r in rows if r["matmuls"] == "ours"), ""]
    atomic_write(out.with_suffix(".md"), "\n".join(lines))
    print("\n".join(lines))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--big-rows", type=int, nargs="*", default=[8, 16, 32],
                    help="more rows, tp=2 gate-up only (where oneDNN takes over)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--models", nargs="+", default=["llama"], choices=sorted(MODELS))
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16", "bf16w"])
    ap.add_argument("--variants", nargs="+", default=None,
                    help="of onednn flinear ours ours_pf ours_widen ours_pairs chunked (default: all that apply)")
    ap.add_argument("--mb", type=int, default=128, help="MB of distinct copies each measurement reads at least")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default="bench/results/gemv")
    ap.add_argument("--e2e", action="store_true", help="end-to-end 1.1B decode instead (module docstring)")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    if args.e2e:
        return e2e(args)
    import torch
    from tensorpar.decode import bf16_weights, gemv_kernel
    from tensorpar.decode.bf16_weights import chunked_linear
    from tensorpar.decode.kernels import can_pack, pack, packed_linear

    if not gemv_kernel.available():
        sys.exit("our GEMV kernel is not available here (CPU features or compiler): nothing to compare")
    torch.set_num_threads(1)
    exe = _stream_binary()
    m0 = machine()
    sr0 = _stream_read(exe, 256)
    g = torch.Generator().manual_seed(0)
    dts = {"fp32": torch.float32, "bf16": torch.bfloat16, "bf16w": torch.bfloat16}     # the weights' dtype
    cases = [(model, tp, name, n, k, m) for model in args.models for tp in args.tp
             for name, n, k in shapes(tp, model) for m in args.rows]
    cases += [(args.models[0], 2, "gate_up", n, k, m) for m in args.big_rows
              for name, n, k in shapes(2, args.models[0]) if name == "gate_up"]
    rows = []
    for dname in args.dtypes:
        dt = dts[dname]
        for model, tp, name, n, k, m in cases:
            if dname == "bf16w":
                variants = {"chunked": "chunked", "flinear": "flinear", "ours": "bf16w", "blocked": "blocked"}
            else:
                variants = {"onednn": None, "flinear": "flinear", "ours": dict(mode=0, prefetch=0),
                            "ours_pf": dict(mode=0, prefetch=1024)}
                if dt == torch.bfloat16:
                    variants["ours_widen"] = dict(mode=1, prefetch=0)
                if m > 1:
                    variants["ours_pairs"] = dict(mode=2, prefetch=0)
                if dt == torch.float32:
                    variants["blocked"] = "blocked"
                if not can_pack(torch.zeros(1, 1, dtype=dt)):       # no oneDNN bf16 here (AVX2): nothing to pack
                    del variants["onednn"]
            if args.variants:
                variants = {vn: v for vn, v in variants.items() if vn in args.variants}
            nbytes = n * k * dt.itemsize
            copies = max(1, -(-args.mb * 2 ** 20 // nbytes))
            ws = [torch.randn(n, k, generator=g).to(dt) for _ in range(copies)]
            packed = [pack(w) for w in ws] if "onednn" in variants else []
            if "blocked" not in variants:
                blocked = []
            elif dname == "bf16w":
                blocked = [bf16_weights.block_bf16(w) for w in ws]
            else:
                blocked = [gemv_kernel.BlockedWeight(gemv_kernel.block(w), n) for w in ws]
            x = torch.randn(m, k, generator=g).to(torch.float32 if dname == "bf16w" else dt)
            ref = torch.nn.functional.linear(x.double(), ws[0].double())

            def run(v):
                if v is None:
                    return [packed_linear(x, p, None) for p in packed]
                if v == "flinear":
                    return [torch.nn.functional.linear(x, w.to(x.dtype)) for w in ws]
                if v == "chunked":
                    return [chunked_linear(x, w) for w in ws]
                if v == "bf16w":
                    return [gemv_kernel.bf16w_linear(x, w, None) for w in ws]
                if v == "blocked" and dname == "bf16w":
                    return [gemv_kernel.bf16w_blocked_linear(x, b, n, None) for b in blocked]
                if v == "blocked":
                    return [gemv_kernel.blocked_linear(x, b, None) for b in blocked]
                return [gemv_kernel.gemv_raw(x, w, None, threads=1, **v) for w in ws]

            err = {}
            for vn, v in variants.items():
                y = run(v)[0].double()
                err[vn] = float(((y - ref).abs().max() / ref.abs().max()))
            times = {vn: [] for vn in variants}
            cpu = {vn: [] for vn in variants}
            for _ in range(args.repeats):
                for vn, v in variants.items():
                    c0, t0 = time.thread_time(), time.perf_counter()
                    run(v)
                    times[vn].append(time.perf_counter() - t0)
                    cpu[vn].append(time.thread_time() - c0)
            total = nbytes * copies
            row = dict(dtype=dname, model=model, tp=tp, matrix=name, out=n, inp=k, rows=m, mb=total / 1e6,
                       load=os.getloadavg()[0])
            for vn in variants:
                row[f"{vn}_gbs"] = total / statistics.median(times[vn]) / 1e9
                row[f"{vn}_best_gbs"] = total / min(times[vn]) / 1e9
                row[f"{vn}_cpu_gbs"] = total / statistics.median(cpu[vn]) / 1e9
                row[f"{vn}_maxrel"] = err[vn]
            rows.append(row)
            print(json.dumps(row), flush=True)
            del ws, packed, blocked
    sr1 = _stream_read(exe, 256)
    limit = max(sr0[1], sr1[1]) if sr0 else None
    meta = dict(machine=m0, machine_end=machine(), torch=torch.__version__, threads=1,
                stream_read_start=sr0, stream_read_end=sr1, limit_1t=limit, repeats=args.repeats,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), max_rows=gemv_kernel.MAX_ROWS,
                modes={"1 row": {d: gemv_kernel.mode(dts[d], 1) for d in args.dtypes}},
                target=gemv_kernel.target())
    la0, la1 = m0["loadavg"], meta["machine_end"]["loadavg"]
    top = max([la0[0], la1[0]] + [r["load"] for r in rows])
    meta["loaded"] = top >= 1.0
    lines = [f"# Decode matmuls at a few rows: oneDNN prepacked against our GEMV, GB/s of weights ({meta['date']}"
             + (f", loaded: 1-minute load average up to {top:.1f})" if meta["loaded"] else ")"),
             "", f"{m0['cpu']}, {m0['cores']} cores, torch {meta['torch']}, one thread. Load average "
             f"{la0[0]:.2f} / {la0[1]:.2f} / {la0[2]:.2f} at start, {la1[0]:.2f} / {la1[1]:.2f} / {la1[2]:.2f} at "
             f"end (the machine was shared: other work ran on its 2 cores). Memory-read limit, one thread "
             f"(bench/stream_read.c, {STREAM_READ_STREAMS} streams, best of 30): start "
             + (f"{sr0[1] / 1e9:.1f} GB/s, end {sr1[1] / 1e9:.1f} GB/s; fractions below are of the better, "
                f"{limit / 1e9:.1f} GB/s." if sr0 else "not measured (no gcc)."), "",
             "Each cell: median GB/s from wall time over the repeats (best in parentheses), its fraction of the "
             "limit, then `cpu` the median GB/s from the thread's CPU time. oneDNN: "
             "`_linear_pointwise` on the `_reorder_linear_weight` weight (the lean path before); flinear: "
             "`F.linear` on the plain weight (bf16w: `F.linear(x, w.float())`, the weight converted per call); ours: "
             f"tensorpar.decode.gemv_kernel (build `{meta['target']}`) on the plain [out, in] weight (one input row "
             "against rows of >= 2 KB: 8 weight rows at a time, 8 streams; else one weight row at a time) (bf16: `vdpbf16ps`, or both widened without AVX512_BF16; bf16w: the weights widened, "
             "`bf16w_linear`); ours pf: with a software prefetch 1024 elements ahead; ours widen (bf16): weights "
             "widened to fp32 and fma with the input in fp32; ours pairs (more than one row): two weight rows at a "
             "time, each input vector loaded once for both; blocked (fp32; bf16w: its bf16 form, `block_bf16`): ours on the blocked layout that replaces the "
             "plain weight (`gemv_kernel.BlockedWeight`: blocks of 32 output rows, k-major, the inputs broadcast into "
             "output vectors); chunked (bf16w): `bf16_weights.chunked_linear`, the "
             "path without our kernel. ours / oneDNN: the best of ours, ours widen and ours pairs (bf16w: ours / "
             "chunked; where oneDNN has no bf16 kernels, as on AVX2: ours / flinear). "
             "max rel: largest |y - fp64 reference| / max |reference| of the first copy (ours, else the first "
             "variant).", ""]
    for dname in args.dtypes:
        sel = [r for r in rows if r["dtype"] == dname]
        if not sel:
            continue
        vns = list(dict.fromkeys(k[:-4] for r in sel for k in r
                                 if k.endswith("_gbs") and not k.endswith(("_best_gbs", "_cpu_gbs"))))
        lines += [f"## {dname}", "", "| model | tp | matrix | out x in | rows | MB read | "
                  + " | ".join(vns) + " | ours / oneDNN (blocked / ours) | max rel | load |",
                  "|---|---|---|---|---|---|" + "---|" * len(vns) + "---|---|---|"]
        for r in sel:
            cells = []
            for vn in vns:
                if vn + "_gbs" not in r:
                    cells.append("-")
                    continue
                frac = f", {r[vn + '_gbs'] * 1e9 / limit:.2f}" if limit else ""
                cells.append(f"{r[vn + '_gbs']:.1f} ({r[vn + '_best_gbs']:.1f}){frac}, cpu {r[vn + '_cpu_gbs']:.1f}")
            ours = max(r.get("ours_gbs", 0), r.get("ours_widen_gbs", 0), r.get("ours_pairs_gbs", 0))
            base = r.get("onednn_gbs", r.get("chunked_gbs", r.get("flinear_gbs")))
            ratio = f"{ours / base:.2f}x" if base and ours else "-"
            if "blocked_gbs" in r and ours:
                ratio += f"; blocked / ours {r['blocked_gbs'] / ours:.2f}x"
            first = next(vn for vn in vns if vn + "_maxrel" in r)
            rel = r.get("ours_maxrel", r[first + "_maxrel"])
            lines.append(f"| {r['model']} | {r['tp']} | {r['matrix']} | {r['out']} x {r['inp']} | {r['rows']} | "
                         f"{r['mb']:.0f} | " + " | ".join(cells) + f" | {ratio} | {rel:.1e} | {r['load']:.2f} |")
        lines.append("")
    write_results(Path(args.out), meta, rows, lines)


if __name__ == "__main__":
    main()
