"""Where a decode step's time goes outside the matmuls, attention and collectives (issue 28), and an A/B of two
checkouts.

SmolLM2-135M (``--model``; ``tinyllama-random``: the 1.1B random Llama) greedy decode through ``generate_tokens``
(the decode engine, the lean path's row step) at tp=2, one thread per rank, shared-memory collectives; fp32 weights,
or (``--quantize bf16|int8``) as ``generate --quantize`` stores them; fp32 activations (``--dtype bfloat16``: a bf16
model, weights and activations). Per row, in fresh processes (the checkout's tensorpar imported
through ``TENSORPAR_BENCH_CODE``, as ``bench_decode.py --fixed-cost`` does):

1. tokens/s of ``--tokens`` new tokens after a 3-token warm-up (decode steps only), the median and the fastest step
   (wall time between two ``on_token`` calls; nothing wrapped);
2. a breakdown of one more generate call in *thread CPU time* (``time.thread_time_ns``: what this rank's thread
   ran, not the time it waited for a core, so it holds on a loaded machine), median per decode step, exclusive per
   category (a wrapped function's time minus the wrapped functions it calls): the C kernel calls (GEMV, LM head
   included, rope, attention, SiLU: their compute and the call), the collectives (the fused all-reduce + add +
   norm of the layers, the embedding's all-reduce, the argmax's all-gather; their waits for the other rank spin or
   yield, so they are CPU time too), the embedding module, the rotary tables, plan making (``step_batches``,
   ``_segment``), token choice (``choose_tokens`` minus its all-gather), the row step's own Python, and the rest
   (engine and generate's loop). Each wrapper adds about a microsecond to its category (up to about 270 calls per
   token before, 130 after);
3. with ``--pyspy PATH`` (rank 0 of the first round's rows only): py-spy samples rank 0 at 200 Hz during
   ``--pyspy-calls`` generate calls; the samples are summed by leaf function (a ctypes kernel's time lands on the
   Python function that calls it).

    PYTHONPATH=. python bench/bench_step_overhead.py [--tokens 64] [--batch 1] [--rounds 3] \\
        [--before OLD_CHECKOUT] [--pyspy PY_SPY] [--out bench/results/step_overhead]

``--batch B``: B rows per step, the same prompt in each (the server's steps at B slots; at 32 rows the row step's
programs are mostly matmul compute, and the LM head's GEMV lands in "row step Python", which calls it).

``--before``: another checkout (e.g. ``git archive REV | tar -x -C DIR``); its rows and this checkout's alternate in
every round (order reversed every other round). Writes ``OUT.json`` and ``OUT.md`` with the CPU model and the load.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, os.environ.get("TENSORPAR_BENCH_CODE") or str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

PROMPT = "The capital of France is"


#: the C kernel calls of the row step (compute + call), by what Python calls: the matmuls (each layer's four and the
#: LM head before; the LM head only after), rotary / attention / SiLU / the first norm, and the programs that run a
#: layer's matmuls with its rotary, attention and SiLU in one call (``fused.run_program``, after); the table adds
#: them up as "kernel calls, all"
KERNELS = "kernel calls: GEMV (matmuls called one by one)"
SMALL = "kernel calls: rope, attention, SiLU, first norm (one by one)"
PROGRAMS = "kernel calls: programs (a layer's GEMVs + rope, attention, SiLU)"
#: after 2026-12-03 evening: the whole step as one program (``fused.run_at``), its shared-memory exchanges in C with
#: their spins (a wait past the spin goes back to Python: ``c_exchange_wait``, counted with the collectives)
STEP_PROGRAM = "kernel calls: the step's one program (its exchanges in C and their spins included)"


class _Timer:
    """Exclusive thread CPU time per category of nested wrapped calls."""

    def __init__(self):
        self.acc: Counter = Counter()
        self.calls: Counter = Counter()
        self.stack: list = []

    def wrap(self, fn, cat: str):
        acc, calls, stack, clock = self.acc, self.calls, self.stack, time.thread_time_ns

        def timed(*a, **k):
            frame = [0]
            stack.append(frame)
            t0 = clock()
            try:
                return fn(*a, **k)
            finally:
                dt = clock() - t0
                stack.pop()
                acc[cat] += dt - frame[0]
                calls[cat] += 1
                if stack:
                    stack[-1][0] += dt
        timed.__wrapped__ = fn
        return timed


def _calibrate(n: int = 20000) -> dict:
    """What one wrapper costs here (the CPU clock is a system call on some machines): thread CPU us per call of a
    wrapped no-op, in all (``total``) and the part its own category sees (``inside``; the rest lands in the caller's
    category). The breakdown's categories hold ``calls x`` these, the table says how much."""
    timer = _Timer()
    f = timer.wrap(lambda: None, "x")
    t0 = time.thread_time_ns()
    for _ in range(n):
        f()
    total = (time.thread_time_ns() - t0) / n / 1e3
    return {"total": round(total, 3), "inside": round(timer.acc["x"] / n / 1e3, 3)}


