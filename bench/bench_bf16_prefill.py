"""Prefill time of a bf16 model (``--dtype bfloat16``) with its matmul weights in the bf16 blocked layout against the
plain weights: what the decode speed of the blocked layout costs a prompt.

The 1.1B random Llama (``tinyllama-random``; or ``--model smollm2``) at tp=1, one thread, one process: a
``LeanDecoder`` with ``block=True`` (weights of >= 1024 inputs blocked: our GEMV at every row count, ``vdpbf16ps`` on
pairs of inputs) and one with ``block=False`` (plain weights: ``F.linear``, oneDNN), alternating per
round, each prefilling seeded random prompts of ``--lengths`` tokens (batch 1); wall time of ``prefill`` per prompt,
best and median over rounds.

    PYTHONPATH=.:bench python bench/bench_bf16_prefill.py [--model tinyllama-random] [--lengths 5 16 32 64 128]
        [--rounds 3] [--out bench/results/prefill-bf16]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tinyllama-random")
    p.add_argument("--lengths", type=int, nargs="+", default=[5, 16, 32, 64, 128])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "prefill-bf16"))
    a = p.parse_args()
    if a.rounds < 1 or min(a.lengths) < 1:
        p.error(f"--rounds {a.rounds}, --lengths {a.lengths}: need positive values")
    from bench_batch import model_folder
    from machine import cpu_account, describe, machine, other_work, write_results

    from tensorpar.decode.lean import LeanDecoder
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.parallel import ParallelContext
    torch.set_num_threads(1)
    folder = model_folder(a.model)
    start, acc0 = machine(), cpu_account()
    ctx = ParallelContext.single()
    model, _ = build_parallel_model(str(folder), ctx.tp, dtype=torch.bfloat16)
    vocab = model.config.vocab_size
    times: dict[tuple[str, int], list[float]] = {}
    blocked_any = False
    for rnd in range(a.rounds):
        for block in ((True, False) if rnd % 2 == 0 else (False, True)):
            lean = LeanDecoder(model, ctx.tp, max_batch=1, max_len=max(a.lengths) + 1, block=block)
            blocked_any |= bool(block and lean.blocked)
            for n in a.lengths:
                ids = torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(n))
                t0 = time.perf_counter()
                lean.prefill(ids, torch.ones_like(ids), torch.arange(n)[None])
                times.setdefault(("blocked" if block else "plain", n), []).append(time.perf_counter() - t0)
            del lean
    work = other_work(acc0, cpu_account())
    end = machine()
    med = statistics.median
    lines = [f"{a.model}, bf16 (`--dtype bfloat16`), tp=1, one thread: prefill of one prompt, the blocked bf16 layout "
             f"(weights of >= 1024 inputs; our GEMV at every row count) "
             f"against the plain weights (`F.linear`); {start['cpu']}, {start['cores']} cores, torch "
             f"{torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}; load average at start "
             f"{start['loadavg'][0]:.2f}, at end {end['loadavg'][0]:.2f}; {describe(work)}. {a.rounds} round(s), the "
             f"two decoders alternating. Blocked weights present: {blocked_any}.", "",
             "| prompt tokens | plain ms (median / best) | blocked ms (median / best) | blocked / plain (median) |",
             "|---|---|---|---|"]
    rows = []
    for n in a.lengths:
        pl, bl = times[("plain", n)], times[("blocked", n)]
        rows.append(dict(tokens=n, plain_s=pl, blocked_s=bl))
        lines.append(f"| {n} | {med(pl) * 1e3:.0f} / {min(pl) * 1e3:.0f} | {med(bl) * 1e3:.0f} / {min(bl) * 1e3:.0f} "
                     f"| {med(bl) / med(pl):.2f} |")
    write_results(Path(a.out), dict(model=a.model, rounds=a.rounds, machine_start=start, machine_end=end,
                                    other_work=work), rows, lines)


if __name__ == "__main__":
    main()
