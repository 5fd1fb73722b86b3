"""The prefill rates of one rank at a model's shapes (:func:`measure_prefill`): what the time to first token's
matmuls and attention cost per weight byte, per FLOP (:mod:`tensorpar.planner.prefill`). Run by
:func:`tensorpar.planner.calibrate.decode_device.measure_decode_constants` next to the decode constants (the same
cache).

Timed by the thread's CPU time (``time.thread_time``), one thread: the rate of the thread alone on a core, whatever
else runs (prefill is compute; the planner gives a rank ``threads_per_rank`` times it, as it does its matmul peak).
"""
from __future__ import annotations

import math
import time

#: the prompt lengths (matmul rows) of the fit: a short prompt (the weights' read shows) and a long one (the FLOPs)
PREFILL_TOKENS = (16, 256)


def _pass_seconds(fn, passes: int) -> float:
    """Median thread-CPU seconds of ``fn()`` over ``passes`` calls after one warm-up call."""
    import statistics

    fn()
    times = []
    for _ in range(passes):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return statistics.median(times)


def _time_prefill(ctx, layer_shapes: tuple, layers: int, attention: tuple, tokens: tuple = PREFILL_TOKENS,
                  passes: int = 3) -> dict:
    """Job for :class:`tensorpar.testing.WorkerPool` (one rank): a prefill's matmuls and attention at given shapes,
    without the model.

    Allocates ``layers`` x ``layer_shapes`` fp32 matrices (``(out, in)``, the lean path's per-layer matmuls:
    :func:`tensorpar.planner.inference.decode_matrices`) and times ``torch.mm(x [T, in], W.t())`` over them (as
    the lean path runs a prefill's matmuls) at each ``T`` of ``tokens``: every layer at the first (its weights
    come from memory, as in a model's forward), at the others as many layers as give about the first's FLOPs (at
    least 2; there the FLOPs dominate). Then the prompt's attention at the last ``T``: ``attention`` = ``(q heads,
    head_dim)``, one ``scaled_dot_product_attention`` of ``[1, q, T, d]`` queries, keys and values with a ``[1, 1,
    T, T]`` boolean causal mask (the engine's prefill: a mask, the key heads copied per query head).

    Returns ``{"tokens", "layer_s" (thread-CPU seconds of one layer's matmuls at each T), "layer_bytes",
    "layer_flops_per_token", "attention_s", "attention_flops"}``. No collectives.
    """
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    mats = [[torch.full((o, i), 0.01) for o, i in layer_shapes] for _ in range(layers)]
    per_layer = sum(o * i for o, i in layer_shapes)
    layer_s = []
    with torch.no_grad():
        for t in tokens:
            n = layers if t == tokens[0] else max(2, min(layers, -(-layers * tokens[0] // t)))
            xs = {i: torch.full((t, i), 0.5) for _, i in layer_shapes}

            def run(n=n, xs=xs):
                for ws in mats[:n]:
                    for w in ws:
                        torch.mm(xs[w.shape[1]], w.t())
            layer_s.append(_pass_seconds(run, passes) / n)
        q_heads, d = attention
        t = tokens[-1]
        q, k, v = (torch.randn(1, q_heads, t, d) for _ in range(3))
        mask = torch.ones(t, t, dtype=torch.bool).tril().view(1, 1, t, t)
        attn_s = _pass_seconds(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), passes)
    return {"tokens": list(tokens), "layer_s": layer_s, "layer_bytes": 4 * per_layer,
            "layer_flops_per_token": 2 * per_layer, "attention_s": attn_s, "attention_flops": 4 * t * t * q_heads * d}


def fit_prefill(sample: dict) -> dict:
    """``{"prefill_read_gbps", "prefill_tflops", "prefill_attention_tflops"}`` (one thread) from
    :func:`_time_prefill`'s sample: the line ``layer_s(T) = layer_bytes / read + T x layer_flops_per_token / rate``
    through the first and last token counts; the attention's FLOPs over its seconds.

    A read part at or below 0, or one so small that the read rate comes out above its plausible range
    (:data:`~tensorpar.planner.plausible.PLAUSIBLE_DEVICE`, the range a device file is read back with), is noise
    where the FLOPs dominate: the read rate is left 0 (not priced). Raises RuntimeError where the seconds do not
    grow with the tokens, or grow so little that a FLOP rate or the attention's comes out above its plausible range
    (no rate to fit: a file with it could not be read back)."""
    from tensorpar.planner.plausible import PLAUSIBLE_DEVICE
    (t0, t1), (s0, s1) = (sample["tokens"][0], sample["tokens"][-1]), (sample["layer_s"][0], sample["layer_s"][-1])
    slope = (s1 - s0) / (t1 - t0)
    tflops = sample["layer_flops_per_token"] / slope / 1e12 if slope > 0 else math.inf
    attention = sample["attention_flops"] / max(sample["attention_s"], 1e-12) / 1e12
    for name, v in (("matmuls", tflops), ("attention", attention)):
        if not v <= PLAUSIBLE_DEVICE["prefill_tflops"][2]:
            raise RuntimeError(f"prefill calibration: a layer's matmuls took {s0 * 1e3:.4g} ms at {t0} tokens and "
                               f"{s1 * 1e3:.4g} ms at {t1}, its attention {sample['attention_s'] * 1e3:.4g} ms: "
                               f"no rate to fit for the {name}")
    fixed = s0 - slope * t0
    read = sample["layer_bytes"] / fixed / 1e9 if fixed > 0 else 0.0
    return {"prefill_read_gbps": read if read <= PLAUSIBLE_DEVICE["prefill_read_gbps"][2] else 0.0,
            "prefill_tflops": tflops, "prefill_attention_tflops": attention}


def measure_prefill(pool, layer_shapes, layers: int, attention: tuple) -> dict:
    """:func:`fit_prefill` of :func:`_time_prefill` run on ``pool`` (a one-rank
    :class:`~tensorpar.testing.WorkerPool`), with the sample under ``"prefill_sample"``. Raises RuntimeError
    (:func:`fit_prefill`; the pool's RankFailure is the caller's)."""
    sample = pool.run(_time_prefill, tuple(map(tuple, layer_shapes)), layers, tuple(attention))[0]
    return dict(fit_prefill(sample), prefill_sample=sample)
