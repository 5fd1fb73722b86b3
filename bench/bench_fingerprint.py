"""Overhead of collective fingerprints (tensorpar.fingerprint) on decode and on a training step, tp = 2 gloo ranks.

    python bench/bench_fingerprint.py        # writes bench/results/fingerprint.json

Model: the ``small`` training preset (Llama, 4 layers, hidden 256) with vocabulary 997, random weights.
Variants, interleaved over ``--rounds`` rounds in the same run: fingerprints off; on with a check every
``--every`` steps (the issue's N = 50). Decode: greedy ``generate_tokens`` of ``--tokens`` tokens, the check
called from ``on_token`` with the prompt as the compared input; train: forward, vocab-parallel loss, backward,
the check with the batch as input. Reported: the median and best time per decode token / per training step of
each variant and the overhead of the medians. Numbers from a shared 2-core machine are noisy; the load average
is recorded.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def job(ctx, rounds: int, tokens: int, steps: int, every: int):
    from transformers import AutoModelForCausalLM

    from tensorpar.fingerprint import check, enable
    from tensorpar.generate import SamplingConfig, generate_tokens
    from tensorpar.hf.apply import parallelize
    from tensorpar.hf.plan import make_plan
    from tensorpar.layers import vocab_parallel_cross_entropy
    from tensorpar.train.config import preset_config

    tp = ctx.tp
    cfg = preset_config("small", 997, 64)
    torch.manual_seed(0)
    model = parallelize(AutoModelForCausalLM.from_config(cfg), make_plan(cfg, tp.size), tp)
    prompt = torch.randint(0, 997, (1, 16), generator=torch.Generator().manual_seed(0))
    batch = torch.randint(0, 997, (4, 64), generator=torch.Generator().manual_seed(1))
    out = {"decode": {"off": [], "on": []}, "train": {"off": [], "on": []}}
    for _ in range(rounds):
        for variant in ("off", "on"):
            tp.counter.fingerprint = None
            if variant == "on":
                enable(tp, every=every)
            model.eval()
            res = generate_tokens(model, tp, prompt, sampling=SamplingConfig(max_new_tokens=tokens),
                                  on_token=lambda s, t: check(tp, {"prompt": prompt}))
            out["decode"][variant].append(res.decode_s / (tokens - 1))
            model.train()
            for _ in range(steps):
                t0 = time.perf_counter()
                logits = model(batch).logits
                loss = vocab_parallel_cross_entropy(logits[:, :-1], batch[:, 1:], tp, partition=model)
                loss.backward()
                check(tp, {"batch": batch})
                model.zero_grad(set_to_none=True)
                out["train"][variant].append(time.perf_counter() - t0)
    tp.counter.fingerprint = None
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=50)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "fingerprint.json"))
    a = ap.parse_args()
    from tensorpar.testing import WorkerPool
    with WorkerPool(2) as pool:
        res = pool.run(job, a.rounds, a.tokens, a.steps, a.every, timeout_s=1800)
    r0 = res[0]
    summary = {}
    for what in ("decode", "train"):
        med = {v: statistics.median(r0[what][v]) for v in ("off", "on")}
        summary[what] = {"median_s": med, "best_s": {v: min(r0[what][v]) for v in ("off", "on")},
                         "overhead_of_median": med["on"] / med["off"] - 1, "samples": len(r0[what]["off"])}
    doc = {"tp": 2, "model": "preset small, vocab 997", "every": a.every, "rounds": a.rounds, "tokens": a.tokens,
           "train_steps_per_round": a.steps, "loadavg_at_start": os.getloadavg(), "results": summary}
    tmp = a.out + ".tmp"
    Path(tmp).write_text(json.dumps(doc, indent=1))
    os.replace(tmp, a.out)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
