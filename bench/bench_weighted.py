"""Capacity-weighted tensor parallelism with one slow rank: even split vs weighted split vs ``auto``.

    python bench/bench_weighted.py [--factor 3] [--rounds 3]    # writes bench/results/weighted.{json,md}

Two tp ranks, one thread each (the machine has 2 cores), shared-memory collectives. Rank 1 is made a slower
device by a *matmul throttle* that the bench installs and removes itself: a ``TorchDispatchMode`` on rank 1
that times every matrix-product kernel (``mm``, ``addmm``, ``bmm``, ``baddbmm``, the CPU SDPA kernels, forward
and backward) and then spins until its thread has used ``factor - 1`` times the CPU time the product used
(CPU time, so that the slowdown does not depend on how loaded the shared machine is). Rank 1 thus computes matrix products ``factor``
times slower and keeps its core busy meanwhile, as a slower device would be busy (a sleep would let other
processes on this shared machine use the time, so the slowdown would depend on their load); the ``auto``
measurement (a timed GEMM) sees it as any slow device would be seen. Matrix products are ~75% of a decode
step of this model on this CPU, the rest (norms, rotary, sampling, Python) runs at rank 0's speed.

Why not a CPU quota (cgroup ``cpu.max``, or a SIGSTOP/SIGCONT duty cycle) as the issue suggests: no cgroup
is writable here, and a duty cycle stops the whole process for milliseconds at a time, while the two ranks
meet in an all-reduce every ~1 ms (two per layer); every stop then stalls both ranks whatever the split, so
a duty-cycled rank is a stalling device, not a slower one, and no split can help it (``--sigstop`` runs the
same variants under such a duty cycle instead, for comparison).

Variants, interleaved over ``--rounds`` rounds in the same processes (the order rotated every round): each rank alone with the whole model
(tp = 1, both at once: rank 0 at full speed, rank 1 throttled; their speeds s0 and s1); tp = 2 even split
without throttle; and with rank 1 throttled: even split, weighted ``factor,1``, and ``auto``
(:func:`tensorpar.capacity.measure_tp_weights`, the function ``--tp-weights auto`` runs, measured with the
throttle on). Decode: greedy, batch 4, 16 new tokens; training: forward, vocab-parallel loss and backward of
a 1 x 128-token batch. Target (issue 12): the weighted split reaches >= 80% of ``s0 + s1``, the throughput
the two ranks' summed speed allows. The tp = 2 split also pays collectives and per-token framework work
that one rank alone does not; the unthrottled even tp = 2 row shows how much of ``2 x s0`` that leaves.

Model: Llama, hidden 1024, 4 layers, 16 query / 4 KV heads (head_dim 64), MLP 2816, vocabulary 16000 (tied),
random weights, fp32. The machine is shared: the 1-minute load average at start and end is recorded.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "mv", "addmv", "_scaled_dot_product_flash_attention_for_cpu",
              "_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_efficient_attention",
              "_efficient_attention_backward", "_flash_attention_forward", "_flash_attention_backward"}


class MatmulThrottle(TorchDispatchMode):
    """Makes this process's matrix products ``factor`` times slower: after each one it spins (busy) until its
    thread has used ``(factor - 1) x`` the CPU time the product used, as a device ``factor`` times slower would
    be busy. CPU time, not wall time: on a loaded machine the slowdown stays ``factor`` whatever share of a
    core the scheduler gives the rank."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = float(factor)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ not in MATMUL_OPS:
            return func(*args, **kwargs)
        t0 = time.thread_time()
        out = func(*args, **kwargs)
        t1 = time.thread_time()
        end = t1 + (t1 - t0) * (self.factor - 1.0)
        while time.thread_time() < end:
            pass
        return out


