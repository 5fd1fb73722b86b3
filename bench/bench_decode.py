"""Decode against the memory-bandwidth roofline: the lean path vs the module path, fp32 vs bf16, batch 1/4/16.

Small-batch decode reads every weight once per step, so its limit is ``bandwidth / weight bytes per token``
(Pope et al. 2022, "Efficiently Scaling Transformer Inference", sec. 3.1). In the same run this script

1. measures the memory bandwidth of 1 and of 2 processes (one thread each; each process streams its own
   fp32 matrix through a GEMV ``W @ x`` of ``--gemv-mb`` MB, the decode access pattern, both processes at the
   same time; the figure is both processes' bytes over the slower one's time, best of 30 repetitions);
2. runs greedy decode of SmolLM2-135M (``--tokens`` new tokens, EOS ignored), each configuration in fresh
   processes: transformers ``generate`` with 2 threads, tensorpar tp=1 (1 thread) and tp=2 (1 thread per rank,
   shared-memory collectives), the module path (``path="hf"``) and the lean path (``path="lean"``), fp32 and
   bf16, int8 weights with bf16 activations (``--quantize int8``; its roofline counts the int8 bytes), and the
   lean path at batch 1, 4 and 16 (tokens/s summed over the batch);
3. prints each row's tokens/s and its fraction of the roofline: weight bytes per token (every parameter once:
   the tied embedding is read by the LM head) / bandwidth, with the 1-process bandwidth for one process and the
   2-process bandwidth for tp=2. Batch rows read the same weights for ``b`` tokens: their roofline is ``b`` times;
4. profiles the tp=2 decodes (module path and lean fp32, lean bf16; torch.profiler over the decode steps): per token, the matmuls, attention,
   collectives (shared-memory all-reduce, waits for the slower rank included) and the rest (framework: Python,
   small ops);
5. the quality cost of bf16: perplexity of the lean path (tp=1) at fp32 and bf16 on a held-out Shakespeare slice
   (the first play of the corpus' validation split, ``--ppl-tokens`` tokens after its first 4000 characters, in
   windows of 256);
6. a llama.cpp row only if ``llama_cpp`` imports (it is not installed by this script).

    python bench/bench_decode.py [--tokens 32] [--out bench/results]

Writes ``decode.json`` and ``decode.md`` under ``--out``, with the load average at start and end (the machine
is shared: rows measured under load are slower than the roofline says they could be).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

# TENSORPAR_BENCH_CODE: the checkout whose tensorpar this process (and its ranks) import: the A/B of --fixed-cost runs
# the old code (--before: another checkout) and this one interleaved, each in processes of its own
sys.path.insert(0, os.environ.get("TENSORPAR_BENCH_CODE") or str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from proc_memory import proc_memory  # noqa: E402

PROMPT = "The capital of France is"


def job_bandwidth(ctx, mb: int, reps: int):
    """Bytes/s of all ranks together, each streaming its own ``mb`` MB fp32 matrix through one GEMV at the same
    time: per repetition the ranks start together (an all-reduce as barrier) and the slowest one's time counts;
    the best repetition is kept (the machine is shared: the best is the closest to what the memory can do)."""
    from tensorpar import comm
    torch.set_num_threads(1)
    k = 2048
    w = torch.randn(mb * 2**20 // 4 // k, k)
    x = torch.randn(k)
    for _ in range(2):
        torch.mv(w, x)
    times = []
    for _ in range(reps):
        comm.all_reduce(torch.zeros(1), ctx.tp)                  # start together
        t0 = time.perf_counter()
        torch.mv(w, x)
        times.append(time.perf_counter() - t0)
    slowest = comm.all_reduce(torch.tensor(times, dtype=torch.float64), ctx.tp, op="max")   # per repetition
    best = float(slowest.min())
    return {"bytes_per_s": w.numel() * 4 * ctx.tp.size / best, "best_s": best,
            "median_s": float(slowest.median())}


def _weight_bytes(model, quantize: str = "none") -> int:
    if quantize in ("int8", "bf16"):   # the stored weights (+ scales) the lean path reads and the parameters left
        return _shard_bytes(model)      # (norms; an untied input embedding, which the caller subtracts as read once)
    from tensorpar.decode.packed import packed_weight_bytes      # packed weights are not parameters
    return sum(p.numel() * p.element_size() for p in model.parameters()) + packed_weight_bytes(model)


def _quantize(model, tp, quantize: str) -> None:
    from tensorpar.decode.quantize import apply_quantize
    apply_quantize(model, tp, quantize)
    inference_only(model)


def inference_only(model) -> None:
    """Mark ``model`` as the ``generate`` command does (``tensorpar.generate.inference_only``: the engine keeps
    its faster weight layouts between calls), where the checkout has it (not before 2026-12-04)."""
    import tensorpar.generate as gen
    mark = getattr(gen, "inference_only", None)
    if mark is not None:
        mark(model)


def prompt_inputs(folder, batch: int = 1, prompt_ids=None) -> dict:
    """``{"input_ids", "attention_mask"}`` of ``batch`` copies of the prompt, shape ``(batch, length)``:
    ``PROMPT`` through the folder's tokenizer, or ``prompt_ids`` (a list of token ids) for a folder without one."""
    if prompt_ids is not None:
        ids = torch.tensor([list(prompt_ids)] * batch, dtype=torch.long)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    from transformers import AutoTokenizer
    return dict(AutoTokenizer.from_pretrained(folder)([PROMPT] * batch, return_tensors="pt"))


