"""tensorpar's decode at tp=2 against tp=1, each next to the machine's own memory read, in tight pairs (issue 28's
"tp=2 >= 1.85x tp=1").

On this project's 2-core VMs the rate at which two threads read memory against one moves from minute to minute (on
the AMD EPYC of 2026-12-04/05 between about 1.1x and 2.0x: ``bench_llamacpp``'s read next to every row), and a
decode at batch 1 is the read of the weights. ``bench_llamacpp`` runs each row in fresh processes, a minute or more
apart, so its tp=2 / tp=1 ratio compares rows that ran while the machine scaled differently. This script keeps one
1-rank and one 2-rank pool alive with the model loaded in each (``tensorpar.testing.WorkerPool``; 1 thread per rank,
shared-memory collectives) and alternates, ``--pairs`` times (the order reversed every other pair): the memory read
with 1 thread (``bench/stream_read.c``, best of ``ADJACENT_REPS``), tp=1 greedy decode of ``--tokens`` tokens, the
read again; then the same with 2 threads and tp=2. A pair takes a few seconds, so its two rows and their reads
mostly see one state of the machine. With ``--llama`` each pair also runs llama.cpp with 2 threads at the
precision's file type (``bench_llamacpp``'s worker in its own venv, a fresh process per pair: the GGUF is mmap'ed
from the page cache, only the decode steps timed) with the 2-thread read around it, so tensorpar's tp=2 meets
llama.cpp in the same state of the machine (issue 28's ">= 1.1x llama.cpp with 2 threads").

Per pair: tokens/s at tp=1 and tp=2 (decode steps only: from the first token to the last), the machine's scaling =
two threads' read (mean of before and after the tp=2 row) over one thread's (around the tp=1 row), tensorpar's
scaling = tp=2 / tp=1 tokens/s, and their quotient (1.0: tp=2 read as close to its limit as tp=1 did). A pair is
steady when each row's reads before and after agree within ``STEADY`` (the machine did not change state during
it). Summaries per precision: medians over all pairs and over steady ones, and tensorpar's scaling in the pairs
where the machine itself scaled >= the target. Results: ``--out``.{md,json} with the CPU model and the other work.

    PYTHONPATH=.:bench .venv/bin/python bench/bench_tp_scaling.py [--model tinyllama-random] [--pairs 12]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_llamacpp import (ADJACENT_REPS, DEFAULT_LLAMA_PYTHON, LLAMA_TARGET, PRECISIONS,  # noqa: E402
                            SCALING_TARGET, TINYLLAMA_RANDOM, _call_llama, _gguf_layout, _stream_binary,
                            _stream_read_at, llama_available, prepare_model, requantized)
from machine import cpu_account, cpu_model, describe, loaded, other_work, write_results  # noqa: E402

#: a row's memory reads before and after it within this fraction of each other: the machine kept one state
STEADY = 0.10

#: a pair in the machine's fast state: two threads read at least this many times one thread; slow: under SLOW
FAST, SLOW = 1.6, 1.4

def job_load(ctx, key: str, folder: str, dtype: str, quantize: str, prompt_ids: list[int], *, store: dict
             ) -> list[int]:
    """Build, quantize and warm up the model on this rank (1 thread) and keep it in the rank's ``store``
    (``WorkerPool.run``) for :func:`job_decode`. Returns ``[weight bytes, untied input embedding bytes]`` of this
    rank."""
    import torch
    from bench_decode import _quantize, _untied_embedding_bytes, _weight_bytes
    from tensorpar.generate import SamplingConfig, generate_tokens
    from tensorpar.hf.load import build_parallel_model
    torch.set_num_threads(1)
    if ctx.tp.size > 1:
        from tensorpar.shm import enable_fast_collectives
        enable_fast_collectives(ctx.tp, "on")
    store.clear()
    model, _ = build_parallel_model(folder, ctx.tp, dtype=getattr(torch, dtype))
    _quantize(model, ctx.tp, quantize)
    ids = torch.tensor([prompt_ids])
    generate_tokens(model, ctx.tp, ids, sampling=SamplingConfig(max_new_tokens=3), path="lean")     # warm-up
    store[key] = (model, ids)
    return [_weight_bytes(model, quantize), _untied_embedding_bytes(model)]


def job_decode(ctx, key: str, n: int, *, store: dict) -> dict:
    """Greedy decode of ``n`` new tokens on the model :func:`job_load` kept in ``store``: decode tokens/s (steps
    after the first token) and the tokens."""
    from tensorpar.generate import SamplingConfig, generate_tokens
    model, ids = store[key]
    stamps = []
    res = generate_tokens(model, ctx.tp, ids, sampling=SamplingConfig(max_new_tokens=n), path="lean",
                          on_token=lambda step, tok: stamps.append(time.perf_counter()))
    return {"tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]), "tokens": res.tokens[0].tolist()}


def summary(pairs: list[dict], target: float) -> dict:
    """Medians over ``pairs`` (each with ``tp_scaling``, ``machine_scaling``, ``steady``) and over the steady ones,
    and tensorpar's scaling in the pairs where the machine scaled >= ``target``."""
    def med(ps, k):
        return statistics.median(p[k] for p in ps) if ps else None
    steady = [p for p in pairs if p["steady"]]
    able = [p for p in pairs if p["machine_scaling"] >= target]
    out = {"pairs": len(pairs), "steady_pairs": len(steady), "machine_able_pairs": len(able)}
    for name, ps in (("all", pairs), ("steady", steady), ("machine_able", able)):
        for k in ("tp_scaling", "machine_scaling", "relative"):
            out[f"{name}_{k}"] = med(ps, k)
    out["pairs_meeting_target"] = sum(p["tp_scaling"] >= target for p in pairs)
    out["able_pairs_meeting_target"] = sum(p["tp_scaling"] >= target for p in able)
    if pairs and "vs_llama" in pairs[0]:
        out["vs_llama"] = med(pairs, "vs_llama")
        out["vs_llama_min"] = min(p["vs_llama"] for p in pairs)
        out["llama_machine_scaling"] = med(pairs, "llama_machine_scaling")
        # the pairs whose tp=2 and llama.cpp rows saw the same state (their 2-thread reads within STEADY)
        same = [p for p in pairs if abs(statistics.mean(p["read2"]) - statistics.mean(p["read_llama"]))
                <= STEADY * max(statistics.mean(p["read2"]), statistics.mean(p["read_llama"]))]
        out["same_state_pairs"] = len(same)
        out["same_state_vs_llama"] = med(same, "vs_llama")
        # the VM's two states (2026-12-05: two threads read 1.13-1.25x or 1.8-2.0x one thread, little between)
        for name, ps in (("fast", [p for p in same if p["machine_scaling"] >= FAST]),
                         ("slow", [p for p in same if p["machine_scaling"] < SLOW])):
            out[f"{name}_pairs"] = len(ps)
            out[f"{name}_vs_llama"] = med(ps, "vs_llama")
            out[f"{name}_llama_fraction"] = med(ps, "llama_fraction")
            out[f"{name}_tp2_fraction"] = med(ps, "tp2_fraction")
    return out