class SigstopThrottle:
    """A child process that stops this process for ``off_ms`` every ``period_ms`` (SIGSTOP / SIGCONT)."""

    def __init__(self, period_ms: float, duty: float):
        self.period, self.duty, self.proc = period_ms, duty, None

    def __enter__(self):
        code = ("import os,signal,sys,time\npid=int(sys.argv[1]);p=float(sys.argv[2])/1e3;d=float(sys.argv[3])\n"
                "try:\n while True:\n  time.sleep(p*d);os.kill(pid,signal.SIGSTOP);time.sleep(p*(1-d));"
                "os.kill(pid,signal.SIGCONT)\nexcept BaseException:\n os.kill(pid,signal.SIGCONT)\n")
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(os.getpid()), str(self.period), str(self.duty)])
        return self

    def __exit__(self, *exc):
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait()
        os.kill(os.getpid(), signal.SIGCONT)


def model_config():
    from transformers import LlamaConfig
    cfg = LlamaConfig(vocab_size=16000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=4, head_dim=64, max_position_embeddings=512,
                      tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    return cfg


def job(ctx, factor: float, rounds: int, tokens: int, sigstop: bool):
    import contextlib

    from transformers import AutoModelForCausalLM

    from tensorpar.capacity import measure_tp_weights
    from tensorpar.comm import Group
    from tensorpar.generate import SamplingConfig, generate_tokens
    from tensorpar.hf.apply import parallelize
    from tensorpar.hf.plan import make_plan
    from tensorpar.layers import vocab_parallel_cross_entropy
    from tensorpar.shm import enable_fast_collectives

    torch.set_num_threads(1)
    enable_fast_collectives(ctx.tp, "on")
    tp, slow = ctx.tp, ctx.tp.rank == 1
    cfg = model_config()
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg).float().eval()
    single = Group.single("tp")

    def throttle(on: bool):
        if not (on and slow):
            return contextlib.nullcontext()
        return SigstopThrottle(20.0, 1.0 / factor) if sigstop else MatmulThrottle(factor)

    with throttle(True):
        auto = measure_tp_weights(ctx, seconds=1.0)
    models = {"solo": parallelize(copy.deepcopy(ref), make_plan(cfg, 1), single)}
    variants = {"solo": (single, None, True), "even, no throttle": (tp, None, False),
                "even": (tp, None, True), f"weighted {factor:g},1": (tp, (float(factor), 1.0), True),
                f"auto {auto[0]:g},{auto[1]:g}": (tp, auto, True)}
    for name, (g, w, _) in variants.items():
        if name != "solo":
            key = str(w)
            models[name] = models.get(key) or parallelize(copy.deepcopy(ref), make_plan(cfg, 2, tp_weights=w), tp)
            models[key] = models[name]
    del ref
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (4, 16), generator=gen)
    batch = torch.randint(0, cfg.vocab_size, (1, 128), generator=gen)
    out = {n: {"decode_tok_s": [], "train_step_s": []} for n in variants}
    names = list(variants)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]      # rotated each round: no variant always last
        for name in order:
            g, w, thr = variants[name]
            m = models[name]
            if g is tp:
                torch.distributed.barrier(group=tp.pg)
            with throttle(thr):
                m.eval()
                n = 2 if r == 0 else tokens      # round 0 also warms up
                res = generate_tokens(m, g, prompt, sampling=SamplingConfig(max_new_tokens=n))
                if r > 0:
                    out[name]["decode_tok_s"].append(res.decode_tokens_per_s * prompt.shape[0])
                m.train()
                t0 = time.perf_counter()
                logits = m(batch).logits
                loss = vocab_parallel_cross_entropy(logits[:, :-1], batch[:, 1:], g, partition=m)
                loss.backward()
                m.zero_grad(set_to_none=True)
                if r > 0:
                    out[name]["train_step_s"].append(time.perf_counter() - t0)
            if g is tp:
                torch.distributed.barrier(group=tp.pg)
    return {"auto_weights": auto, "variants": out,
            "heads": {n: list(make_plan(cfg, 2, tp_weights=w).heads.q_heads.sizes) if g is tp else [16]
                      for n, (g, w, _) in variants.items()}}