def job_hf(ctx, folder, n, threads, dtype, tp_plan=None, prompt_ids=None):
    """transformers ``generate`` (greedy). With ``tp_plan`` (e.g. ``"auto"``) the model is loaded with
    transformers' own tensor parallelism over the ranks' default process group (every rank runs this job)."""
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer
    torch.set_num_threads(threads)
    ids = prompt_inputs(folder, 1, prompt_ids)
    kw = {}
    if tp_plan is not None:     # the same as from_pretrained(..., tp_plan=tp_plan), without its deprecation warning
        from transformers import DistributedConfig
        # transformers derives tp_size from $WORLD_SIZE (torchrun's), falling back to 1 - an unsharded model -
        # without a word when it is unset (distributed/configuration_utils.py, _resolve_parallelism): set
        # torchrun's variables from the process group and pass tp_size explicitly.
        world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
        kw["distributed_config"] = DistributedConfig(tp_plan=tp_plan, tp_size=world)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype), **kw).eval()

    class Stamps(BaseStreamer):
        def __init__(self):
            self.t = []

        def put(self, value):
            self.t.append(time.perf_counter())

        def end(self):
            pass

    with torch.no_grad():
        model.generate(**ids, max_new_tokens=2, do_sample=False)
        stamps = Stamps()
        t0 = time.perf_counter()
        out = model.generate(**ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                             streamer=stamps)
    ttft = stamps.t[1] - t0
    best = min(b - a for a, b in zip(stamps.t[1:], stamps.t[2:]))
    res = {"decode_tok_s": (n - 1) / max(stamps.t[-1] - t0 - ttft, 1e-9), "best_step_tok_s": 1 / best,
           "weight_bytes": _weight_bytes(model),
           "tokens": out[0, ids["input_ids"].shape[1]:].tolist()}
    if tp_plan is not None:     # evidence that the model is sharded: the first q_proj's type and local shape
        w = model.model.layers[0].self_attn.q_proj.weight
        local = w.to_local() if hasattr(w, "to_local") else w
        res["sharding"] = f"{type(w).__name__} {tuple(w.shape)}, local {tuple(local.shape)}"
        if torch.distributed.get_world_size() > 1 and local.numel() == model.config.hidden_size ** 2:
            raise RuntimeError(f"tp_plan={tp_plan!r} left q_proj unsharded: {res['sharding']}")
    return res


def _untied_embedding_bytes(model) -> int:
    """Bytes of this rank's input embedding when the LM head does not share it (decode reads one row of it per
    token, not the table), else 0."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    w = embed._parameters.get("weight")
    if w is None or (head is not None and head._parameters.get("weight") is w):
        return 0
    return w.numel() * w.element_size()


def _shard_bytes(model) -> int:
    """Bytes of this rank's shard in the format it decodes in: every distinct parameter (after ``--quantize int8``:
    the norms and the untied embedding, whose quantized weights are no longer parameters) plus the int8 weights and
    scales."""
    from tensorpar.decode.int8 import int8_weight_bytes, int8_weights
    seen, n = set(), 0
    for p in model.parameters():
        if p.untyped_storage().data_ptr() not in seen:
            seen.add(p.untyped_storage().data_ptr())
            n += p.numel() * p.element_size()
    return n + (int8_weight_bytes(model) if int8_weights(model) is not None else 0)


MEMORY_STEPS = 32       # issue 28, item 4: resident memory after load and after this many decode steps


def job_tp(ctx, folder, n, dtype, path, batch, profile=False, quantize="none", prompt_ids=None, memory=False):
    """Greedy decode of ``n`` new tokens on this rank (1 thread), timed per step after a 3-token warm-up.

    ``memory``: also this rank's :func:`proc_memory` before the model is built (the process baseline: imports, the
    family's transformers modeling code, process group, shared-memory collectives; ``baseline_before_model_code``:
    before that code was imported), after it is loaded (and quantized), and after a decode of
    ``MEMORY_STEPS`` tokens (the timed one when ``n >= MEMORY_STEPS``, else one more), with the bytes of its shard
    (:func:`_shard_bytes`) and what the model's tensors hold (:func:`tensorpar.decode.quantize.resident_weight_bytes`)."""
    from tensorpar import comm
    from tensorpar.generate import SamplingConfig, generate_tokens
    from tensorpar.hf.load import build_parallel_model
    torch.set_num_threads(1)
    if ctx.tp.size > 1:
        from tensorpar.shm import enable_fast_collectives
        enable_fast_collectives(ctx.tp, "on")
    mem = None
    if memory:
        # the model's code is part of the process, not of its shard: transformers' modeling module of the family
        # (~100 MB of RSS for Llama) is imported before the baseline; the RSS without it is kept beside it
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
        mem = {"baseline_before_model_code": proc_memory()}
        MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(folder))]
        mem["baseline"] = proc_memory()
    model, _ = build_parallel_model(folder, ctx.tp, dtype=getattr(torch, dtype))
    _quantize(model, ctx.tp, quantize)
    if memory:
        from tensorpar.decode.quantize import resident_weight_bytes
        mem.update(after_load=proc_memory(), shard_bytes=_shard_bytes(model),
                   model_tensor_bytes_after_load=resident_weight_bytes(model))
    ids = prompt_inputs(folder, batch, prompt_ids)["input_ids"]
    generate_tokens(model, ctx.tp, ids, sampling=SamplingConfig(max_new_tokens=3), path=path)     # warm-up
    stamps = []
    res = generate_tokens(model, ctx.tp, ids, sampling=SamplingConfig(max_new_tokens=n), path=path,
                          on_token=lambda step, tok: stamps.append(time.perf_counter()))
    best = min(b - a for a, b in zip(stamps, stamps[1:]))       # the fastest decode step (least disturbed)
    local = _weight_bytes(model, quantize)
    total, embed = comm.all_reduce(torch.tensor([float(local), float(_untied_embedding_bytes(model))],
                                                dtype=torch.float64), ctx.tp).tolist()
    out = {"decode_tok_s": res.decode_tokens_per_s * batch, "best_step_tok_s": batch / best, "weight_bytes": total,
           "untied_embedding_bytes": embed, "tokens": res.tokens[0].tolist()}
    if memory:
        if n < MEMORY_STEPS:
            generate_tokens(model, ctx.tp, ids, sampling=SamplingConfig(max_new_tokens=MEMORY_STEPS), path=path)
        from tensorpar.decode.quantize import resident_weight_bytes
        mem.update(after_decode=proc_memory(), model_tensor_bytes_after_decode=resident_weight_bytes(model),
                   decode_steps=max(n, MEMORY_STEPS), rank=ctx.tp.rank)
        out["memory"] = mem
    if profile:
        out.update(_profile(model, ctx, ids, n, path))
    return out


