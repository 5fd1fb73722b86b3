"""Decode speed, time to first token and peak memory of `tensorpar generate` against transformers.

All rows run in one invocation, each configuration in fresh processes (so peak RSS is per
configuration): transformers' single-process ``generate`` with 1 and 2 threads, tensorpar at
tp = 1 (1 and 2 threads), tp = 2 (one thread per rank; gloo, and the shared-memory path when
available) and tp = 4 (memory). Greedy, fp32, the same prompt, 32 new tokens (EOS ignored).

Where the time goes at tp > 1: every rank counts its collectives per token and times the same
all-reduce (one token's hidden state) 200 times (``comm ms/token (loop x median)``: collectives
per token x median latency), and also times every collective of the real run, waits for the
slower rank included (``comm ms/token in the run``). The last row runs the same 30 layers with
tiny matrices: the per-token floor of Python and framework work that every rank pays.

    python bench/bench_generate.py [--model smollm2] [--tokens 32] [--out bench/results]

Writes ``generate.json`` and ``generate.md`` under ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT = "The capital of France is"


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def job_hf(ctx, folder, n, threads):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok(PROMPT, return_tensors="pt")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):  # time stamps of every new token, from inside the same generate call
        def __init__(self):
            self.t = []

        def put(self, value):
            self.t.append(time.perf_counter())

        def end(self):
            pass

    with torch.no_grad():
        model.generate(**ids, max_new_tokens=2, do_sample=False)                 # warm-up
        stamps = Stamps()
        t0 = time.perf_counter()
        out = model.generate(**ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                             streamer=stamps)
    ttft = stamps.t[1] - t0              # put() #0 is the prompt, #1 the first new token
    total = stamps.t[-1] - t0
    assert out.shape[1] - ids["input_ids"].shape[1] == n
    return {"ttft_ms": ttft * 1e3, "decode_tok_s": (n - 1) / max(total - ttft, 1e-9), "peak_rss_mb": _rss_mb(),
            "text": tok.decode(out[0, ids["input_ids"].shape[1]:])}


def job_tp(ctx, folder, n, threads, fast):
    from transformers import AutoTokenizer

    from tensorpar import comm
    from tensorpar.generate import SamplingConfig, generate_tokens
    from tensorpar.hf.load import build_parallel_model
    torch.set_num_threads(threads)
    if fast and ctx.tp.size > 1:
        from tensorpar.shm import enable_fast_collectives
        enable_fast_collectives(ctx.tp, "on")
    rss0 = _rss_mb()
    model, plan = build_parallel_model(folder, ctx.tp)
    rss_loaded = _rss_mb()
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    cfg = SamplingConfig(max_new_tokens=n)
    generate_tokens(model, ctx.tp, ids, sampling=SamplingConfig(max_new_tokens=2))  # warm-up
    spent = [0.0]
    originals = {k: getattr(comm, k) for k in ("all_reduce", "all_gather", "broadcast")}

    def timed(fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t0
        return wrapper

    for k, fn in originals.items():  # time every collective of the real run, waits for the peer included
        setattr(comm, k, timed(fn))
    try:
        with comm.counting(ctx.tp) as c:
            res = generate_tokens(model, ctx.tp, ids, sampling=cfg)
    finally:
        for k, fn in originals.items():
            setattr(comm, k, fn)
    calls = sum(c.calls.values())
    lat = []
    if ctx.tp.size > 1:
        x = torch.randn(1, 1, model.config.hidden_size)
        for _ in range(20):
            comm.all_reduce(x, ctx.tp)
        for _ in range(200):
            t0 = time.perf_counter()
            comm.all_reduce(x, ctx.tp)
            lat.append(time.perf_counter() - t0)
    med = statistics.median(lat) if lat else 0.0
    per_token = calls / n
    step_ms = 1e3 / res.decode_tokens_per_s
    return {"ttft_ms": res.ttft_s * 1e3, "decode_tok_s": res.decode_tokens_per_s, "peak_rss_mb": _rss_mb(),
            "weights_rss_mb": rss_loaded - rss0, "collectives_per_token": per_token,
            "allreduce_median_us": med * 1e6, "comm_ms_per_token": per_token * med * 1e3,
            "comm_ms_per_token_in_run": spent[0] / res.tokens.shape[1] * 1e3,
            "step_ms": step_ms, "text": tok.decode(res.tokens[0])}


def job_overhead(ctx, folder, n, path="auto"):
    """Step time of the same architecture with tiny matrices: the per-token Python/framework floor (``path``:
    generate_tokens' decode path; ``"lean"`` raises ValueError for a family without it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tensorpar.generate import SamplingConfig, generate_tokens
    from tensorpar.hf.apply import parallelize
    from tensorpar.hf.plan import make_plan
    torch.set_num_threads(1)
    cfg = AutoConfig.from_pretrained(folder)
    cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.vocab_size = 72, 64, 8, 256
    cfg._attn_implementation = "sdpa"
    model = parallelize(AutoModelForCausalLM.from_config(cfg).eval(), make_plan(cfg, ctx.tp.size), ctx.tp)
    ids = torch.tensor([[1, 5, 7, 9, 11, 13]])
    generate_tokens(model, ctx.tp, ids, sampling=SamplingConfig(max_new_tokens=2), path=path)
    res = generate_tokens(model, ctx.tp, ids, sampling=SamplingConfig(max_new_tokens=n), path=path)
    return {"ttft_ms": res.ttft_s * 1e3, "decode_tok_s": res.decode_tokens_per_s, "peak_rss_mb": _rss_mb(),
            "step_ms": 1e3 / res.decode_tokens_per_s, "text": ""}


def run(folder: str, n: int, fast_available: bool) -> list[dict]:
    from tensorpar.testing import WorkerPool
    rows = []

    def one(name, world, fn, *args):
        with WorkerPool(world, collective_timeout_s=120, job_timeout_s=1200) as pool:
            res = pool.run(fn, *args)
        r = dict(res[0])
        r.update(config=name, ranks=world, peak_rss_mb_per_rank=[round(x["peak_rss_mb"]) for x in res])
        rows.append(r)
        print(f"{name:<38} ttft {r['ttft_ms']:7.1f} ms   decode {r['decode_tok_s']:6.1f} tok/s   "
              f"rss/rank {r['peak_rss_mb_per_rank']} MB", flush=True)

    one("transformers generate, 1 thread", 1, job_hf, folder, n, 1)
    one("transformers generate, 2 threads", 1, job_hf, folder, n, 2)
    one("tensorpar tp=1, 1 thread", 1, job_tp, folder, n, 1, False)
    one("tensorpar tp=1, 2 threads", 1, job_tp, folder, n, 2, False)
    one("tensorpar tp=2, 1 thread/rank, gloo", 2, job_tp, folder, n, 1, False)
    if fast_available:
        one("tensorpar tp=2, 1 thread/rank, shm", 2, job_tp, folder, n, 1, True)
    one("tensorpar tp=4, 1 thread/rank, gloo", 4, job_tp, folder, min(n, 8), 1, False)
    one("same 30 layers, tiny matrices, tp=1 (overhead)", 1, job_overhead, folder, n)
    return rows


def write(rows: list[dict], out: Path, n: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    base = next(r for r in rows if r["config"] == "tensorpar tp=1, 1 thread")
    meta = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "torch": torch.__version__,
            "new_tokens": n, "prompt": PROMPT, "date": time.strftime("%Y-%m-%d %H:%M")}
    tmp = out / "generate.json.tmp"
    tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    os.replace(tmp, out / "generate.json")
    lines = [f"Greedy decode of {n} tokens, fp32, prompt {PROMPT!r}; {meta['machine']}, torch {meta['torch']}, "
             f"{meta['date']}.", "",
             "| configuration | TTFT ms | decode tok/s | vs tp=1 (1 thread) | peak RSS per rank MB | "
             "collectives/token | all-reduce median µs | comm ms/token (loop x median) | comm ms/token in the run "
             "| step ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['ttft_ms']:.1f} | {r['decode_tok_s']:.1f} | "
                     f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}x | {r['peak_rss_mb_per_rank']} | "
                     f"{r.get('collectives_per_token', 0):.0f} | {r.get('allreduce_median_us', 0):.0f} | "
                     f"{r.get('comm_ms_per_token', 0):.1f} | {r.get('comm_ms_per_token_in_run', 0):.1f} | "
                     f"{r.get('step_ms', 1e3 / r['decode_tok_s']):.1f} |")
    tmp = out / "generate.md.tmp"
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, out / "generate.md")
    print("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    a = p.parse_args()
    from tensorpar.hub import resolve_model
    folder = str(resolve_model(a.model))
    try:
        import tensorpar.shm  # noqa: F401
        fast = True
    except ImportError:
        fast = False
    write(run(folder, a.tokens, fast), Path(a.out), a.tokens)


if __name__ == "__main__":
    main()
