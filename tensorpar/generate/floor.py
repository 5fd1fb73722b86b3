"""The per-token framework floor of decode (:func:`floor_job`): what
:func:`tensorpar.planner.calibrate.decode_device.measure_decode_constants` turns into ``layer_overhead_us`` (passed
in by ``generate --plan auto`` and ``bench/bench_plan_inference.py``: the planner does not import generate)."""
from __future__ import annotations


def floor_job(ctx, config: dict, tokens: int = 16) -> dict:
    """Job for :class:`tensorpar.testing.WorkerPool`: the per-token framework floor of decode.

    Greedy decode of ``tokens`` new tokens, batch 1, from a 6-token prompt, of the architecture of ``config`` (a
    Hugging Face config dict; its layers kept) with 8-wide matrices (hidden 72, head_dim 8, MLP 64, vocabulary 256),
    sharded over ``ctx.tp`` (tp = 1 for the constant), one thread, on the lean path (``generate_tokens``' generic
    path where the family has no lean one). Returns ``{"step_ms", "path"}``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tensorpar.generate import SamplingConfig, generate_tokens
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
    for path in ("lean", "auto"):
        try:
            generate_tokens(model, ctx.tp, ids, sampling=SamplingConfig(max_new_tokens=2), path=path)
        except ValueError:   # no lean path for this family: the generic one
            continue
        res = generate_tokens(model, ctx.tp, ids, sampling=SamplingConfig(max_new_tokens=tokens), path=path)
        return {"step_ms": 1e3 / res.decode_tokens_per_s, "path": path}
    raise ValueError("no decode path runs this model")