def _patches(timer: _Timer) -> list:
    """``(owner, name, original)`` of every function wrapped for the breakdown (those this checkout has)."""
    import importlib
    done = []

    def patch(owner, name, cat):
        fn = getattr(owner, name, None) if owner is not None else None
        if fn is None:
            return
        setattr(owner, name, timer.wrap(fn, cat))
        done.append((owner, name, fn))

    def mod(name):
        try:
            return importlib.import_module(name)
        except ImportError:
            return None
    fused, row_step, comm = mod("tensorpar.decode.fused"), mod("tensorpar.decode.row_step"), mod("tensorpar.comm")
    engine, lean, emb = mod("tensorpar.serve.engine"), mod("tensorpar.decode.lean"), mod("tensorpar.layers.embedding")
    layers_ar = "collectives: the layers' all-reduces (before: + add + norm)"
    for name in ("all_reduce_add_rms_norm", "all_reduce_exchange"):    # after: the add and norm run in the programs
        patch(fused, name, layers_ar)
    for name in ("rope_store", "decode_attention", "silu_mul", "rms_norm_raw"):
        patch(fused, name, SMALL)
    patch(fused, "run_program", PROGRAMS)
    patch(fused, "run_at", STEP_PROGRAM)
    shm = mod("tensorpar.shm.collectives")
    patch(getattr(shm, "ShmCommunicator", None), "c_exchange_wait", layers_ar)
    patch(comm, "all_reduce", "collectives: all-reduce (embedding, other)")
    patch(comm, "all_gather", "collectives: all-gather (argmax)")
    patch(engine, "step_batches", "plan: step_batches")
    patch(getattr(engine, "Engine", None), "_segment", "plan: _segment (tensors of the rows)")
    patch(engine, "choose_tokens", "token choice (argmax, minus its all-gather)")
    patch(getattr(lean, "LeanDecoder", None), "_rotary", "rotary tables")
    patch(getattr(emb, "VocabParallelEmbedding", None), "forward", "embedding module")
    patch(getattr(row_step, "RowStep", None), "__call__", "row step Python (loop, arguments)")
    patch(getattr(lean, "LeanDecoder", None), "forward_segments", "engine: forward_segments")
    # the LM head on a blocked bf16 weight (--quantize bf16 since 2026-12-04; a bf16 model's since 12-04 late)
    # calls its kernel by name
    patch(mod("tensorpar.decode.gemv_kernel"), "bf16w_blocked_linear_into", KERNELS)
    patch(mod("tensorpar.decode.gemv_kernel"), "bf16_blocked_linear_into", KERNELS)
    kernels = getattr(row_step, "_KERNELS", None)
    for fmt in list(kernels or ()):     # the row step's matmul calls, every weight format (bound at import: patch the
        avail, run = kernels[fmt]       # table's entries)
        kernels[fmt] = (avail, timer.wrap(run, KERNELS))
        done.append((kernels, fmt, (avail, run)))
    return done


def _unpatch(done: list) -> None:
    for owner, name, fn in reversed(done):
        if isinstance(owner, dict):
            owner[name] = fn
        else:
            setattr(owner, name, fn)


