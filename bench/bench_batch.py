"""Batch decode and prefill (issue 28, item 7): tokens/s of the lean decode path at batch 1, 4, 16 and 64 and prefill
tokens/s of a 512-token prompt, tp=1 and tp=2 (one thread per rank), fp32 and bf16, on SmolLM2-135M and the
random-weight Llama of TinyLlama-1.1B's shape; transformers (one process, 2 threads) beside them in the same run.

Each (model, configuration) loads its model once and runs, in order: the prefill of a seeded 512-token random
prompt (batch 1; prefill tokens/s = 512 / time to the first token, the best of ``--rounds``), then a greedy
decode of ``--tokens`` new tokens at each batch (the rows are copies of a 16-token prompt; decode tokens/s =
batch x steps / decode time, the best of ``--rounds``). Rounds are interleaved over configurations (round 1 runs
every configuration, then round 2), so a load change hits every row alike. Small batches are memory-bound (every
weight read once per step); large batches and prefill are compute-bound, where the CPU's matrix units show
(AVX-512, AVX512_BF16 and AMX where the CPU has them: bf16 prefill).

    python bench/bench_batch.py [--models smollm2,tinyllama-random] [--tokens 16] [--rounds 2]

Writes ``batch.json`` and ``batch.md`` under bench/results (``--out``), with the CPU model and load averages.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import cpu_account, cpu_model, describe, loaded, other_work  # noqa: E402

BATCHES = (1, 4, 16, 64)
PREFILL = 512
PROMPT_LEN = 16


def _prompt(vocab: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (1, n), generator=g)


def job_tensorpar(ctx, folder, dtype, tokens, batches, prefill, max_rows=None):
    """On each rank: prefill tokens/s of a ``prefill``-token prompt and decode tokens/s at each batch. ``max_rows``:
    this run's :data:`tensorpar.decode.gemv_kernel.MAX_ROWS` (the most rows of the row step and of the fp32 GEMV;
    above it the weights are prepacked for oneDNN and steps run the general loop), for an A/B of that limit."""
    if max_rows is not None:
        from tensorpar.decode import gemv_kernel
        gemv_kernel.MAX_ROWS = max_rows
    from tensorpar.generate import SamplingConfig, generate_tokens, inference_only
    from tensorpar.hf.load import build_parallel_model
    torch.set_num_threads(1)
    if ctx.tp.size > 1:
        from tensorpar.shm import enable_fast_collectives
        enable_fast_collectives(ctx.tp, "on")
    model, _ = build_parallel_model(folder, ctx.tp, dtype=getattr(torch, dtype))
    inference_only(model)       # as the generate command: the engine keeps its weight layouts between calls
    vocab = model.config.vocab_size
    long = _prompt(vocab, prefill, 1)
    generate_tokens(model, ctx.tp, long[:, :32], sampling=SamplingConfig(max_new_tokens=2))         # warm-up
    r = generate_tokens(model, ctx.tp, long, sampling=SamplingConfig(max_new_tokens=1))
    out = {"prefill_tok_s": prefill / r.ttft_s, "decode": {}}
    short = _prompt(vocab, PROMPT_LEN, 2)
    for b in batches:
        ids = short.expand(b, PROMPT_LEN).contiguous()
        generate_tokens(model, ctx.tp, ids, sampling=SamplingConfig(max_new_tokens=2))              # warm-up
        r = generate_tokens(model, ctx.tp, ids, sampling=SamplingConfig(max_new_tokens=tokens))
        out["decode"][b] = r.decode_tokens_per_s * b
    return out


def job_transformers(ctx, folder, dtype, tokens, batches, prefill):
    """transformers' ``generate`` (one process, 2 threads): the same prefill and decode measurements."""
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    vocab = model.config.vocab_size
    long = _prompt(vocab, prefill, 1)
    with torch.no_grad():
        model(long[:, :32])
        t0 = time.perf_counter()
        model(long)
        out = {"prefill_tok_s": prefill / (time.perf_counter() - t0), "decode": {}}
        short = _prompt(vocab, PROMPT_LEN, 2)
        for b in batches:
            ids = short.expand(b, PROMPT_LEN).contiguous()
            kw = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
            model.generate(ids, max_new_tokens=2, **kw)
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, **kw)
            t1 = time.perf_counter()
            model.generate(ids, max_new_tokens=tokens + 1, **kw)
            t2 = time.perf_counter()
            # decode time: the whole generate minus the one-token generate (prefill and set-up)
            out["decode"][b] = b * tokens / max(1e-9, (t2 - t1) - (t1 - t0))
    return out