def pair_record(one: dict, two: dict, reads1: list[float], reads2: list[float], bytes1: float, bytes2: float) -> dict:
    """One pair's numbers from the tp=1 and tp=2 decodes, the 1- and 2-thread reads (bytes/s) around them, and the
    bytes each reads per token (tp=2: both ranks', the replicated norms twice)."""
    r1, r2 = statistics.mean(reads1), statistics.mean(reads2)
    tp, mach = two["tok_s"] / one["tok_s"], r2 / r1
    return {"tp1_tok_s": one["tok_s"], "tp2_tok_s": two["tok_s"], "read1": reads1, "read2": reads2,
            "tp_scaling": tp, "machine_scaling": mach, "relative": tp / mach,
            "tp1_fraction": one["tok_s"] * bytes1 / r1, "tp2_fraction": two["tok_s"] * bytes2 / r2,
            "steady": all(abs(b - a) <= STEADY * max(a, b) for a, b in (reads1, reads2)),
            "tokens_equal": sum(x == y for x, y in zip(one["tokens"], two["tokens"]))}


def with_llama(p: dict, llama: dict, reads: list[float], reads1: list[float], llama_bytes: float) -> dict:
    """Pair ``p`` with llama.cpp's 2-thread row (``decode_tok_s``) and the 2-thread reads around it: tp=2 over it,
    llama.cpp's fraction of its read, and the machine's scaling next to it (that read over the pair's 1-thread)."""
    r = statistics.mean(reads)
    return {**p, "llama_tok_s": llama["decode_tok_s"], "read_llama": reads, "vs_llama": p["tp2_tok_s"] /
            llama["decode_tok_s"], "llama_fraction": llama["decode_tok_s"] * llama_bytes / r,
            "llama_machine_scaling": r / statistics.mean(reads1)}