def job(ctx, folder: str, n: int, spy: str | None, spy_calls: int, spy_out: str | None, batch: int = 1,
        quantize: str = "none", dtype: str = "float32"):
    """Rank job: tokens/s, the CPU breakdown, and (rank 0, ``spy``) a py-spy profile of ``spy_calls`` generates."""
    from transformers import AutoTokenizer

    from tensorpar.generate import SamplingConfig, generate_tokens
    from tensorpar.hf.load import build_parallel_model
    torch.set_num_threads(1)
    if ctx.tp.size > 1:
        from tensorpar.shm import enable_fast_collectives
        enable_fast_collectives(ctx.tp, "on")
    model, _ = build_parallel_model(folder, ctx.tp, dtype=getattr(torch, dtype))
    if quantize != "none":
        from tensorpar.decode.quantize import apply_quantize
        apply_quantize(model, ctx.tp, quantize)
    gen = __import__("tensorpar.generate", fromlist=["x"])
    if hasattr(gen, "inference_only"):     # as the generate command (checkouts from 2026-12-04 on)
        gen.inference_only(model)
    try:
        ids = AutoTokenizer.from_pretrained(folder)([PROMPT] * batch, return_tensors="pt")["input_ids"]
    except (OSError, ValueError):         # a random-weight model without a tokenizer: fixed ids
        ids = torch.tensor([[1, 450, 7483, 310, 3444, 338]] * batch)
    cfg = SamplingConfig(max_new_tokens=n)
    generate_tokens(model, ctx.tp, ids, sampling=SamplingConfig(max_new_tokens=3), path="lean")      # warm-up
    stamps: list[float] = []
    res = generate_tokens(model, ctx.tp, ids, sampling=cfg, path="lean",
                          on_token=lambda step, tok: stamps.append(time.perf_counter()))
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    out = {"decode_tok_s": res.decode_tokens_per_s * batch, "median_step_ms": statistics.median(steps) * 1e3,
           "best_step_ms": min(steps) * 1e3, "tokens": res.tokens[0].tolist()}
    timer = _Timer()
    done = _patches(timer)
    from tensorpar.generate.engine_cache import release_engine
    release_engine(model)       # the kept engine bound the kernels unwrapped (its LM head's GEMV): one with the timers
    per_step: list[dict] = []
    last: dict = {}

    def on_token(step, tok):
        now = time.thread_time_ns()
        if last:
            per_step.append({"step": now - last["t"], **{k: timer.acc[k] - last["acc"].get(k, 0) for k in timer.acc}})
        last.update(t=now, acc=dict(timer.acc))
    try:
        generate_tokens(model, ctx.tp, ids, sampling=cfg, path="lean", on_token=on_token)
    finally:
        _unpatch(done)
    cats = sorted({k for s in per_step for k in s if k != "step"})
    med = {k: statistics.median(s.get(k, 0) for s in per_step) / 1e6 for k in ["step"] + cats}
    med["rest: engine step, generate loop"] = statistics.median(
        s["step"] - sum(s.get(k, 0) for k in cats) for s in per_step) / 1e6
    out["cpu_ms"] = {k: round(v, 4) for k, v in med.items()}
    out["calls_per_token"] = {k: round(v / (len(per_step) + 1), 1) for k, v in timer.calls.items()}
    out["wrapper_us"] = _calibrate()
    if spy and ctx.tp.rank == 0:
        p = subprocess.Popen([spy, "record", "-p", str(os.getpid()), "-f", "raw", "--nonblocking", "--idle",
                              "-r", "200", "-o", spy_out], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.5)                 # attached
    t0 = time.perf_counter()
    for _ in range(spy_calls if spy else 0):
        generate_tokens(model, ctx.tp, ids, sampling=cfg, path="lean")
    if spy and ctx.tp.rank == 0:
        out["pyspy_s"] = time.perf_counter() - t0
        import signal
        p.send_signal(signal.SIGINT)
        p.wait(timeout=60)
    return out