def summarize(res: list[dict], tokens_per_step: int) -> dict:
    """Per variant, the median and the best sample (best: highest decode rate, shortest step; on a loaded machine
    the best sample is the least disturbed one), each against the summed solo speeds of the same statistic."""
    rows, bound = {}, {}
    for stat, pick_rate, pick_time in (("median", statistics.median, statistics.median), ("best", max, min)):
        def rate(r, name):
            v = r["variants"][name]
            return pick_rate(v["decode_tok_s"]), tokens_per_step / pick_time(v["train_step_s"])
        s0, s1 = rate(res[0], "solo"), rate(res[1], "solo")
        bound[stat] = {"decode_tok_s": s0[0] + s1[0], "train_tok_s": s0[1] + s1[1],
                       "rank0_solo": {"decode_tok_s": s0[0], "train_tok_s": s0[1]},
                       "rank1_solo": {"decode_tok_s": s1[0], "train_tok_s": s1[1]}}
        for name in res[0]["variants"]:
            if name == "solo":
                continue
            d, t = rate(res[0], name)
            rows.setdefault(name, {"heads_per_rank": res[0]["heads"][name],
                                   "samples": len(res[0]["variants"][name]["decode_tok_s"])})
            rows[name][stat] = {"decode_tok_s": d, "train_tok_s": t, "train_step_s": tokens_per_step / t,
                                "of_summed_speed": {"decode": d / bound[stat]["decode_tok_s"],
                                                    "train": t / bound[stat]["train_tok_s"]}}
    # Paired per round (the variants of one round ran back to back, so they saw about the same load): each
    # variant's decode rate and training step time against the even split's of the same round.
    ev = res[0]["variants"]["even"]
    for name in rows:
        v = res[0]["variants"][name]
        dec = [a / b for a, b in zip(v["decode_tok_s"], ev["decode_tok_s"])]
        trn = [b / a for a, b in zip(v["train_step_s"], ev["train_step_s"])]
        rows[name]["vs_even_same_round"] = {"decode_speedup_median": statistics.median(dec),
                                            "train_speedup_median": statistics.median(trn),
                                            "decode_rounds_faster": sum(x > 1 for x in dec),
                                            "train_rounds_faster": sum(x > 1 for x in trn), "rounds": len(dec)}
    return {"summed_speed": bound, "rows": rows, "auto_weights": res[0]["auto_weights"]}