def _outermost(e) -> bool:
    """Whether profiler event ``e`` has no wrapped (``bench::``) call above it but the decode step's range."""
    p = e.cpu_parent
    while p is not None:
        if p.name.startswith("bench::") and p.name != "bench::decode_step":
            return False
        p = p.cpu_parent
    return True


def _profile(model, ctx, ids, n: int, path: str) -> dict:
    """One more generate call of ``n`` new tokens under torch.profiler, only its decode steps counted (each step
    between two ``on_token`` calls is one profiler range: construction and prefill are left out). The
    :data:`TRACED` functions (the C kernels called through ctypes, which are no aten ops, and the collectives) are
    wrapped in ranges counted inclusively; aten matmul and attention ops count by self time; the rest of a step is
    framework (Python and small ops). Returns ``{"profile": {category: ms per token, ..., counts}}``."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile, record_function

    from tensorpar.generate import SamplingConfig, generate_tokens
    layers = model.config.num_hidden_layers
    out = {}
    wrapped = []
    traced_fns, release_engine = _traced_functions()
    for mod, name, cat, fn in traced_fns:

        def traced(*a, _fn=fn, _label=f"bench::{cat}::{name}", **k):
            with record_function(_label):
                return _fn(*a, **k)
        _set(mod, name, traced)
        wrapped.append((mod, name, fn))
    if release_engine is not None:
        release_engine(model)
    marks = []

    def on_token(step, tok):
        if marks:
            marks.pop().__exit__(None, None, None)
        if step < n - 1:
            rf = record_function("bench::decode_step")
            rf.__enter__()
            marks.append(rf)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            generate_tokens(model, ctx.tp, ids, sampling=SamplingConfig(max_new_tokens=n), path=path,
                            on_token=on_token)
    finally:
        for mod, name, fn in wrapped:
            _set(mod, name, fn)
        if release_engine is not None:
            release_engine(model)           # the next engine binds the kernels unwrapped
    events = prof.events()
    ranges = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == "bench::decode_step")
    steps = len(ranges)

    def in_step(e):
        t = e.time_range.start
        return any(a <= t <= b for a, b in ranges)
    cats = {"matmul": 0.0, "attention": 0.0, "collectives": 0.0}
    counts: Counter = Counter()
    kernel_calls: Counter = Counter()
    for e in events:
        if e.name == "bench::decode_step" or not in_step(e):
            continue
        if e.name.startswith("bench::"):
            if not _outermost(e):       # inside another wrapped call (an exchange inside a fused all-reduce)
                continue
            cats[e.name.split("::")[1]] += e.cpu_time_total / 1e3
            kernel_calls[e.name.split("::")[2]] += 1
            continue
        if e.name.startswith("aten::") or e.name.startswith("mkldnn::"):
            counts[e.name] += 1
        if e.name in MATMUL_OPS:
            cats["matmul"] += e.self_cpu_time_total / 1e3
        elif "scaled_dot_product" in e.name or "flash_attention" in e.name:
            cats["attention"] += e.self_cpu_time_total / 1e3
    # aten ops under a wrapped range (the shm all-reduce's add) are counted as calls, their time in the range's
    total = sum(b - a for a, b in ranges) / 1e3
    per = {k: v / steps for k, v in cats.items()}
    per["total"] = total / steps
    per["framework and other ops"] = per["total"] - per["matmul"] - per["attention"] - per["collectives"]
    aten = sum(v for k, v in counts.items() if k.startswith("aten::"))
    out["profile"] = {k: round(v, 3) for k, v in per.items()}
    out["profile"].update({
        "steps": steps, "aten ops per token": round(aten / steps, 1), "aten ops per layer": round(aten / steps / layers, 1),
        "kernel calls per token (ctypes, not aten)": {k: round(v / steps, 1) for k, v in kernel_calls.items()},
        "top ops per token": {k: round(v / steps, 1) for k, v in counts.most_common(25)}})
    return out


# ---------------------------------------------------------------- the fixed cost per token (issue 28), A/B of two checkouts

#: functions wrapped in a profiler range during --fixed-cost's profile, if the checkout has them: (module, name,
#: category). The GEMV is a ctypes call (no aten op), so without its range its time would count as framework.
TRACED = (("tensorpar.comm", "all_reduce", "collectives"), ("tensorpar.decode.gemv_kernel", "linear", "matmul"),
          ("tensorpar.decode.gemv_kernel", "linear_into", "matmul"),
          ("tensorpar.decode.fused", "all_reduce_add_rms_norm", "collectives"),
          # the row step's exchange (its programs add the partial sums themselves)
          ("tensorpar.decode.fused", "all_reduce_exchange", "collectives"),
          # the row step's kernel calls: its programs (a layer's GEMVs with its rotary, attention and SiLU in one C
          # call) and, in a checkout before them, those small kernels called one by one: kernel work, with the
          # matmuls (before 2026-12-02 the small kernels counted as framework: about 1 ms per token at tp=2 with
          # their calls, bench/results/step_overhead-standin.md)
          ("tensorpar.decode.fused", "run_program", "matmul"), ("tensorpar.decode.fused", "rope_store", "matmul"),
          ("tensorpar.decode.fused", "decode_attention", "matmul"), ("tensorpar.decode.fused", "silu_mul", "matmul"),
          # from 2026-12-03 night the whole step is one program (``run_at``): the matmuls, attention and, on shared
          # memory, the all-reduces' exchanges in C with their waits; counted as matmul here (bench_step_overhead.py
          # has the finer breakdown); a late peer's wait finishes in Python (``c_exchange_wait``, collectives)
          ("tensorpar.decode.fused", "run_at", "matmul"),
          ("tensorpar.shm.collectives", "ShmCommunicator.c_exchange_wait", "collectives"),
          # the row step's LM head (and, before the programs, its matmuls): the kernel its _Matmuls bound from
          # step_matmuls._KERNELS, one entry per weight format
          ("tensorpar.decode.step_matmuls", "_KERNELS[]", "matmul"))
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::mv", "aten::addmv", "aten::_weight_int8pack_mm",
              "mkldnn::_linear_pointwise")


def _traced_functions():
    """``(owner, name, category, function)`` of each :data:`TRACED` entry this checkout has (an old checkout, run
    with ``--before``, may lack some): ``owner`` a module, a class (``"Class.method"`` names) or, for
    ``"_KERNELS[]"``, the dict whose entries ``(available, run)`` are patched per weight format (:func:`_set`). A
    kept engine is released, so that the row step built next binds the wrapped kernels."""
    import importlib
    out = []
    for mod_name, name, cat in TRACED:
        try:
            owner = importlib.import_module(mod_name)
        except ImportError:
            continue
        if name.endswith("[]"):
            table = getattr(owner, name[:-2], None)
            out += [(table, fmt, cat, run) for fmt, (_, run) in (table or {}).items()]
            continue
        *path, leaf = name.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        fn = getattr(owner, leaf, None) if owner is not None else None
        if fn is not None:
            out.append((owner, leaf, cat, fn))
    try:
        from tensorpar.generate.engine_cache import release_engine
    except ImportError:
        release_engine = None
    return out, release_engine


def _set(owner, name, fn) -> None:
    """``owner.name = fn``; for a kernel table (a dict), its entry ``name``'s run function."""
    if isinstance(owner, dict):
        owner[name] = (owner[name][0], fn)
    else:
        setattr(owner, name, fn)


