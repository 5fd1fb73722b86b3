"""Quality and cost of the compressed tp all-reduce (``--tp-comm int8``) against the exact one, SmolLM2-135M, tp=2.

In one pool of two gloo ranks (one host, loopback; shared-memory collectives off, as between hosts) this script

1. greedy-decodes ``--tokens`` (64) new tokens from bench_decode.py's prompt with ``Group.compression`` fp32 and
   int8 and reports the agreement (first differing position, fraction of equal positions);
2. computes the perplexity of the lean path at tp=2 on bench_decode.py's held-out Shakespeare slice
   (:mod:`tensorpar.data.shakespeare`, ``--ppl-tokens`` tokens in windows of 256) for fp32 and int8;
   and, on the same tokens, how often the int8 run's top-1 next token equals fp32's (teacher-forced agreement);
3. times one tp all-reduce of ``[1, n]`` fp32 partials (median of ``--reps``) for n = 576 (SmolLM2's hidden size,
   2.3 KB) and 4096 (16 KB), fp32 against int8, and counts their wire bytes.

    python bench/bench_tp_comm.py [--tokens 64] [--ppl-tokens 1024] [--out bench/results]

Writes ``tp_comm_int8.json`` and ``tp_comm_int8.md`` under ``--out`` with the CPU model and the load average at
start and end. The times are of loopback on one host, not of a slow link between hosts.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import PROMPT, prompt_inputs  # noqa: E402
from machine import cpu_model  # noqa: E402


def _ppl_ids(folder: str, n_tokens: int) -> tuple[torch.Tensor, str]:
    """The held-out slice bench_decode.perplexity scores: ``[1, n_tokens]`` ids and the work's name."""
    from transformers import AutoTokenizer

    from tensorpar.data.shakespeare import load_works, split_works
    _, val = split_works(load_works(progress=False), 0.05)
    text = val[0].text[4000:4000 + 8 * n_tokens]
    return AutoTokenizer.from_pretrained(folder)(text, return_tensors="pt")["input_ids"][:, :n_tokens], val[0].name


