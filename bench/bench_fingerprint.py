"""Overhead of collective fingerprints (tensorpar.fingerprint) on decode and on a training step, tp = 2 gloo ranks.

    python bench/bench_fingerprint.py        # writes bench/results/fingerprint.json
    python bench/bench_fingerprint.py --generate-cli   # end to end: writes bench/results/fingerprint-generate.json

``--generate-cli``: the whole ``tensorpar generate --model smollm2 --tp 2`` command, alternately without and
with ``--check-collectives`` over ``--rounds`` rounds (fresh ranks each run; the model is read from the cache),
``--tokens`` greedy tokens; reported: the decode rate of its stats line and the command's wall time, medians,
and the overhead of the medians.

Model: the ``small`` training preset (Llama, 4 layers, hidden 256) with vocabulary 997, random weights.
Variants, interleaved over ``--rounds`` rounds in the same run: fingerprints off; on with a check every
``--every`` steps (the issue's N = 50), ``sync_every=0``; sync: the same plus the comparison before every
collective (``sync_every=1``, the default of ``enable`` since issue 27). Decode: greedy ``generate_tokens`` of ``--tokens`` tokens, the check
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
sys.path.insert(0, str(ROOT / "bench"))
from machine import cpu_model  # noqa: E402


def job(ctx, rounds: int, tokens: int, steps: int, every: int):
    from transformers import AutoModelForCausalLM

    from tensorpar.fingerprint import check, disable, enable
    from tensorpar.generate import SamplingConfig, generate_tokens
    from tensorpar.hf.apply import parallelize
    from tensorpar.hf.plan import make_plan
    from tensorpar.layers import vocab_parallel_cross_entropy
    from tensorpar.hf.presets import preset_config

    tp = ctx.tp
    cfg = preset_config("small", 997, 64)
    torch.manual_seed(0)
    model = parallelize(AutoModelForCausalLM.from_config(cfg), make_plan(cfg, tp.size), tp)
    prompt = torch.randint(0, 997, (1, 16), generator=torch.Generator().manual_seed(0))
    batch = torch.randint(0, 997, (4, 64), generator=torch.Generator().manual_seed(1))
    variants = ("off", "on", "sync")
    out = {"decode": {v: [] for v in variants}, "train": {v: [] for v in variants}}
    for _ in range(rounds):
        for variant in variants:
            disable(tp)
            if variant != "off":  # on: compared per step only; sync: also before every collective
                enable(tp, every=every, model=model, sync_every=1 if variant == "sync" else 0)
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
    disable(tp)
    return out


def per_collective(ctx, n: int, rounds: int):
    """Seconds per all-reduce of 64 float32 on the tp group: fingerprints off, on (per step only), and sync (a store
    comparison before every collective); the best of ``rounds`` loops of ``n`` collectives each."""
    from tensorpar import comm
    from tensorpar.fingerprint import disable, enable

    tp, x = ctx.tp, torch.ones(64)
    out: dict = {"off": [], "on": [], "sync": []}
    for _ in range(rounds):
        for variant in out:
            disable(tp)
            if variant != "off":
                enable(tp, every=50, sync_every=1 if variant == "sync" else 0)
            comm.all_reduce(x, tp)
            t0 = time.perf_counter()
            for _ in range(n):
                comm.all_reduce(x, tp)
            out[variant].append((time.perf_counter() - t0) / n)
    disable(tp)
    return out


def generate_cli(a) -> None:
    import re
    import subprocess

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    rates: dict = {"off": [], "on": []}
    walls: dict = {"off": [], "on": []}
    load0 = os.getloadavg()
    for _ in range(a.rounds):
        for variant in ("off", "on"):
            cmd = [sys.executable, "-m", "tensorpar", "generate", "--model", a.model, "--tp", "2",
                   "--max-new-tokens", str(a.tokens), "--prompt", "Once upon a time there was"]
            if variant == "on":
                cmd.append("--check-collectives")
            t0 = time.perf_counter()
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
            walls[variant].append(time.perf_counter() - t0)
            m = re.search(r"decode ([0-9.]+) tokens/s", p.stdout + p.stderr)
            if p.returncode or not m:
                raise SystemExit(f"generate failed (rc {p.returncode}): {(p.stdout + p.stderr)[-2000:]}")
            rates[variant].append(float(m.group(1)))
            print(variant, rates[variant][-1], "tok/s", f"{walls[variant][-1]:.1f} s", flush=True)
    med = {v: statistics.median(rates[v]) for v in rates}
    wall = {v: statistics.median(walls[v]) for v in walls}
    doc = {"command": f"tensorpar generate --model {a.model} --tp 2 --max-new-tokens {a.tokens} "
                      f"[--check-collectives]", "rounds": a.rounds, "decode_tok_s": rates, "wall_s": walls,
           "median_decode_tok_s": med, "median_wall_s": wall,
           "decode_overhead_of_median": med["off"] / med["on"] - 1, "wall_overhead_of_median": wall["on"] / wall["off"] - 1,
           "cpu": cpu_model(), "cores": os.cpu_count(), "loadavg_at_start": load0, "loadavg_at_end": os.getloadavg(),
           "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    out = a.out if a.out.endswith("-generate.json") else str(ROOT / "bench" / "results" / "fingerprint-generate.json")
    tmp = out + ".tmp"
    Path(tmp).write_text(json.dumps(doc, indent=1))
    os.replace(tmp, out)
    print(json.dumps({k: doc[k] for k in ("median_decode_tok_s", "decode_overhead_of_median", "median_wall_s",
                                          "wall_overhead_of_median", "loadavg_at_start", "loadavg_at_end")}, indent=1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--generate-cli", action="store_true", help="time the whole tensorpar generate command instead")
    ap.add_argument("--model", default="smollm2", help="--generate-cli: the model")
    ap.add_argument("--per-collective", action="store_true",
                    help="time one all-reduce off / on / sync instead (writes --out)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=50)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "fingerprint.json"))
    a = ap.parse_args()
    if a.generate_cli:
        return generate_cli(a)
    from tensorpar.testing import WorkerPool
    if a.per_collective:
        with WorkerPool(2) as pool:
            r0 = pool.run(per_collective, 500, a.rounds, timeout_s=1800)[0]
        doc = {"tp": 2, "what": "all_reduce of 64 float32, gloo, best of --rounds loops of 500",
               "cpu": cpu_model(), "cores": os.cpu_count(), "best_us": {v: min(r0[v]) * 1e6 for v in r0}, "all_us": {v: [t * 1e6 for t in r0[v]] for v in r0},
               "loadavg_at_end": os.getloadavg(), "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        Path(a.out).write_text(json.dumps(doc, indent=1))
        print(json.dumps(doc, indent=1))
        return
    with WorkerPool(2) as pool:
        res = pool.run(job, a.rounds, a.tokens, a.steps, a.every, timeout_s=1800)
    r0 = res[0]
    summary = {}
    for what in ("decode", "train"):
        med = {v: statistics.median(r0[what][v]) for v in r0[what]}
        summary[what] = {"median_s": med, "best_s": {v: min(r0[what][v]) for v in r0[what]},
                         "overhead_of_median": {v: med[v] / med["off"] - 1 for v in med if v != "off"},
                         "samples": len(r0[what]["off"])}
    doc = {"tp": 2, "model": "preset small, vocab 997", "every": a.every, "rounds": a.rounds, "tokens": a.tokens,
           "train_steps_per_round": a.steps, "cpu": cpu_model(), "cores": os.cpu_count(), "loadavg_at_start": os.getloadavg(), "results": summary}
    tmp = a.out + ".tmp"
    Path(tmp).write_text(json.dumps(doc, indent=1))
    os.replace(tmp, a.out)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