def job_fixed_cost(ctx, folder, n: int):
    """SmolLM2 fp32 greedy decode on the lean path at this tp (1 thread per rank): tokens/s of ``n`` new tokens after
    a warm-up, then one more generate under torch.profiler in which only the decode steps count (each step between
    two ``on_token`` calls is one profiler range: construction and prefill are left out). Returns tokens/s, the
    tokens, and per token: aten calls (nested ones included: a count, independent of the load), the top aten ops by
    count, and CPU ms by category (GEMV / matmuls and the all-reduces inclusive of their range, attention kernels'
    self time, the rest = framework: Python and small ops; :func:`_profile`)."""
    from tensorpar.generate import SamplingConfig, generate_tokens
    from tensorpar.hf.load import build_parallel_model
    torch.set_num_threads(1)
    if ctx.tp.size > 1:
        from tensorpar.shm import enable_fast_collectives
        enable_fast_collectives(ctx.tp, "on")
    model, _ = build_parallel_model(folder, ctx.tp, dtype=torch.float32)
    inference_only(model)
    ids = prompt_inputs(folder)["input_ids"]
    generate_tokens(model, ctx.tp, ids, sampling=SamplingConfig(max_new_tokens=3), path="lean")    # warm-up
    stamps = []
    res = generate_tokens(model, ctx.tp, ids, sampling=SamplingConfig(max_new_tokens=n), path="lean",
                          on_token=lambda step, tok: stamps.append(time.perf_counter()))
    steps_s = [b - a for a, b in zip(stamps, stamps[1:])]
    out = {"decode_tok_s": res.decode_tokens_per_s, "best_step_tok_s": 1 / min(steps_s),
           "median_step_ms": statistics.median(steps_s) * 1e3, "tokens": res.tokens[0].tolist()}
    out["cpu"] = _cpu_times(model, ctx, ids, n)
    out.update(_profile(model, ctx, ids, n, "lean"))
    return out