def model_folder(name: str) -> Path:
    if name == "tinyllama-random":
        from bench_hf_tp import model_folder as build
        from bench_llamacpp import TINYLLAMA, TINYLLAMA_SEED
        return build(None, TINYLLAMA, TINYLLAMA_SEED)
    from tensorpar.hub import resolve_model
    return Path(resolve_model(name))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,tinyllama-random")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--prefill", type=int, default=PREFILL)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--max-rows", default=None,
                    help="comma-separated values of gemv_kernel.MAX_ROWS to compare (each tensorpar row once per "
                         "value, e.g. 2,16: the row step up to 2 rows, as before 2026-12-03, against up to 16); "
                         "default: the library's")
    ap.add_argument("--no-transformers", action="store_true", help="skip transformers' rows")
    a = ap.parse_args()
    if a.max_rows and not all(v.strip().isdigit() and int(v) >= 1 for v in a.max_rows.split(",")):
        ap.error(f"--max-rows {a.max_rows}: must be comma-separated integers >= 1, e.g. 2,16")
    from tensorpar.testing import WorkerPool
    batches = tuple(int(b) for b in a.batches.split(","))
    specs = []
    for m in a.models.split(","):
        folder = str(model_folder(m))
        for dtype in a.dtypes.split(","):
            if not a.no_transformers:
                specs.append((m, f"transformers, 2 threads, {dtype}", 1, job_transformers, folder, dtype, None))
            for tp in (1, 2):
                for mr in (a.max_rows.split(",") if a.max_rows else [None]):
                    name = f"tensorpar tp={tp}, lean, {dtype}" + (f", MAX_ROWS {mr}" if mr else "")
                    specs.append((m, name, tp, job_tensorpar, folder, dtype, int(mr) if mr else None))
    load0, t_start, cpu0 = os.getloadavg(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), cpu_account()
    best: dict = {}
    for rnd in range(a.rounds):
        for m, name, world, fn, folder, dtype, mr in (specs if rnd % 2 == 0 else specs[::-1]):
            extra = () if mr is None else (mr,)
            with WorkerPool(world, collective_timeout_s=300, job_timeout_s=3600) as pool:
                r = pool.run(fn, folder, dtype, a.tokens, batches, a.prefill, *extra)[0]
            key = (m, name)
            old = best.get(key)
            if old is None:
                best[key] = r
            else:
                old["prefill_tok_s"] = max(old["prefill_tok_s"], r["prefill_tok_s"])
                for b in batches:
                    old["decode"][b] = max(old["decode"][b], r["decode"][b])
            print(m, name, f"prefill {r['prefill_tok_s']:.1f} tok/s",
                  " ".join(f"b{b} {r['decode'][b]:.1f}" for b in batches), flush=True)
    meta = {"cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__, "started": t_start,
            "loadavg_start": load0, "loadavg_end": os.getloadavg(), "rounds": a.rounds, "tokens": a.tokens,
            "prefill_tokens": a.prefill, "batches": batches, "other_work": other_work(cpu0, cpu_account())}
    rows = [{"model": m, "config": name, **best[(m, name)]} for m, name, *_ in specs]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "batch.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    busy = loaded(meta["other_work"])
    lines = ([f"**LOADED MACHINE ({describe(meta['other_work'])}): rerun on an idle machine before quoting these "
              f"numbers.**", ""] if busy else [])
    lines += [f"Batch decode and prefill (bench/bench_batch.py): {meta['cpu']}, {meta['cores']} cores, torch "
              f"{meta['torch']}, {t_start}; load average at start {' / '.join(f'{x:.2f}' for x in load0)}, at end "
              f"{' / '.join(f'{x:.2f}' for x in meta['loadavg_end'])}; {describe(meta['other_work'])}. Best of {a.rounds} interleaved rounds. Decode: "
              f"{a.tokens} new tokens after a {PROMPT_LEN}-token prompt per row, tokens/s summed over the batch; "
              f"prefill: one {a.prefill}-token prompt, tokens / time to the first token. tensorpar: one thread per "
              f"rank; transformers: one process, 2 threads.", "",
              "| model | configuration | prefill tok/s | " + " | ".join(f"batch {b} tok/s" for b in batches) + " |",
              "|---|---|---|" + "---|" * len(batches)]
    for r in rows:
        lines.append(f"| {r['model']} | {r['config']} | {r['prefill_tok_s']:.1f} | "
                     + " | ".join(f"{r['decode'][b]:.1f}" for b in batches) + " |")
    (out / "batch.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