def job(ctx, folder: str, n_new: int, ppl_ids: torch.Tensor, reps: int, window: int = 256) -> dict:
    from tensorpar import comm
    from tensorpar.comm.compress import payload_bytes
    from tensorpar.decode.lean import LeanDecoder
    from tensorpar.generate import SamplingConfig, generate_tokens
    from tensorpar.hf.load import build_parallel_model
    torch.set_num_threads(1)
    tp = ctx.tp
    model, _ = build_parallel_model(folder, tp, dtype=torch.float32)
    ids = prompt_inputs(folder, 1)["input_ids"]
    out: dict = {}
    for mode in ("fp32", "int8"):
        tp.compression = mode
        generate_tokens(model, tp, ids, sampling=SamplingConfig(max_new_tokens=2))      # warm-up
        t0 = time.perf_counter()
        res = generate_tokens(model, tp, ids, sampling=SamplingConfig(max_new_tokens=n_new))
        gen_s = time.perf_counter() - t0
        lean = LeanDecoder(model, tp, max_batch=1, max_len=window)
        nll, count, top1 = 0.0, 0, []
        for s in range(0, ppl_ids.shape[1] - 1, window):
            chunk = ppl_ids[:, s:s + window]
            if chunk.shape[1] < 2:
                break
            pos = torch.arange(chunk.shape[1])[None]
            causal = torch.ones(chunk.shape[1], chunk.shape[1], dtype=torch.bool).tril()
            local = lean.forward(chunk, pos, causal, length=chunk.shape[1], start=0, last_only=False).float()
            sizes = [int(v) for v in comm.all_gather_json(local.shape[-1], tp.pg)]
            logits = comm.all_gather(local, tp, dim=-1, sizes=sizes)
            nll += torch.nn.functional.cross_entropy(logits[0, :-1], chunk[0, 1:], reduction="sum").item()
            count += chunk.shape[1] - 1
            top1 += logits[0, :-1].argmax(-1).tolist()
        out[mode] = {"tokens": res.tokens[0].tolist(), "ttft_s": res.ttft_s, "decode_s": res.decode_s,
                     "generate_s": gen_s, "ppl": math.exp(nll / count), "ppl_tokens": count,
                     "top1": top1}
        coll = {}
        for n in (576, 4096):
            x = torch.randn(1, n, generator=torch.Generator().manual_seed(tp.rank))
            for _ in range(5):
                comm.reduce_partial(x, tp)
            times = []
            for _ in range(reps):
                comm.all_reduce(torch.zeros(1), tp)                # line the ranks up (not timed)
                t = time.perf_counter()
                comm.reduce_partial(x, tp)
                times.append(time.perf_counter() - t)
            wire = (payload_bytes(n) * (tp.size - 1) if mode == "int8" else 2 * (tp.size - 1) / tp.size * 4 * n)
            coll[str(n)] = {"median_ms": statistics.median(times) * 1e3, "wire_bytes_per_rank": wire}
        out[mode]["collective"] = coll
    tp.compression = "fp32"
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--ppl-tokens", type=int, default=1024)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--out", default="bench/results")
    a = p.parse_args()
    from tensorpar.hub import resolve_model
    from tensorpar.testing import WorkerPool
    folder = str(resolve_model(a.model))
    ppl_ids, work = _ppl_ids(folder, a.ppl_tokens)
    load0 = os.getloadavg()
    with WorkerPool(2, collective_timeout_s=300.0, job_timeout_s=3000.0) as pool:
        res = pool.run(job, folder, a.tokens, ppl_ids, a.reps)
    load1 = os.getloadavg()
    r0, r1 = res
    assert r0["fp32"]["tokens"] == r1["fp32"]["tokens"] and r0["int8"]["tokens"] == r1["int8"]["tokens"]
    f, q = r0["fp32"]["tokens"], r0["int8"]["tokens"]
    first = next((i for i, (x, y) in enumerate(zip(f, q)) if x != y), len(f))
    equal = sum(x == y for x, y in zip(f, q)) / len(f)
    cpu = cpu_model()
    meta = {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "load_start": load0, "load_end": load1,
            "prompt": PROMPT, "ppl_work": work}
    t1f, t1q = r0["fp32"]["top1"], r0["int8"]["top1"]
    top1 = sum(x == y for x, y in zip(t1f, t1q)) / len(t1f)
    summary = {"first_diff": first, "equal_fraction": equal, "new_tokens": len(f), "teacher_forced_top1": top1,
               "ppl_fp32": r0["fp32"]["ppl"], "ppl_int8": r0["int8"]["ppl"]}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for r in res:                                       # the per-position argmaxes are summarised above
        for m in r.values():
            m.pop("top1")
    (out / "tp_comm_int8.json").write_text(json.dumps({"meta": meta, "summary": summary, "ranks": res}, indent=1))
    la = lambda t: ", ".join(f"{v:.1f}" for v in t)  # noqa: E731
    lines = [f"# --tp-comm int8 vs fp32, SmolLM2-135M fp32 weights, tp=2 (gloo, loopback, shm off)", "",
             f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}; load average {la(load0)} at start, "
             f"{la(load1)} at end (loaded, shared machine: times are indicative only).", "",
             f"Greedy, {len(f)} new tokens from {PROMPT!r}: first difference at position "
             f"{first if first < len(f) else 'none'}; {equal:.0%} of positions equal.", "",
             f"Perplexity, lean path at tp=2, {r0['fp32']['ppl_tokens']} scored tokens of the held-out "
             f"Shakespeare slice ({work}, windows of 256): fp32 {r0['fp32']['ppl']:.4f}, "
             f"int8 {r0['int8']['ppl']:.4f} ({(r0['int8']['ppl'] / r0['fp32']['ppl'] - 1) * 100:+.2f}%); on the same "
             f"tokens (teacher-forced) the int8 run's top-1 next token equals fp32's at {top1:.1%} of positions.", "",
             "| tp all-reduce of [1, n] fp32 | fp32 median ms | int8 median ms | fp32 wire B/rank | int8 wire B/rank |",
             "|---|---|---|---|---|"]
    for n in ("576", "4096"):
        a_, b_ = r0["fp32"]["collective"][n], r0["int8"]["collective"][n]
        lines.append(f"| n={n} ({int(n) * 4} B) | {a_['median_ms']:.3f} | {b_['median_ms']:.3f} | "
                     f"{a_['wire_bytes_per_rank']:.0f} | {b_['wire_bytes_per_rank']:.0f} |")
    lines += ["", f"Generate ({len(f)} tokens after a warm-up): TTFT of the "
              f"{len(prompt_inputs(folder, 1)['input_ids'][0])}-token prompt fp32 {r0['fp32']['ttft_s'] * 1e3:.0f} ms, "
              f"int8 {r0['int8']['ttft_s'] * 1e3:.0f} ms; decode fp32 {r0['fp32']['decode_s'] / len(f) * 1e3:.1f} "
              f"ms/token, int8 {r0['int8']['decode_s'] / len(f) * 1e3:.1f} ms/token (loopback, no slow link: this "
              f"shows the compression's compute cost, not its gain)."]
    (out / "tp_comm_int8.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