def write_md(doc: dict, path: Path) -> None:
    s = doc["summary"]
    lines = [f"# Capacity-weighted tp: one slow rank ({doc['throttle']})", "",
             f"{doc['when']}; {doc['machine']}; 1-minute load average {doc['loadavg_start'][0]:.1f} at start and "
             f"{doc['loadavg_end'][0]:.1f} at the end (2 cores: above 2, other processes shared the cores and the "
             f"numbers are noisy). Model: {doc['model']}. Decode: greedy, batch {doc['decode_batch']}, "
             f"{doc['tokens']} new tokens; training: forward + loss + backward of {doc['train_tokens']} tokens. "
             f"{doc['rounds'] - 1} interleaved rounds (round 0 warms up); median and best sample.", ""]
    for stat in ("median", "best"):
        b = s["summed_speed"][stat]
        lines.append(f"- {stat}: each rank alone (tp = 1, whole model, both at once): rank 0 "
                     f"{b['rank0_solo']['decode_tok_s']:.1f} decode tok/s, {b['rank0_solo']['train_tok_s']:.0f} train "
                     f"tok/s; rank 1 (throttled) {b['rank1_solo']['decode_tok_s']:.1f} and "
                     f"{b['rank1_solo']['train_tok_s']:.0f}; summed speed {b['decode_tok_s']:.1f} decode tok/s, "
                     f"{b['train_tok_s']:.0f} train tok/s.")
    lines += ["", f"`auto` measured weights {','.join(f'{w:g}' for w in s['auto_weights'])} (a 1 s GEMM on each "
                  f"rank, throttle on).", "",
              "| tp = 2 variant | heads per rank | decode tok/s median (best) | of summed speed median (best) | "
              "train tok/s median (best) | of summed speed median (best) |", "|---|---|---:|---:|---:|---:|"]
    for name, r in s["rows"].items():
        m, b = r["median"], r["best"]
        lines.append(f"| {name} | {r['heads_per_rank']} | {m['decode_tok_s']:.1f} ({b['decode_tok_s']:.1f}) | "
                     f"{m['of_summed_speed']['decode']:.0%} ({b['of_summed_speed']['decode']:.0%}) | "
                     f"{m['train_tok_s']:.0f} ({b['train_tok_s']:.0f}) | "
                     f"{m['of_summed_speed']['train']:.0%} ({b['of_summed_speed']['train']:.0%}) |")
    lines += ["", "Paired by round (variants of one round ran back to back, under about the same load): speed-up "
                  "against the even split of the same round, median over rounds, and rounds in which it was faster:",
              "", "| tp = 2 variant | decode speed-up vs even | rounds faster | train speed-up vs even | rounds "
                  "faster |", "|---|---:|---:|---:|---:|"]
    for name, r in s["rows"].items():
        p = r["vs_even_same_round"]
        if name != "even":
            lines.append(f"| {name} | {p['decode_speedup_median']:.2f}x | {p['decode_rounds_faster']}/{p['rounds']} | "
                         f"{p['train_speedup_median']:.2f}x | {p['train_rounds_faster']}/{p['rounds']} |")
    lines += ["", "Target (issue 12): weighted >= 80% of the summed speed. `even, no throttle` is the same tp = 2 "
                  "run with rank 1 at full speed (its summed speed would be 2 x rank 0's): it shows what collectives "
                  "and per-token framework work leave of the ideal on this machine, throttle or not.", ""]
    path.write_text("\n".join(lines))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--factor", type=float, default=3.0, help="rank 1's matrix products are this much slower")
    ap.add_argument("--rounds", type=int, default=6, help="interleaved rounds (the first warms up)")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--sigstop", action="store_true", help="throttle with a SIGSTOP/SIGCONT duty cycle (20 ms "
                                                           "period, running 1/factor of it) instead")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--resummarize", action="store_true", help="rebuild the .md and the summary from the .json's "
                                                                 "raw samples (no new measurement)")
    a = ap.parse_args()
    name = "weighted-sigstop" if a.sigstop else "weighted"
    out = Path(a.out)
    if a.resummarize:
        doc = json.loads((out / f"{name}.json").read_text())
        doc["summary"] = summarize(doc["raw"], doc["train_tokens"])
        return _write(doc, out, name)
    from tensorpar.testing import WorkerPool
    load0 = os.getloadavg()
    t0 = time.time()
    with WorkerPool(2, collective_timeout_s=300, job_timeout_s=3000) as pool:
        res = pool.run(job, a.factor, a.rounds, a.tokens, a.sigstop, timeout_s=3000)
    doc = {"when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
           "throttle": (f"rank 1 stopped by SIGSTOP for {1 - 1 / a.factor:.0%} of every 20 ms" if a.sigstop else
                        f"rank 1's matrix products {a.factor:g}x slower (MatmulThrottle)"),
           "model": "Llama hidden 1024, 4 layers, 16/4 heads, MLP 2816, vocab 16000, fp32, random weights",
           "factor": a.factor, "rounds": a.rounds, "tokens": a.tokens, "decode_batch": 4, "train_tokens": 128,
           "loadavg_start": load0, "loadavg_end": os.getloadavg(), "wall_s": time.time() - t0,
           "summary": summarize(res, 128), "raw": res}
    _write(doc, out, name)


def _write(doc: dict, out: Path, name: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for suffix, text in (("json", json.dumps(doc, indent=1)), ):
        tmp = out / f"{name}.{suffix}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / f"{name}.{suffix}")
    tmp = out / f"{name}.md.tmp"
    write_md(doc, tmp)
    os.replace(tmp, out / f"{name}.md")
    print((out / f"{name}.md").read_text())


if __name__ == "__main__":
    main()
