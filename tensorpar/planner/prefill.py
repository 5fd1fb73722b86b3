"""Time to first token (:func:`prefill_seconds`): what ``tensorpar generate`` times as its first token, one forward
of the prompt through the busiest rank's shard and the greedy pick of the first token.

``generate`` (:func:`tensorpar.generate.generate_tokens`) starts the clock once every rank has built its engine
(the model loaded, the tokenizer run before the ranks start: neither is in it) and stops it when the first token is
known on every rank: the prompt's ``T = B x P`` tokens (the batch padded to the longest prompt) run as one forward
(:meth:`tensorpar.decode.lean.LeanDecoder.forward_segments`: per layer the fused QKV, the rotary tables, attention
over the prompt, the output projection, the MLP, two all-reduces of ``[T, h]``; the embedding's all-reduce; the LM
head on each row's last position), then the token pick (all-gather and broadcast). So, per rank (every stage's
layers one after another at ``pp`` > 1):

* with measured prefill constants (a CPU rank, :mod:`tensorpar.planner.calibrate.prefill`): the layers' matmuls
  ``layers x (W_layer / prefill_read_gbps + F_layer(T) / prefill_tflops)``: a matmul of ``T`` rows reads its
  weights once and then computes at the GEMM rate, both fitted at the model's own shapes; the prompt's attention
  ``layers x 4 T P q d / prefill_attention_tflops`` (every key of the ``P`` cached positions: the CPU kernel with a
  mask does not skip the causal half); the LM head on ``B`` rows at the same matmul rates; ``layers x
  prefill_layer_overhead_us`` (the prefill forward's Python and framework calls);
* without them (the presets, a GPU): the compute-bound lower bound ``max(F / (matmul_efficiency x peak), W /
  hbm_gbps)`` plus ``layers x layer_overhead_us``;
* plus the tp collectives: ``2 x layers + 1`` all-reduces of ``T x h`` and the token pick over the tp link, and at
  ``pp`` > 1 the ``pp - 1`` sends of the ``T x h`` residual stream
  (:func:`tensorpar.planner.inference._pipeline_seconds`).

Returns the parts (seconds) so that the plan can say what the first token is made of.
"""
from __future__ import annotations

from tensorpar.planner.cluster import ClusterSpec
from tensorpar.planner.flops import layer_forward_flops, logit_forward_flops
from tensorpar.planner.model_spec import ModelSpec
from tensorpar.planner.partition import busiest_heads, max_ffn_columns, max_vocab_rows


def layer_matrix_params(model: ModelSpec, tp: int) -> tuple[float, float]:
    """``(params of one layer's matmul weights, params of the LM head's vocabulary shard)`` on the busiest rank at
    ``tp``: the matrices :func:`tensorpar.planner.inference.decode_matrices` lists (norms and embedding left out)."""
    from tensorpar.planner.inference import decode_matrices

    layer, head = decode_matrices(model, tp)
    return float(sum(o * i for o, i in layer)), float(head[0] * head[1])


def matmul_seconds(weights_bytes: float, flops: float, device) -> float:
    """One rank's matmuls that read ``weights_bytes`` of weights once and do ``flops``, at the device's measured
    prefill rates (``weights / prefill_read_gbps + flops / prefill_tflops``; a rate of 0 prices its part at 0)."""
    read = weights_bytes / (device.prefill_read_gbps * 1e9) if device.prefill_read_gbps > 0 else 0.0
    return read + (flops / (device.prefill_tflops * 1e12) if device.prefill_tflops > 0 else 0.0)


def prefill_seconds(model: ModelSpec, tp: int, cluster: ClusterSpec, batch: int, prompt: int, nbytes: int,
                    tp_comm: str = "fp32", pp: int = 1) -> dict[str, float]:
    """The first token's time on the busiest rank (module docstring), in parts: ``{"matmul", "attention",
    "overhead", "tp_comm", "pp_comm", "total"}`` (seconds; ``matmul`` holds the LM head, and without measured
    prefill constants also the attention: the lower bound prices them together). ``nbytes``: bytes per weight and
    per element sent."""
    from tensorpar.planner.inference import (_all_reduce_seconds, _pipeline_seconds, pick_seconds,
                                             weight_params_per_rank)

    dev = cluster.device
    heads = busiest_heads(model.num_heads, model.num_kv_heads, tp)
    ffn = max_ffn_columns(model.ffn_hidden_size, tp)
    tokens, vocab_rows = batch * prompt, max_vocab_rows(model.vocab_size, tp)
    layer = layer_forward_flops(model, heads, ffn, tokens, prompt)
    head_flops = logit_forward_flops(model, vocab_rows, batch)
    if dev.prefill_tflops > 0:
        layer_w, head_w = layer_matrix_params(model, tp)
        matmul = (model.num_layers * matmul_seconds(layer_w * nbytes, layer["linear"], dev)
                  + matmul_seconds(head_w * nbytes, head_flops, dev))
        attention = (model.num_layers * layer["attention"] / (dev.prefill_attention_tflops * 1e12)
                     if dev.prefill_attention_tflops > 0 else 0.0)
        overhead = model.num_layers * dev.prefill_layer_overhead_us * 1e-6
    else:
        flops = model.num_layers * (layer["linear"] + layer["attention"]) + head_flops
        matmul = max(flops / (dev.peak_tflops * 1e12 * dev.matmul_efficiency),
                     weight_params_per_rank(model, tp) * nbytes / (dev.hbm_gbps * 1e9))
        attention, overhead = 0.0, model.num_layers * dev.layer_overhead_us * 1e-6
    # the layers' and the embedding's all-reduces, the token pick (all-gather and broadcast)
    comm = ((2 * model.num_layers + 1) * _all_reduce_seconds(tokens * model.hidden_size, nbytes, tp, cluster, tp_comm)
            + pick_seconds(tp, batch, cluster))
    pipe = _pipeline_seconds(tokens, batch, model.hidden_size, nbytes, tp, pp, cluster)
    return {"matmul": matmul, "attention": attention, "overhead": overhead, "tp_comm": comm, "pp_comm": pipe,
            "total": matmul + attention + overhead + comm + pipe}