def _cpu_times(model, ctx, ids, n: int) -> dict:
    """Thread CPU ms per decode step (``time.thread_time``: what this rank's thread ran, not the time it waited for a
    core, so it holds on a loaded machine where the profiler's wall times do not), in all and inside the
    :data:`TRACED` functions by category (each call timed by two ``thread_time_ns`` reads, about a microsecond,
    left in the categories); ``framework`` = the rest. Median over the decode steps of one generate call."""

    from tensorpar.generate import SamplingConfig, generate_tokens
    acc = {"matmul": 0, "collectives": 0}
    wrapped = []
    traced_fns, release_engine = _traced_functions()
    for mod, name, cat, fn in traced_fns:

        def timed(*a, _fn=fn, _cat=cat, **k):
            t0 = time.thread_time_ns()
            try:
                return _fn(*a, **k)
            finally:
                acc[_cat] += time.thread_time_ns() - t0
        _set(mod, name, timed)
        wrapped.append((mod, name, fn))
    if release_engine is not None:
        release_engine(model)
    steps = []
    last = {}

    def on_token(step, tok):
        now = time.thread_time_ns()
        if last:
            steps.append({"step": now - last["t"], **{k: acc[k] - last[k] for k in acc}})
        last.update(t=now, **acc)
    try:
        generate_tokens(model, ctx.tp, ids, sampling=SamplingConfig(max_new_tokens=n), path="lean", on_token=on_token)
    finally:
        for mod, name, fn in wrapped:
            _set(mod, name, fn)
        if release_engine is not None:
            release_engine(model)           # the next engine binds the kernels unwrapped
    med = {k: statistics.median(s[k] for s in steps) / 1e6 for k in steps[0]}
    med["framework"] = statistics.median((s["step"] - s["matmul"] - s["collectives"]) for s in steps) / 1e6
    return {k: round(v, 3) for k, v in med.items()}


def fixed_cost_worker(folder: str, tp: int, n: int) -> dict:
    """One checkout's row of --fixed-cost in this process (its ranks in fresh processes): rank 0's result, every
    rank's aten ops per token."""
    from tensorpar.testing import WorkerPool
    with WorkerPool(tp, collective_timeout_s=120, job_timeout_s=1200) as pool:
        res = pool.run(job_fixed_cost, folder, n)
    out = dict(res[0])
    out["aten ops per token, every rank"] = [r["profile"]["aten ops per token"] for r in res]
    out["tokens_equal_across_ranks"] = all(r["tokens"] == res[0]["tokens"] for r in res)
    return out


