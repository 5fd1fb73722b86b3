"""Decode tokens/s per family at tp=2: the lean path against the module path, on the small random models of the
family tests (tests/decode/test_lean_families.py: the configs of tests/families.py, families_fam.py,
families_moe.py).

These models are tiny (hidden 24-48, 2-3 layers), so a step's cost is the framework's per-layer work and the two
ranks' all-reduces, not the weights' bytes: the numbers compare the per-token overhead of the two paths, which is
what the lean path removes; they say nothing about a real model's memory-bound speed (bench/bench_decode.py).

Each family: one prompt of 7 tokens, ``--tokens`` new tokens greedy, batch 1, best of ``--rounds`` runs of
``generate_tokens`` per path (the first run of each path is a warm-up), one thread per rank; tokens/s is
``(tokens - 1) / decode_s`` (the steps after the first token), rank 0's clock. The machine is shared: the load
average at start and end is recorded.

    python bench/bench_families.py [--tokens 32] [--rounds 3] [--out bench/results]

Writes ``decode_families.json`` and ``decode_families.md`` under ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def job(ctx, folders: dict, names: list, tokens: int, rounds: int):
    """On every rank: per family, the best decode tokens/s of each path."""
    from tensorpar.generate import SamplingConfig, generate_tokens
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.shm import disable_fast_collectives, enable_fast_collectives
    torch.set_num_threads(1)
    enable_fast_collectives(ctx.tp, "auto")     # what generate and serve run (the pool's ranks start without)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 37, (1, 7), generator=g)
    mask = torch.ones_like(ids)
    out = {}
    for n in names:
        model, _ = build_parallel_model(folders[n], ctx.tp)
        row = {}
        for path in ("hf", "lean"):
            best = 0.0
            for _ in range(rounds + 1):
                res = generate_tokens(model, ctx.tp, ids, mask, sampling=SamplingConfig(max_new_tokens=tokens),
                                      path=path)
                best = max(best, (tokens - 1) / res.decode_s)
            row[path] = best
        out[n] = row
    disable_fast_collectives(ctx.tp)
    return out


def cpu_model() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="bench/results")
    a = p.parse_args()
    from tensorpar.testing import WorkerPool
    from tests.decode.test_lean_families import FAST, save_family
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        folders = {n: save_family(Path(tmp) / n.replace(":", "_"), n) for n in FAST}
        pool = WorkerPool(2, collective_timeout_s=120.0)
        try:
            res = pool.run(job, folders, FAST, a.tokens, a.rounds)[0]
        finally:
            pool.close()
    load1 = os.getloadavg()
    meta = {"cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__, "tokens": a.tokens,
            "rounds": a.rounds, "loadavg_start": [round(v, 2) for v in load0],
            "loadavg_end": [round(v, 2) for v in load1]}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_families.json").write_text(json.dumps({"meta": meta, "tokens_per_s": res}, indent=1))
    lines = ["# Decode tokens/s per family at tp=2: lean path vs module path", "",
             f"`python bench/bench_families.py --tokens {a.tokens} --rounds {a.rounds}`; CPU {meta['cpu']} "
             f"({meta['cores']} cores), torch {meta['torch']}, one thread per rank, shared-memory collectives (as generate runs), batch 1, prompt 7 tokens, "
             f"best of {a.rounds} runs after a warm-up. **Load average (1, 5, 15 min) {meta['loadavg_start']} at "
             f"start, {meta['loadavg_end']} at the end** (a shared machine: absolute numbers are low under load; "
             f"the ratio is the comparison). The models are the tiny random ones of the family tests: the numbers "
             f"are per-token framework and collective overhead, not memory-bound decode.", "",
             "| family | module path tok/s | lean path tok/s | lean / module |", "|---|---:|---:|---:|"]
    for n, r in res.items():
        lines.append(f"| {n} | {r['hf']:.1f} | {r['lean']:.1f} | {r['lean'] / r['hf']:.2f}x |")
    (out / "decode_families.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
