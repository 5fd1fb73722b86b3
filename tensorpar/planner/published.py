"""Published measurements of Megatron-LM training runs that the planner is checked against, each with
its source (paper, table, row). Used by :mod:`tensorpar.planner.accuracy` and
``tests/planner/test_planner_accuracy.py``; the values are copied from the papers, not fitted.

* Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
  (arXiv 2205.05198). Table 3: the models and layouts (tp 8; s = 2048, V = 51200; no data parallelism;
  the interleaved schedule with 3 chunks per stage for 175B and 530B, section 6). Table 4: one layer of
  the 22B model, forward and backward milliseconds. Table 5: iteration seconds with full recomputation
  (no sequence parallelism) and with "present work" (selective recomputation + sequence parallelism).
  Section 6.3: the 530B model at 8-way data parallelism (2240 GPUs, batch x 8) takes 39.15 s.
* Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM" (arXiv 2104.04473). Table 2: PTD-P (model-parallel size 96 = tp 8 x pp 12 for 175B,
  280 = tp 8 x pp 35 for 530B, micro-batch 1, the default 1F1B schedule) and ZeRO-3 without model
  parallelism; achieved teraFLOP/s per GPU, counted with eq. 3 (which includes full recomputation).

* Held out (:data:`HELD_OUT`): Narayanan et al. 2021, Table 1 (the weak-scaling runs, also the Megatron-LM
  README's throughput table of April 2021): ten GPT models of 1.7B to 1008B parameters (heads, hidden size,
  layers, tp, pp, GPUs and batch as published; s = 2048, V = 51200), achieved teraFLOP/s per GPU by eq. 3. The
  table does not give the micro-batch size or the schedule: these rows assume micro-batch 1 and the default
  1F1B schedule (what Table 2's PTD-P rows state for the 175B and 530B models), full recomputation (eq. 3
  counts it) and no sequence parallelism (it came in 2022). None of the planner's constants was set on them.

Hardware of both: DGX A100 80GB nodes (8 GPUs, NVLink/NVSwitch, eight 200 Gb/s HDR InfiniBand NICs).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from tensorpar.planner.model_spec import ModelSpec, preset

KORTHIKANTI = "Korthikanti et al. 2022 (arXiv 2205.05198)"
NARAYANAN = "Narayanan et al. 2021 (arXiv 2104.04473)"


# Narayanan et al. 2021 (arXiv 2104.04473), Table 1: (parameters in billions, attention heads, hidden size,
# layers, tensor-parallel size, pipeline-parallel size, GPUs, batch size, achieved teraFLOP/s per GPU).
_TABLE1 = ((1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
           (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
           (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
           (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
           (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163))


def table1_model(billions: float, heads: int, hidden: int, layers: int) -> ModelSpec:
    """A GPT of Narayanan et al. 2021, Table 1: the gpt3-175b preset's architecture (Megatron kernels, GeLU MLP
    of 4h, LayerNorm, biases, learned positions, tied embeddings, V = 51200) at that size."""
    return replace(preset("gpt3-175b"), name=f"gpt-{billions:g}b", num_layers=layers, hidden_size=hidden,
                   num_heads=heads, num_kv_heads=heads, ffn_hidden_size=4 * hidden, head_dim=hidden // heads)


# Korthikanti et al. 2022, Table 3 (Narayanan et al. 2021 Table 1 gives the same shapes for 175B and 530B):
# the presets of tensorpar.planner.model_spec, so that `tensorpar plan --model gpt-1t ... --evaluate ...`
# reproduces a row; then the held-out Table 1 models.
MODELS = {"22B": preset("gpt-22b"), "175B": preset("gpt3-175b"), "530B": preset("gpt-530b"), "1T": preset("gpt-1t"),
          **{f"{b:g}B": table1_model(b, a, h, l) for b, a, h, l, *_ in _TABLE1}}


@dataclass(frozen=True)
class Run:
    """One published number. ``metric``: "layer_ms" (forward + backward of one layer, milliseconds),
    "iteration_s" (seconds per step) or "tflops_per_gpu" (eq. 3 FLOPs per second per GPU, 1e12).
    ``layout``: the fields of :class:`tensorpar.planner.layout.Layout`; ``scheme``: "ptd-p" (tp/pp/dp as
    Megatron runs them) or "zero-3" (data parallelism with sharded parameters, no model parallelism)."""

    source: str
    table: str
    row: str
    model: str
    gpus: int
    global_batch: int
    layout: dict
    metric: str
    value: float
    scheme: str = "ptd-p"
    detail: dict = field(default_factory=dict)


def _k_layout(tp, pp, dp, mb, sp, rc, v=1):
    return dict(tp=tp, pp=pp, dp=dp, micro_batch=mb, sequence_parallel=sp, recompute=rc, virtual_stages=v)


_T4 = dict(source=KORTHIKANTI, table="Table 4", model="22B", gpus=8, global_batch=4, metric="layer_ms")
_T5 = dict(source=KORTHIKANTI, table="Table 5", metric="iteration_s")
_T3 = {"22B": (8, 1, 4, 4, 1), "175B": (64, 8, 64, 1, 3), "530B": (280, 35, 280, 1, 3), "1T": (512, 64, 512, 1, 1)}


def _t5(model: str, full: bool, value: float) -> Run:
    gpus, pp, batch, mb, v = _T3[model]
    layout = _k_layout(8, pp, 1, mb, not full, "full" if full else "selective", v)
    return Run(**_T5, row=f"{model}, {'full recompute' if full else 'present work'}", model=model, gpus=gpus,
               global_batch=batch, layout=layout, value=value)


def _t2(scheme: str, model: str, batch: int, gpus: int, mb: int, tflops: float) -> Run:
    if scheme == "ptd-p":
        pp = 12 if model == "175B" else 35
        layout = _k_layout(8, pp, gpus // (8 * pp), mb, False, "full")
        label = f"PTD-P {model}, {gpus} GPUs"
    else:
        layout = _k_layout(1, 1, gpus, mb, False, "full")
        label = f"ZeRO-3 {model}, {gpus} GPUs"
    return Run(source=NARAYANAN, table="Table 2", row=label, model=model, gpus=gpus, global_batch=batch,
               layout=layout, metric="tflops_per_gpu", value=tflops, scheme=scheme)


RUNS: tuple[Run, ...] = (
    # Korthikanti Table 4: forward, backward (ms), combined is the published value compared.
    Run(**_T4, row="baseline no recompute", layout=_k_layout(8, 1, 1, 4, False, "none"), value=19.6,
        detail={"forward": 7.7, "backward": 11.9}),
    Run(**_T4, row="sequence parallelism", layout=_k_layout(8, 1, 1, 4, True, "none"), value=19.0,
        detail={"forward": 7.2, "backward": 11.8}),
    Run(**_T4, row="baseline with recompute", layout=_k_layout(8, 1, 1, 4, False, "full"), value=27.2,
        detail={"forward": 7.7, "backward": 19.5}),
    Run(**_T4, row="selective recompute", layout=_k_layout(8, 1, 1, 4, False, "selective"), value=20.9,
        detail={"forward": 7.7, "backward": 13.2}),
    Run(**_T4, row="selective + sequence", layout=_k_layout(8, 1, 1, 4, True, "selective"), value=20.3,
        detail={"forward": 7.2, "backward": 13.1}),
    # Korthikanti Table 5.
    _t5("22B", True, 1.42), _t5("22B", False, 1.10),
    _t5("175B", True, 18.13), _t5("175B", False, 13.75),
    _t5("530B", True, 49.05), _t5("530B", False, 37.83),
    _t5("1T", True, 94.42), _t5("1T", False, 71.49),
    # Korthikanti section 6.3: 530B present work at 8-way data parallelism, batch 280 x 8.
    Run(source=KORTHIKANTI, table="Section 6.3", row="530B, present work, dp 8", model="530B", gpus=2240,
        global_batch=2240, layout=_k_layout(8, 35, 8, 1, True, "selective", 3), metric="iteration_s", value=39.15),
    # Narayanan Table 2.
    _t2("zero-3", "175B", 1536, 384, 4, 144), _t2("zero-3", "175B", 1536, 768, 2, 88),
    _t2("zero-3", "175B", 1536, 1536, 1, 44),
    _t2("zero-3", "530B", 2560, 640, 4, 138), _t2("zero-3", "530B", 2240, 1120, 2, 98),
    _t2("zero-3", "530B", 2240, 2240, 1, 48),
    _t2("ptd-p", "175B", 1536, 384, 1, 153), _t2("ptd-p", "175B", 1536, 768, 1, 149),
    _t2("ptd-p", "175B", 1536, 1536, 1, 141),
    _t2("ptd-p", "530B", 2240, 560, 1, 171), _t2("ptd-p", "530B", 2240, 1120, 1, 167),
    _t2("ptd-p", "530B", 2240, 2240, 1, 159),
)


HELD_OUT: tuple[Run, ...] = tuple(
    Run(source=NARAYANAN, table="Table 1", row=f"{b:g}B, {n} GPUs (t {t}, p {p})", model=f"{b:g}B", gpus=n,
        global_batch=batch, layout=_k_layout(t, p, n // (t * p), 1, False, "full"), metric="tflops_per_gpu",
        value=tflops)
    for b, _a, _h, _l, t, p, n, batch, tflops in _TABLE1)
"""The held-out split: rows no constant of the planner was fitted or tuned on (see docs/planner.md, Accuracy)."""