def _model(a: argparse.Namespace) -> dict:
    """``bench_llamacpp.prepare_model``'s folder and prompt ids (and, with ``--llama``, the GGUF llama.cpp's files
    are made from: ``--gguf``, or the cached one of tinyllama-random / smollm2); without ``--llama`` no GGUF is
    needed. A model that cannot be found: one line, exit."""
    try:
        if a.llama or a.model == TINYLLAMA_RANDOM:
            if a.llama and a.model not in (TINYLLAMA_RANDOM, "smollm2") and not a.gguf:
                raise ValueError(f"--llama with --model {a.model} needs --gguf (the GGUF this model was converted "
                                 "from); without it llama.cpp would run another model")
            return prepare_model(argparse.Namespace(model=a.model, gguf=a.gguf))
        from bench_decode import PROMPT
        from transformers import AutoTokenizer

        from tensorpar.hub import resolve_model
        folder = resolve_model(a.model)
        return {"folder": folder, "prompt_ids": AutoTokenizer.from_pretrained(str(folder))(PROMPT)["input_ids"]}
    except (ValueError, OSError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SystemExit(f"bench_tp_scaling: {msg}" if msg.startswith("--") else
                         f"bench_tp_scaling: --model {a.model}: {msg}")


def run(a: argparse.Namespace) -> tuple[dict, list[dict]]:
    import torch
    from tensorpar.testing import WorkerPool
    m = _model(a)
    folder, prompt_ids = str(m["folder"]), m["prompt_ids"]
    exe = _stream_binary()
    if exe is None:
        raise SystemExit("bench_tp_scaling: needs bench/stream_read.c compiled (gcc); nothing measured")
    llama = llama_available(a.llama_python) if a.llama else None
    if a.llama and llama is None:
        raise SystemExit(f"bench_tp_scaling: --llama needs llama_cpp under --llama-python {a.llama_python} "
                         "(bench/README.md builds it)")
    precisions = [p for p in PRECISIONS if a.precisions is None or p[0] in a.precisions]
    cpu0, load0 = cpu_account(), os.getloadavg()
    rows = []
    for label, dtype, quantize, ft in precisions:
        key = f"{label}-{a.model}"
        gguf, embed = None, 0
        if llama is not None:
            gguf = (m["source"] if ft == "F32" and m["source_is_f32"]
                    else requantized(a.llama_python, m["source"], ft, llama["llama_cpp"])[0])
            embed = _gguf_layout(gguf)["untied_embedding_bytes"]       # one row of it read per token
        with WorkerPool(1, collective_timeout_s=300, job_timeout_s=3600) as p1, \
                WorkerPool(2, collective_timeout_s=300, job_timeout_s=3600) as p2:
            pools = {1: p1, 2: p2}
            size = {}
            for w, pool in pools.items():
                res = pool.run(job_load, key, folder, dtype, quantize, prompt_ids)
                size[w] = [sum(x[i] for x in res) for i in range(2)]
            read_bytes, read_bytes_tp2 = (size[w][0] - size[w][1] for w in (1, 2))
            pairs = []
            for i in range(a.pairs):
                got, reads = {}, {}
                for w in ((1, 2) if i % 2 == 0 else (2, 1)):
                    before = _stream_read_at(exe, a.gemv_mb, w, ADJACENT_REPS)
                    got[w] = pools[w].run(job_decode, key, a.tokens)[0]
                    reads[w] = [before, _stream_read_at(exe, a.gemv_mb, w, ADJACENT_REPS)]
                p = pair_record(got[1], got[2], reads[1], reads[2], read_bytes, read_bytes_tp2)
                if gguf is not None:
                    before = _stream_read_at(exe, a.gemv_mb, 2, ADJACENT_REPS)
                    lr = _call_llama(a.llama_python, ["--worker", "decode", "--gguf", str(gguf), "--threads", "2",
                                                      "--tokens", str(a.tokens), "--prompt-ids",
                                                      json.dumps(prompt_ids)], timeout_s=1800)
                    lb = lr["weight_bytes"] - embed
                    p = with_llama(p, lr, [before, _stream_read_at(exe, a.gemv_mb, 2, ADJACENT_REPS)], reads[1], lb)
                pairs.append(p)
                print(f"{label:<34} pair {i + 1:>2}: tp=1 {p['tp1_tok_s']:6.2f}  tp=2 {p['tp2_tok_s']:6.2f} tok/s  "
                      f"tp2/tp1 {p['tp_scaling']:.2f}  machine {p['machine_scaling']:.2f}  "
                      f"{'steady' if p['steady'] else 'moved'}"
                      + (f"  llama.cpp {p['llama_tok_s']:6.2f} (tp=2 / it {p['vs_llama']:.2f}, machine "
                         f"{p['llama_machine_scaling']:.2f})" if "vs_llama" in p else ""), flush=True)
        rows.append({"precision": label, "dtype": dtype, "quantize": quantize, "read_bytes": read_bytes,
                     "llama_gguf": None if gguf is None else Path(gguf).name,
                     "read_bytes_tp2": read_bytes_tp2, "pairs": pairs,
                     "summary": summary(pairs, SCALING_TARGET)})
    work = other_work(cpu0, cpu_account())
    meta = {"cpu": cpu_model(), "model": a.model, "folder_name": Path(folder).name, "tokens": a.tokens,
            "pairs": a.pairs, "stream_mb": a.gemv_mb, "adjacent_reps": ADJACENT_REPS, "steady": STEADY,
            "target": SCALING_TARGET, "llama": llama, "llama_target": LLAMA_TARGET, "load_start": list(load0),
            "load_end": list(os.getloadavg()),
            "other_work": work, "loaded": loaded(work), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    return meta, rows


def _f(x, fmt=".2f") -> str:
    return "-" if x is None else format(x, fmt)


def report(meta: dict, rows: list[dict]) -> list[str]:
    """The results file's markdown."""
    lines = [f"# tp=2 / tp=1 decode next to the machine's own scaling, in pairs ({meta['cpu']}, {meta['model']})", ""]
    if meta["loaded"]:
        lines += [f"**LOADED MACHINE ({describe(meta['other_work'])}): rerun on an idle machine before quoting.**", ""]
    lines += [f"{meta['date']}; torch {meta['torch']}; load average at start {meta['load_start'][0]:.2f}, at end "
              f"{meta['load_end'][0]:.2f}; {describe(meta['other_work'])}. Per precision one 1-rank and one 2-rank "
              f"pool with the model loaded, {meta['pairs']} pair{'s' if meta['pairs'] != 1 else ''} (order reversed "
              "every other pair): stream_read "
              f"({meta['stream_mb']} MB per thread, 8 streams, best of {meta['adjacent_reps']}) with the row's "
              f"thread count just before and after each row; {meta['tokens']} greedy tokens per row (decode steps "
              "timed). Machine scaling = two threads' read / one thread's (means of before and after); tensorpar's "
              "= tp=2 / tp=1 tokens/s; relative = tensorpar's / the machine's; fraction = tokens/s x bytes read per "
              f"token / the read next to the row. Steady: each row's reads before and after within "
              f"{100 * meta['steady']:.0f} %.", "",
              f"| precision | pairs (steady) | tp2/tp1 median (steady) | machine 2/1 median (steady) | relative median "
              f"(steady) | pairs with the machine >= {meta['target']:g}: count, tp2/tp1 median | pairs with tp2/tp1 "
              f">= {meta['target']:g} | tp=1 / tp=2 fraction of the read (median) |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["summary"]
        f1 = statistics.median(p["tp1_fraction"] for p in r["pairs"])
        f2 = statistics.median(p["tp2_fraction"] for p in r["pairs"])
        lines.append(f"| {r['precision']} | {s['pairs']} ({s['steady_pairs']}) | {_f(s['all_tp_scaling'])} "
                     f"({_f(s['steady_tp_scaling'])}) | {_f(s['all_machine_scaling'])} "
                     f"({_f(s['steady_machine_scaling'])}) | {_f(s['all_relative'])} ({_f(s['steady_relative'])}) "
                     f"| {s['machine_able_pairs']}, {_f(s['machine_able_tp_scaling'])} | "
                     f"{s['pairs_meeting_target']} of {s['pairs']} | {f1:.2f} / {f2:.2f} |")
    if meta.get("llama"):
        lines += ["", f"Against llama.cpp {meta['llama']['llama_cpp']} with 2 threads in the same pairs (its file "
                  f"type of the precision; target >= {meta['llama_target']:g}x), and the machine's 2 / 1-thread read "
                  "next to llama.cpp's row:", "",
                  "| precision | tp=2 / llama.cpp median (lowest pair) | pairs whose tp=2 and llama.cpp rows read "
                  f"within {100 * meta['steady']:.0f} % of each other: count, tp=2 / llama.cpp median | of those, "
                  f"the machine's two threads >= {FAST:g}x one: count, tp=2 / llama.cpp, llama.cpp / tp=2 fraction of "
                  f"the read | of those, < {SLOW:g}x: the same | machine 2/1 next to llama.cpp (median) | llama.cpp / "
                  "tensorpar tp=2 fraction of the read (median) |", "|---|---|---|---|---|---|---|"]
        for r in rows:
            s, ps = r["summary"], r["pairs"]
            lf = statistics.median(p["llama_fraction"] for p in ps)
            f2 = statistics.median(p["tp2_fraction"] for p in ps)
            lines.append(f"| {r['precision']} | {_f(s['vs_llama'])} ({_f(s['vs_llama_min'])}) | "
                         f"{s['same_state_pairs']}, {_f(s['same_state_vs_llama'])} | "
                         + " | ".join(f"{s[f'{n}_pairs']}, {_f(s[f'{n}_vs_llama'])}, {_f(s[f'{n}_llama_fraction'])} "
                                      f"/ {_f(s[f'{n}_tp2_fraction'])}" for n in ("fast", "slow")) + " | "
                         f"{_f(s['llama_machine_scaling'])} | {lf:.2f} / {f2:.2f} |")
    for r in rows:
        lines += ["", f"{r['precision']}: {r['read_bytes'] / 1e6:.0f} MB read per token at tp=1, "
                  f"{r.get('read_bytes_tp2', r['read_bytes']) / 1e6:.0f} at tp=2 (both ranks); greedy tokens of tp=2 "
                  f"equal to tp=1's per pair: {', '.join(str(p['tokens_equal']) for p in r['pairs'])} of "
                  f"{meta['tokens']}; pairs (tp=1, tp=2 tokens/s; "
                  "reads before / after in GB/s; tp2/tp1; machine; relative; with --llama: llama.cpp's tokens/s "
                  "and reads, tp=2 over it):", ""]
        for i, p in enumerate(r["pairs"]):
            r1, r2 = (" / ".join(f"{x / 1e9:.1f}" for x in p[k]) for k in ("read1", "read2"))
            lines.append(f"* {i + 1}: {p['tp1_tok_s']:.2f}, {p['tp2_tok_s']:.2f}; 1 thread {r1}, 2 threads {r2}; "
                         f"{p['tp_scaling']:.2f}; {p['machine_scaling']:.2f}; "
                         f"{p['relative']:.2f}{'' if p['steady'] else ' (moved)'}"
                         + (f"; llama.cpp {p['llama_tok_s']:.2f} (2 threads " + " / ".join(
                             f"{x / 1e9:.1f}" for x in p["read_llama"]) + f"), tp=2 / it {p['vs_llama']:.2f}"
                            if "vs_llama" in p else ""))
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=TINYLLAMA_RANDOM, help=f"{TINYLLAMA_RANDOM} (default) or a model name / folder")
    p.add_argument("--pairs", type=int, default=12)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--gemv-mb", type=int, default=256, help="MB per thread of stream_read")
    p.add_argument("--precisions", nargs="+", choices=[label for label, *_ in PRECISIONS], default=None)
    p.add_argument("--llama", action="store_true", help="also llama.cpp with 2 threads in every pair")
    p.add_argument("--llama-python", default=str(DEFAULT_LLAMA_PYTHON), help="the interpreter of llama.cpp's venv")
    p.add_argument("--gguf", default=None, help="with --llama and a --model other than tinyllama-random / smollm2: the "
                   "GGUF it was converted from (llama.cpp's files are made from it)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "tp-scaling"))
    p.add_argument("--render", metavar="JSON", help="write --out's markdown again from a results JSON (summaries "
                   "recomputed), measuring nothing")
    a = p.parse_args()
    if a.render:
        try:
            res = json.loads(Path(a.render).read_text())
            meta, rows = res["meta"], res["rows"]
            for r in rows:
                r["summary"] = summary(r["pairs"], meta["target"])
            lines = report(meta, rows)
        except (OSError, ValueError, KeyError, TypeError) as e:
            p.error(f"--render {a.render}: not a bench_tp_scaling results JSON ({type(e).__name__}: {e})")
        write_results(Path(a.out), meta, rows, lines)
        return
    if a.pairs < 1 or a.tokens < 3 or a.gemv_mb < 1:
        p.error(f"--pairs {a.pairs} / --tokens {a.tokens} / --gemv-mb {a.gemv_mb}: need at least 1 pair, 3 tokens "
                "(2 decode steps) and 1 MB")
    meta, rows = run(a)
    write_results(Path(a.out), meta, rows, report(meta, rows))


if __name__ == "__main__":
    main()