def pyspy_summary(path: str, top: int = 30) -> dict:
    """py-spy raw stacks inside generate calls (the decode thread) summed by leaf function (``name (file)``, the file
    relative to the package) and by phase (the first of a few known functions, in the order of ``phases``, on
    the stack; the engine's construction apart)."""
    leaf: Counter = Counter()
    phase: Counter = Counter()
    total = 0
    phases = (("choose_tokens", "token choice"), ("_result", "token choice"),
              ("all_reduce_add_rms_norm", "layers' all-reduces"), ("all_reduce_exchange", "layers' all-reduces"),
              ("all_gather", "all-gather"),
              ("all_reduce", "all-reduce (other)"),
              ("c_exchange_wait", "layers' all-reduces"),
              ("linear_into", "kernel calls"), ("run_program", "kernel calls"), ("run_at", "kernel calls"), ("rope_store", "kernel calls"),
              ("decode_attention", "kernel calls"), ("silu_mul", "kernel calls"), ("rms_norm_raw", "kernel calls"),
              ("_head", "general loop: final norm + LM head"), ("_attn_in", "general loop: norm, QKV, rotary"),
              ("attention", "general loop: cache + attention"), ("_attn_out", "general loop: o, norm, MLP"),
              ("_rotary", "rotary tables"), ("_rope", "rotary tables"), ("_embed", "embedding"),
              ("_wrapped_call_impl", "embedding"), ("_cache_plan", "row step Python"),
              ("__call__", "row step Python"), ("forward_segments", "forward_segments Python"),
              ("_segment", "plan"), ("step_batches", "plan"), ("_forward", "engine Python"),
              ("_compute", "engine Python"), ("step", "engine Python"), ("_generate", "generate loop"))
    for line in Path(path).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        try:
            c = int(count)
        except ValueError:
            continue
        frames = stack.split(";")
        names = [fr.partition(" (")[0].rsplit(".", 1)[-1] for fr in frames]     # py-spy names Class.method
        if "_generate" not in names:      # other threads, and the time between generate calls
            continue
        total += c
        f = frames[-1]
        name, _, where = f.partition(" (")
        where = where.split(":")[0]
        where = where[where.find("tensorpar/"):] if "tensorpar/" in where else Path(where).name
        leaf[f"{name} ({where})"] += c
        label = "other"
        if any(".__init__ (" in fr and "serve/engine.py" in fr for fr in frames):
            label = "engine construction (once per generate call)"
        else:
            for key, lab in phases:              # the first of phases' functions on the stack
                if key in names:
                    label = lab
                    break
        phase[label] += c
    return {"samples": total, "by_leaf": {k: round(v / total, 4) for k, v in leaf.most_common(top)},
            "by_phase": {k: round(v / total, 4) for k, v in phase.most_common()}}