def run_fixed_cost(folder: str, n: int, rounds: int, before: str | None) -> dict:
    """SmolLM2 fp32 lean decode at tp=1 and tp=2, the checkout ``before`` (the old code) and this one, ``rounds``
    times interleaved, every row in fresh processes (:func:`fixed_cost_worker` under ``TENSORPAR_BENCH_CODE``)."""
    import subprocess

    from machine import machine
    here = str(Path(__file__).resolve().parents[1])
    start = machine()
    rows: dict[str, dict] = {}
    for rnd in range(rounds):
        for label, code in ((("before", before),) if before else ()) + (("after", here),):
            for tp in (1, 2):
                env = {**os.environ, "TENSORPAR_BENCH_CODE": code, "PYTHONPATH": code}
                p = subprocess.run([sys.executable, __file__, "--fixed-cost-worker", str(tp), "--model", folder,
                                    "--tokens", str(n)], env=env, capture_output=True, text=True, timeout=1800)
                if p.returncode:
                    raise RuntimeError(f"{label} tp={tp} failed:\n{p.stderr[-4000:]}")
                r = json.loads(p.stdout.strip().splitlines()[-1])
                r["loadavg"] = list(os.getloadavg())
                key = f"{label} tp={tp}"
                print(f"round {rnd + 1}: {key}: {r['decode_tok_s']:.1f} tok/s, {r['profile']['aten ops per token']} "
                      f"aten ops/token, framework {r['profile']['framework and other ops']:.2f} ms/token, load "
                      f"{r['loadavg'][0]:.1f}", flush=True)
                commit = subprocess.run(["git", "-C", code, "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip()
                rows.setdefault(key, {"label": label, "tp": tp, "commit": commit, "rounds": []})["rounds"].append(r)
    return {"machine_start": start, "machine_end": machine(), "tokens": n, "rows": rows}


def write_fixed_cost(res: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__, **res}
    (out / "decode_fixed_cost.json").write_text(json.dumps(res, indent=2))
    ms, me = res["machine_start"], res["machine_end"]
    med = statistics.median
    lines = [f"SmolLM2-135M fp32 greedy decode on the lean path, {res['tokens']} new tokens, prompt {PROMPT!r}, 1 "
             f"thread per rank; {ms['cpu']}, {ms['cores']} cores, torch {res['torch']}, {res['date']}. Load average "
             f"at start {ms['loadavg'][0]:.2f} / {ms['loadavg'][1]:.2f} / {ms['loadavg'][2]:.2f}, at end "
             f"{me['loadavg'][0]:.2f} / {me['loadavg'][1]:.2f} / {me['loadavg'][2]:.2f} (shared machine).", "",
             "before = the old checkout, after = this one, interleaved in rounds, every row in fresh processes. "
             "tokens/s and ms: median over rounds; aten ops per token (nested calls included) over the decode steps "
             "only, a count that does not depend on the load; ms per token by category from torch.profiler (rank 0, "
             "self CPU time; the GEMV and the all-reduce inclusive of a profiler range around them, which adds its "
             "own overhead; framework = the step's wall time minus the three).", "",
             "CPU ms columns: this rank's thread CPU time per decode step (median over steps; not the time spent "
             "waiting for a core, so they hold under load): the whole step, inside the GEMV / matmul calls (and the "
             "row step's rotary, attention and SiLU kernels, one by one or in its programs), inside the all-reduces "
             "(its waits for the other rank spin or yield: CPU time too), and the rest = framework.",
             "",
             "| row | tokens/s | best step tokens/s | aten ops per token | per layer | CPU ms: step | GEMV | all-reduce | "
             "framework | profiler: matmul ms | attention ms | all-reduce ms | framework ms | step ms | load (1 min) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, r in res["rows"].items():
        rs = r["rounds"]
        p = [x["profile"] for x in rs]
        lines.append(f"| {key} | {med(x['decode_tok_s'] for x in rs):.1f} | {max(x['best_step_tok_s'] for x in rs):.1f} "
                     f"| {p[0]['aten ops per token']} | {p[0]['aten ops per layer']} | "
                     + " | ".join(f"{med(x['cpu'][k] for x in rs):.2f}" for k in ("step", "matmul", "collectives",
                                                                                 "framework"))
                     + f" | {med(q['matmul'] for q in p):.2f} "
                     f"| {med(q['attention'] for q in p):.2f} | {med(q['collectives'] for q in p):.2f} | "
                     f"{med(q['framework and other ops'] for q in p):.2f} | {med(q['total'] for q in p):.2f} | "
                     + ", ".join(f"{x['loadavg'][0]:.1f}" for x in rs) + " |")
    rows = res["rows"]
    for tp in (1, 2):
        a, b = rows.get(f"after tp={tp}"), rows.get(f"before tp={tp}")
        if a and b:
            same = a["rounds"][0]["tokens"] == b["rounds"][0]["tokens"]
            lines.append(f"\ntp={tp}: after / before tokens/s {med(x['decode_tok_s'] for x in a['rounds']) / med(x['decode_tok_s'] for x in b['rounds']):.2f}x; "
                         f"greedy tokens equal: {same}.")
    if rows.get("after tp=1") and rows.get("after tp=2"):
        lines.append(f"after: tp=2 tokens equal tp=1: {rows['after tp=1']['rounds'][0]['tokens'] == rows['after tp=2']['rounds'][0]['tokens']}.")
    for key, r in rows.items():
        p = r["rounds"][0]["profile"]
        lines += ["", f"Top aten ops per token, {key} (rank 0; GEMV/other ctypes kernel calls per token: "
                  f"{p['kernel calls per token (ctypes, not aten)']}):", "",
                  ", ".join(f"{k} {v}" for k, v in p["top ops per token"].items())]
    (out / "decode_fixed_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def perplexity(folder: str, n_tokens: int, dtype: str, window: int = 256,
               quantize: str = "none") -> tuple[float, str, int]:
    """``(exp(mean next-token NLL), work, tokens scored)`` of the lean path (tp=1) on the held-out Shakespeare slice."""
    from transformers import AutoTokenizer

    from tensorpar.data.shakespeare import load_works, split_works
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.decode.lean import LeanDecoder
    from tensorpar.parallel import ParallelContext
    _, val = split_works(load_works(progress=False), 0.05)
    text = val[0].text[4000:4000 + 8 * n_tokens]
    ids = AutoTokenizer.from_pretrained(folder)(text, return_tensors="pt")["input_ids"][:, :n_tokens]
    ctx = ParallelContext.single()
    model, _ = build_parallel_model(folder, ctx.tp, dtype=getattr(torch, dtype))
    _quantize(model, ctx.tp, quantize)
    lean = LeanDecoder(model, ctx.tp, max_batch=1, max_len=window)
    nll, count = 0.0, 0
    for s in range(0, ids.shape[1] - 1, window):
        chunk = ids[:, s:s + window]
        if chunk.shape[1] < 2:
            break
        pos = torch.arange(chunk.shape[1])[None]
        causal = torch.ones(chunk.shape[1], chunk.shape[1], dtype=torch.bool).tril()
        logits = lean.forward(chunk, pos, causal, length=chunk.shape[1], start=0, last_only=False).float()
        nll += torch.nn.functional.cross_entropy(logits[0, :-1], chunk[0, 1:], reduction="sum").item()
        count += chunk.shape[1] - 1
    return math.exp(nll / count), val[0].name, count


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
        return True
    except ImportError:
        return False


def run(folder: str, n: int, mb: int, rounds: int = 1) -> dict:
    """All rows, ``rounds`` times interleaved (round 1 runs every row, then round 2, ...): per row the round with
    the highest mean tokens/s is kept and the best step is the fastest of all rounds (the machine is shared: the
    least disturbed run is the closest to what the configuration can do); profiles run in the first round only."""
    from tensorpar.testing import WorkerPool

    def pool_run(world, fn, *args):
        with WorkerPool(world, collective_timeout_s=120, job_timeout_s=1200) as pool:
            return pool.run(fn, *args)

    load_start = os.getloadavg()
    bw = {w: pool_run(w, job_bandwidth, mb, 30)[0]["bytes_per_s"] for w in (1, 2)}
    print(f"bandwidth: 1 process {bw[1] / 1e9:.1f} GB/s, 2 processes {bw[2] / 1e9:.1f} GB/s", flush=True)
    specs = []

    def row(name, world, threads, fn, *args, batch=1, dtype="float32"):
        specs.append((name, world, threads, fn, args, batch, dtype))

    row("transformers generate, 2 threads", 1, 2, job_hf, folder, n, 2, "float32")
    row("tensorpar tp=1, 1 thread, module path", 1, 1, job_tp, folder, n, "float32", "hf", 1)
    row("tensorpar tp=1, 1 thread, lean", 1, 1, job_tp, folder, n, "float32", "lean", 1)
    row("tensorpar tp=2, 1 thread/rank, module path", 2, 1, job_tp, folder, n, "float32", "hf", 1, True)
    row("tensorpar tp=2, 1 thread/rank, lean", 2, 1, job_tp, folder, n, "float32", "lean", 1, True)
    row("tensorpar tp=1, 1 thread, lean, bf16", 1, 1, job_tp, folder, n, "bfloat16", "lean", 1, dtype="bfloat16")
    row("tensorpar tp=2, 1 thread/rank, lean, bf16", 2, 1, job_tp, folder, n, "bfloat16", "lean", 1, True,
        dtype="bfloat16")
    for world in (1, 2):    # int8 weight-only (tensorpar/decode/quantize.py) with bf16 activations: its fast kernel
        row(f"tensorpar tp={world}, 1 thread/rank, lean, int8 + bf16", world, 1, job_tp, folder, n, "bfloat16",
            "lean", 1, False, "int8", dtype="bfloat16")
    for b in (4, 16):
        for world in (1, 2):
            row(f"tensorpar tp={world}, lean, batch {b}", world, 1, job_tp, folder, n, "float32", "lean", b, batch=b)
    kept: dict[str, dict] = {}
    for rnd in range(rounds):
        for name, world, threads, fn, args, batch, dtype in specs:
            if rnd > 0 and fn is job_tp and len(args) > 5 and args[5]:
                args = args[:5] + (False,) + args[6:]          # profile in the first round only
            res = pool_run(world, fn, *args)
            r = dict(res[0])
            tokens = [x.pop("tokens") for x in res]
            r.update(config=name, ranks=world, threads=threads, batch=batch, dtype=dtype, tokens=tokens[0])
            procs = world if world > 1 else 1
            r["roofline_tok_s"] = bw[procs] / r["weight_bytes"] * batch
            print(f"round {rnd + 1}: {name:<48} {r['decode_tok_s']:7.1f} tok/s (best step {r['best_step_tok_s']:.1f})",
                  flush=True)
            old = kept.get(name)
            if old is None:
                r["rounds_tok_s"] = [r["decode_tok_s"]]
                kept[name] = r
                continue
            old["rounds_tok_s"].append(r["decode_tok_s"])
            best_step = max(old["best_step_tok_s"], r["best_step_tok_s"])
            if r["decode_tok_s"] > old["decode_tok_s"]:
                for k in ("decode_tok_s", "weight_bytes", "tokens"):
                    old[k] = r[k]
            old["best_step_tok_s"] = best_step
    rows = list(kept.values())
    for r in rows:
        r["roofline_fraction"] = r["decode_tok_s"] / r["roofline_tok_s"]
        r["best_step_roofline_fraction"] = r["best_step_tok_s"] / r["roofline_tok_s"]
    if llama_cpp_available():
        print("llama_cpp imports, but its row is not implemented in this script", flush=True)
    ppl = {}
    for dt in ("float32", "bfloat16"):
        ppl[dt], work, count = perplexity(folder, 1024, dt)
        print(f"perplexity {dt}: {ppl[dt]:.3f} on {count} tokens of {work}", flush=True)
    return {"bandwidth_bytes_per_s": {"1 process": bw[1], "2 processes": bw[2]}, "rows": rows,
            "perplexity": {"work": work, "tokens": count, **ppl}, "load_start": load_start,
            "load_end": os.getloadavg(), "llama_cpp": llama_cpp_available(), "rounds": rounds}


def write(res: dict, out: Path, n: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = res["rows"]
    by = {r["config"]: r for r in rows}
    meta = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "torch": torch.__version__,
            "new_tokens": n, "prompt": PROMPT, "date": time.strftime("%Y-%m-%d %H:%M")}
    res = {"meta": meta, **res}
    tmp = out / "decode.json.tmp"
    tmp.write_text(json.dumps(res, indent=2))
    os.replace(tmp, out / "decode.json")
    bw = res["bandwidth_bytes_per_s"]
    ls, le = res["load_start"], res["load_end"]
    lines = [f"SmolLM2-135M greedy decode, {n} new tokens, prompt {PROMPT!r}; {meta['machine']}, torch "
             f"{meta['torch']}, {meta['date']}. Load average at start {ls[0]:.2f} / {ls[1]:.2f} / {ls[2]:.2f}, "
             f"at end {le[0]:.2f} / {le[1]:.2f} / {le[2]:.2f} (shared machine: 2 cores).", "",
             f"Memory bandwidth (GEMV over a private fp32 matrix, 1 thread per process, best of 30): 1 process "
             f"{bw['1 process'] / 1e9:.2f} GB/s, 2 processes {bw['2 processes'] / 1e9:.2f} GB/s.", "",
             "tokens/s: the mean over the decode steps; best step: the fastest single step (the least disturbed by "
             f"the other processes on the machine), as tokens/s; {res.get('rounds', 1)} round(s) of all rows, "
             "interleaved: per row the round with the highest mean, and the fastest step of all rounds.", "",
             "| configuration | dtype | batch | weight MB/token | tokens/s | best step tokens/s | roofline tokens/s "
             "| fraction of roofline (mean / best step) | vs tp=1 lean (mean / best step) |",
             "|---|---|---|---|---|---|---|---|---|"]
    base = by["tensorpar tp=1, 1 thread, lean"]["decode_tok_s"]
    base_best = by["tensorpar tp=1, 1 thread, lean"]["best_step_tok_s"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['dtype']} | {r['batch']} | {r['weight_bytes'] / 1e6:.0f} | "
                     f"{r['decode_tok_s']:.1f} | {r['best_step_tok_s']:.1f} | {r['roofline_tok_s']:.1f} | "
                     f"{r['roofline_fraction']:.2f} / {r['best_step_roofline_fraction']:.2f} | "
                     f"{r['decode_tok_s'] / base:.2f}x / {r['best_step_tok_s'] / base_best:.2f}x |")
    t2 = by["tensorpar tp=2, 1 thread/rank, lean"]
    hf2 = by["transformers generate, 2 threads"]
    b2 = by["tensorpar tp=2, 1 thread/rank, lean, bf16"]
    same = all(r["tokens"] == rows[0]["tokens"] for r in rows if r["dtype"] == "float32")
    def ratio(a, b):
        return f"{a['decode_tok_s'] / b['decode_tok_s']:.2f}x (best step {a['best_step_tok_s'] / b['best_step_tok_s']:.2f}x)"

    lines += ["", "Targets (issue 13, item 3), this run:", "",
              f"* fp32 tp=2 lean: {t2['roofline_fraction']:.2f} of the two-process roofline (best step "
              f"{t2['best_step_roofline_fraction']:.2f}; target >= 0.50), {ratio(t2, by['tensorpar tp=1, 1 thread, lean'])} "
              f"tp=1 lean (target >= 1.7), {ratio(t2, hf2)} transformers with 2 threads (target >= 2).",
              f"* bf16 tp=2 lean: {ratio(b2, t2)} fp32 tp=2 lean (target >= 1.6).",
              f"* every fp32 batch-1 row's first-row tokens equal transformers': {same}.",
              f"* llama.cpp: {'imports but no row implemented' if res['llama_cpp'] else 'not installed (no row)'}."]
    profiled = [r for r in rows if r.get("profile")]
    if profiled:
        keys = list(profiled[0]["profile"])
        lines += ["", "Where the time goes at tp=2, per token (torch.profiler over a second generate call, rank 0: "
                  "self CPU time of the matmuls (bf16: oneDNN's prepacked linear) and attention kernels, the shared-memory all-reduces with their "
                  "waits for the other rank, the rest is framework: Python and small ops; the profiler adds overhead "
                  "of its own; aten ops counted with their nested calls):", "",
                  "| path | " + " | ".join(f"{k} ms" if k != "aten ops per token" else k for k in keys) + " |",
                  "|---|" + "---|" * len(keys)]
        for r in profiled:
            lines.append(f"| {r['config']} | " + " | ".join(f"{r['profile'][k]:.2f}" if k != "aten ops per token"
                                                            else str(r["profile"][k]) for k in keys) + " |")
    p = res["perplexity"]
    lines += ["", f"Quality cost of bf16: perplexity of the lean path (tp=1) on {p['tokens']} held-out tokens of "
              f"Shakespeare ({p['work']}, the corpus' validation split): fp32 {p['float32']:.3f}, bf16 "
              f"{p['bfloat16']:.3f} ({(p['bfloat16'] / p['float32'] - 1) * 100:+.2f}%)."]
    tmp = out / "decode.md.tmp"
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, out / "decode.md")
    print("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--gemv-mb", type=int, default=256, help="MB of the matrix each process streams")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--rounds", type=int, default=1, help="times every row runs, interleaved (best round kept)")
    p.add_argument("--fixed-cost", action="store_true",
                   help="only the fixed cost per token (issue 28): SmolLM2 fp32 lean tp=1 and tp=2, --before's code "
                        "and this checkout interleaved; writes decode_fixed_cost.{md,json}")
    p.add_argument("--before", default=None,
                   help="the old checkout for --fixed-cost (e.g. a `git worktree add --detach DIR REV`); "
                        "left out: this checkout only")
    p.add_argument("--fixed-cost-worker", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    from tensorpar.hub import resolve_model
    folder = str(resolve_model(a.model))
    if a.fixed_cost_worker:
        print(json.dumps(fixed_cost_worker(folder, a.fixed_cost_worker, a.tokens)))
        return
    if a.fixed_cost:
        write_fixed_cost(run_fixed_cost(folder, a.tokens, a.rounds, a.before), Path(a.out))
        return
    write(run(folder, a.tokens, a.gemv_mb, a.rounds), Path(a.out), a.tokens)


if __name__ == "__main__":
    main()
