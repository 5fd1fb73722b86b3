"""The per-token framework floor of decode (:func:`floor_job`): what
:func:`tensorpar.planner.calibrate.decode_device.measure_decode_constants` turns into ``layer_overhead_us`` (passed
in by ``generate --plan auto``, ``serve --plan auto`` and ``bench/bench_plan_inference.py``).

It lives in the decode room and drives the decoder itself (:class:`~tensorpar.decode.lean.LeanDecoder`, or the
sharded module with its own cache where the family has no lean path), not ``generate_tokens``: the planner's
caller (:mod:`tensorpar.inference_plan`) is imported by ``generate`` and ``serve``, so it may import neither. The
serving engine's per-step bookkeeping (plans, sampling) is therefore not in the floor; it is small next to the
model's per-layer calls (the floor is per layer)."""
from __future__ import annotations

import time


def floor_job(ctx, config: dict, tokens: int = 16) -> dict:
    """Job for :class:`tensorpar.testing.WorkerPool`: the per-token framework floor of decode.

    Greedy decode of ``tokens`` new tokens, batch 1, from a 6-token prompt, of the architecture of ``config`` (a
    Hugging Face config dict; its layers kept) with 8-wide matrices (hidden 72, head_dim 8, MLP 64, vocabulary 256),
    sharded over ``ctx.tp``, one thread: the lean decode path (:class:`~tensorpar.decode.lean.LeanDecoder`), or the
    sharded module's own forward with a KV cache where the family has no lean path. Collectives: the decoder's
    (``1 + 2 x layers`` all-reduces per step at tp > 1) and one all-gather of ``[1, 1]`` per step for the token pick
    (the greedy pick's all-gather of ``[b, 2]`` in the engine). Returns ``{"step_ms"`` (median ms of a decode step),
    ``"prefill_ms"`` (the prompt's forward and pick, warm: the second run's; this thread's CPU time, whatever else
    runs), ``"path"`` (``"lean"`` or
    ``"module"``)``}``."""
    import statistics

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tensorpar import comm
    from tensorpar.decode.prepare import lean_unsupported
    from tensorpar.hf.apply import parallelize
    from tensorpar.hf.plan import make_plan

    torch.set_num_threads(1)
    d = dict(config)
    cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.vocab_size = 72, 64, 8, 256
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = parallelize(AutoModelForCausalLM.from_config(cfg).eval(), make_plan(cfg, ctx.tp.size), ctx.tp)
    ids = torch.tensor([[1, 5, 7, 9, 11, 13]])
    s = ids.shape[1]

    def pick(logits):       # [1, V_r] vocab-sharded -> a token [1, 1], the same on every rank (rank 0's local
        tok = logits.argmax(-1, keepdim=True)   # greedy pick: a valid id; the floor times steps, not tokens)
        return comm.all_gather(tok, ctx.tp, dim=-1)[:, :1].contiguous() if ctx.tp.size > 1 else tok

    times = []
    with torch.no_grad():
        if lean_unsupported(model) is None:
            from tensorpar.decode.lean import LeanDecoder
            path = "lean"
            for _ in range(2):          # the second run is timed (the first warms the kernels and allocator)
                dec = LeanDecoder(model, ctx.tp, max_batch=1, max_len=s + tokens + 1)
                t0 = time.thread_time()          # CPU time: the prefill model is a CPU-time one (planner/prefill.py)
                tok = pick(dec.prefill(ids, torch.ones_like(ids), torch.arange(s).view(1, s)))
                prefill = time.thread_time() - t0
                times = []
                for t in range(s, s + tokens):
                    t0 = time.perf_counter()
                    tok = pick(dec.decode(tok, torch.tensor([[t]]), t))
                    times.append(time.perf_counter() - t0)
        else:
            path = "module"
            for _ in range(2):
                t0 = time.thread_time()
                out = model(ids, use_cache=True)
                past, tok = out.past_key_values, pick(out.logits[:, -1])
                prefill = time.thread_time() - t0
                times = []
                for _t in range(tokens):
                    t0 = time.perf_counter()
                    out = model(tok, past_key_values=past, use_cache=True)
                    past, tok = out.past_key_values, pick(out.logits[:, -1])
                    times.append(time.perf_counter() - t0)
    return {"step_ms": statistics.median(times) * 1e3, "prefill_ms": prefill * 1e3, "path": path}