def worker(folder: str, n: int, spy: str | None, spy_calls: int, spy_out: str | None, tp: int = 2,
           batch: int = 1, quantize: str = "none", dtype: str = "float32") -> dict:
    from tensorpar.testing import WorkerPool
    with WorkerPool(tp, collective_timeout_s=120, job_timeout_s=1200) as pool:
        res = pool.run(job, folder, n, spy, spy_calls, spy_out, batch, quantize, dtype)
    out = dict(res[0])
    if tp > 1:
        out["rank1_cpu_ms"] = res[1]["cpu_ms"]
    out["tokens_equal_across_ranks"] = all(r["tokens"] == res[0]["tokens"] for r in res)
    if spy and spy_out and Path(spy_out).exists():
        out["pyspy"] = pyspy_summary(spy_out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (1: no collectives, no waits)")
    p.add_argument("--batch", type=int, default=1, help="rows per decode step (the same prompt in every row)")
    p.add_argument("--quantize", default="none", choices=("none", "bf16", "int8"),
                   help="the weights as generate --quantize stores them (activations fp32)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the model's dtype, as generate --dtype (bfloat16: weights and activations)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--before", default=None, help="the old checkout (A/B); left out: this checkout only")
    p.add_argument("--pyspy", default=None, help="py-spy executable: profile rank 0 in the first round")
    p.add_argument("--pyspy-calls", type=int, default=6)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "step_overhead"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--spy-out", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.dtype == "bfloat16" and a.quantize == "bf16":
        p.error("--quantize bf16 with --dtype bfloat16: --quantize bf16 stores the weights of an fp32 model")
    if a.batch < 1 or a.tokens < 2 or a.rounds < 1:
        p.error(f"--batch {a.batch}, --tokens {a.tokens}, --rounds {a.rounds}: need --batch >= 1, --tokens >= 2 "
                f"(a step is the time between two tokens) and --rounds >= 1")
    from bench_batch import model_folder          # smollm2, or tinyllama-random (the 1.1B, built once and cached)
    folder = str(model_folder(a.model))
    if a.worker:
        print(json.dumps(worker(folder, a.tokens, a.pyspy, a.pyspy_calls, a.spy_out, a.tp, a.batch, a.quantize,
                                a.dtype)))
        return
    import tempfile

    from machine import cpu_account, describe, machine, other_work, write_results
    here = str(Path(__file__).resolve().parents[1])
    labels = ((("before", a.before),) if a.before else ()) + (("after", here),)
    start, acc0 = machine(), cpu_account()
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(a.rounds):
            for label, code in (labels if rnd % 2 == 0 else labels[::-1]):
                keep = [q for q in os.environ.get("PYTHONPATH", "").split(os.pathsep)     # not another checkout
                        if q and not (Path(q) / "tensorpar").is_dir()]
                env = {**os.environ, "TENSORPAR_BENCH_CODE": code, "PYTHONPATH": os.pathsep.join([code] + keep)}
                cmd = [sys.executable, __file__, "--worker", "--model", folder, "--tokens", str(a.tokens),
                       "--tp", str(a.tp), "--batch", str(a.batch), "--quantize", a.quantize,
                       "--dtype", a.dtype]
                if a.pyspy and rnd == 0:
                    cmd += ["--pyspy", a.pyspy, "--pyspy-calls", str(a.pyspy_calls),
                            "--spy-out", str(Path(tmp) / f"{label}.txt")]
                load = os.getloadavg()
                r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
                if r.returncode:
                    raise RuntimeError(f"{label} failed:\n{r.stderr[-4000:]}")
                res = json.loads(r.stdout.strip().splitlines()[-1])
                res["loadavg_before"] = list(load)
                res["loadavg_after"] = list(os.getloadavg())
                print(f"round {rnd + 1} {label}: {res['decode_tok_s']:.1f} tok/s, median step "
                      f"{res['median_step_ms']:.2f} ms, best {res['best_step_ms']:.2f} ms, load "
                      f"{load[0]:.1f}", flush=True)
                commit = subprocess.run(["git", "-C", code, "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip()
                rows.setdefault(label, {"label": label, "commit": commit, "rounds": []})["rounds"].append(res)
    end = machine()
    work = other_work(acc0, cpu_account())
    med = statistics.median
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__, "tokens": a.tokens, "tp": a.tp,
            "batch": a.batch, "quantize": a.quantize, "dtype": a.dtype,
            "machine_start": start, "machine_end": end, "model": a.model, "other_work": work}
    ls, le = start["loadavg"], end["loadavg"]
    weights = a.quantize if a.quantize != "none" else "fp32" if a.dtype == "float32" else "bf16"
    acts = "fp32" if a.dtype == "float32" else "bf16"
    lines = [f"{a.model}, {weights} weights ({acts} activations), greedy decode, tp={a.tp} (1 thread per rank, "
             f"shared-memory collectives), batch {a.batch}, {a.tokens} new tokens, prompt {PROMPT!r}; {start['cpu']}, "
             f"{start['cores']} cores, torch {meta['torch']}, {meta['date']}. Load average at start {ls[0]:.2f} / "
             f"{ls[1]:.2f} / {ls[2]:.2f}, at end {le[0]:.2f} / {le[1]:.2f} / {le[2]:.2f}; {describe(work)}.", "",
             f"{a.rounds} round(s), rows alternating (order reversed every other round), each in fresh processes. "
             "tokens/s: decode steps only, summed over the batch's rows; step ms: wall time between two tokens "
             "(median over rounds of each round's median step; best: the fastest step of all rounds).", "",
             "| row | commit | tokens/s (median) | tokens/s per round | median step ms | best step ms | "
             "load (1 min) per round |", "|---|---|---|---|---|---|---|"]
    for key, r in rows.items():
        rs = r["rounds"]
        lines.append(f"| {key} | {r['commit']} | {med(x['decode_tok_s'] for x in rs):.1f} | "
                     + ", ".join(f"{x['decode_tok_s']:.1f}" for x in rs)
                     + f" | {med(x['median_step_ms'] for x in rs):.2f} | {min(x['best_step_ms'] for x in rs):.2f} | "
                     + ", ".join(f"{x['loadavg_before'][0]:.1f}" for x in rs) + " |")
    if len(rows) == 2:
        b, c = rows["before"]["rounds"], rows["after"]["rounds"]
        ratio = med(x['decode_tok_s'] for x in c) / med(x['decode_tok_s'] for x in b)
        lines += ["", f"after / before: tokens/s {ratio:.3f}x, "
                  f"median step {med(x['median_step_ms'] for x in c) - med(x['median_step_ms'] for x in b):+.2f} ms, "
                  f"best step {min(x['best_step_ms'] for x in c) - min(x['best_step_ms'] for x in b):+.2f} ms; "
                  f"greedy tokens equal: {b[0]['tokens'] == c[0]['tokens']}, equal across ranks: "
                  f"{all(x['tokens_equal_across_ranks'] for x in b + c)}."]
    cats = []
    for r in rows.values():
        for x in r["rounds"]:
            cats += [k for k in x["cpu_ms"] if k not in cats]
    lines += ["", "Thread CPU ms per decode step, rank 0, by category (exclusive; median over the steps of one "
              "generate call, then the median over rounds; `step` is the whole step):", "",
              "| category | " + " | ".join(rows) + " |", "|---|" + "---|" * len(rows)]
    for k in cats:
        lines.append(f"| {k} | " + " | ".join(f"{med(x['cpu_ms'].get(k, 0.0) for x in r['rounds']):.3f}"
                                              for r in rows.values()) + " |")

    def summed(x, pick):
        return sum(v for k, v in x["cpu_ms"].items() if pick(k))
    for label, pick in (("kernel calls, all", lambda k: k.startswith("kernel calls")),
                        ("collectives, all", lambda k: k.startswith("collectives")),
                        ("the rest: framework (step - kernel calls - collectives)",
                         lambda k: k != "step" and not k.startswith(("kernel calls", "collectives")))):
        lines.append(f"| **{label}** | " + " | ".join(f"{med(summed(x, pick) for x in r['rounds']):.3f}"
                                                      for r in rows.values()) + " |")
    for key, r in rows.items():
        x = r["rounds"][0]
        calls = sum(x["calls_per_token"].values())
        lines.append(f"\nInstrumentation, {key}: {calls:.0f} wrapped calls per token, each "
                     f"{x['wrapper_us']['total']:.2f} us of thread CPU time ({x['wrapper_us']['inside']:.2f} us of it inside its own category): "
                     f"about {calls * x['wrapper_us']['total'] / 1e3:.2f} ms per step of the breakdown is the timers "
                     f"(the tokens/s above ran without them). Calls per token: "
                     + ", ".join(f"{k} {v:g}" for k, v in x["calls_per_token"].items()) + ".")
    for key, r in rows.items():
        spy = r["rounds"][0].get("pyspy")
        if spy:
            lines += ["", f"py-spy, {key}, rank 0, {spy['samples']} samples at 200 Hz over "
                      f"{r['rounds'][0].get('pyspy_s', 0):.1f} s of generate calls: share by phase: "
                      + ", ".join(f"{k} {v:.1%}" for k, v in spy["by_phase"].items()), "",
                      "by leaf function: " + ", ".join(f"{k} {v:.1%}" for k, v in spy["by_leaf"].items())]
    write_results(Path(a.out), meta, list(rows.values()), lines)


if __name__ == "__main__":
    main()
