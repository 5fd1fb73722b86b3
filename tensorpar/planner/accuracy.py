"""The planner's predictions for the published runs of :mod:`tensorpar.planner.published`, with the error
of each row: the table that ``tests/test_planner_accuracy.py`` prints and checks, and
``docs/planner.md`` shows.

Every run is costed with the same device (``a100-80gb`` preset, 8 per node) and the same assumptions
(:data:`ASSUMPTIONS`); nothing is set per row. ZeRO-3 rows use :func:`zero3_step_seconds`.
"""
from __future__ import annotations

from dataclasses import dataclass

from tensorpar.planner.cluster import ClusterSpec, device_preset
from tensorpar.planner.cost import layer_times, optimizer_seconds, step_cost
from tensorpar.planner.flops import logit_forward_flops, narayanan_eq3
from tensorpar.planner.layout import Assumptions, Layout, Workload, problems
from tensorpar.planner.memory import GIB, layer_activation_terms, memory_per_device
from tensorpar.planner.model_spec import ModelSpec
from tensorpar.planner.partition import RankHeads
from tensorpar.planner.published import MODELS, RUNS, Run

SEQ = 2048
DEVICE = "a100-80gb"
# Both papers: Megatron kernels with eager (unfused) attention, bf16/fp16 activations and weights, fp32 main
# gradients (Megatron's default for bf16), no overlap of the data-parallel reduction (Korthikanti section 6.3).
ASSUMPTIONS = Assumptions(attention="eager", grad_bytes=4, reserve_gib=0.0)


@dataclass(frozen=True)
class Row:
    run: Run
    predicted: float

    @property
    def error(self) -> float:
        """Signed relative error of the prediction, (predicted - published) / published."""
        return (self.predicted - self.run.value) / self.run.value


def cluster_for(gpus: int) -> ClusterSpec:
    return ClusterSpec(device_preset(DEVICE), num_devices=gpus, devices_per_node=8)


def zero3_step_seconds(model: ModelSpec, gpus: int, global_batch: int, micro_batch: int,
                       assume: Assumptions = ASSUMPTIONS) -> float:
    """One step of ZeRO-3 (Rajbhandari et al. 2020) without model parallelism, with full recomputation.

    Per micro-batch every rank all-gathers each layer's parameters for the forward pass and again for the
    backward pass (which re-runs the forward), and reduce-scatters the gradients: ``3 x P x 2`` bytes,
    ``(N-1)/N`` of it on the wire, over the inter-node links. DeepSpeed prefetches the next layer's
    parameters while the current one computes, so a micro-batch takes ``max(compute, communication)``.
    The optimizer updates ``P/N`` parameters per rank.
    """
    cluster = cluster_for(gpus)
    layout = Layout(tp=1, pp=1, dp=gpus, micro_batch=micro_batch, recompute="full")
    work = Workload(global_batch, SEQ)
    layer = layer_times(model, layout, cluster, work, assume)
    rate = cluster.device.peak_tflops * 1e12 * assume.matmul_efficiency(cluster.device)
    compute = model.num_layers * layer.compute + 3 * logit_forward_flops(model, model.vocab_size,
                                                                          micro_batch * SEQ) / rate
    bandwidth, latency = cluster.link(gpus)
    params = model.total_params()
    comm = 3 * (params * assume.param_bytes * (gpus - 1) / gpus / bandwidth + model.num_layers * latency)
    m = layout.num_micro_batches(global_batch)
    return m * max(compute, comm) + optimizer_seconds(params / gpus, layout, cluster, assume)


def predict(run: Run) -> float:
    model = MODELS[run.model]
    layout = Layout(**run.layout)
    work = Workload(run.global_batch, SEQ)
    if run.scheme == "zero-3":
        step = zero3_step_seconds(model, run.gpus, run.global_batch, layout.micro_batch)
    else:
        cluster = cluster_for(run.gpus)
        broken = problems(layout, model, cluster, work, ASSUMPTIONS)
        if broken:
            raise ValueError(f"{run.table} {run.row}: {broken[0].message}")
        if run.metric == "layer_ms":
            return 1e3 * layer_times(model, layout, cluster, work, ASSUMPTIONS).total
        step = step_cost(model, layout, cluster, work, ASSUMPTIONS).step.total
    if run.metric == "iteration_s":
        return step
    if run.metric == "tflops_per_gpu":
        flops = narayanan_eq3(run.global_batch, SEQ, model.num_layers, model.hidden_size, model.vocab_size)
        return flops / step / run.gpus / 1e12
    raise ValueError(f"unknown metric {run.metric!r}")


def rows(runs=RUNS) -> list[Row]:
    return [Row(run, predict(run)) for run in runs]


def summary(table: list[Row]) -> dict:
    errors = [abs(r.error) for r in table]
    return {"rows": len(errors), "mean_abs_error": sum(errors) / len(errors), "max_abs_error": max(errors)}


def korthikanti_eq_activation_bytes(model: ModelSpec, layout: Layout, global_batch: int) -> float:
    """First-stage activation memory of the transformer layers by the paper's formulas (Korthikanti et al.
    2022, Table 2 per layer, times L for the p micro-batches in flight (section 4.2.3) and
    ``(1 + (p-1)/(pv))`` with interleaving (section 5, after eq. 6))."""
    s, b, h, a, t = SEQ, layout.micro_batch, model.hidden_size, model.num_heads, layout.tp
    sbh = s * b * h
    if layout.recompute == "full":
        per_layer = 2 * sbh / (t if layout.sequence_parallel else 1)
    elif layout.sequence_parallel:
        per_layer = sbh * (34 / t + (0 if layout.recompute == "selective" else 5 * a * s / (h * t)))
    else:
        per_layer = sbh * (10 + 24 / t + (0 if layout.recompute == "selective" else 5 * a * s / (h * t)))
    p, v = layout.pp, layout.virtual_stages
    m = layout.num_micro_batches(global_batch)
    layers = model.num_layers if m >= p else model.num_layers * m / p
    return per_layer * layers * (1 + (p - 1) / (p * v) if v > 1 else 1)


def memory_rows(runs=RUNS) -> list[tuple[Run, float, float]]:
    """(run, planner's first-stage layer activations, the paper's formula), bytes, for the Table 5 runs."""
    out = []
    for run in runs:
        if run.table != "Table 5":
            continue
        model, layout = MODELS[run.model], Layout(**run.layout)
        mem = memory_per_device(model, layout, Workload(run.global_batch, SEQ), ASSUMPTIONS)
        names = layer_activation_terms(model, RankHeads(model.num_heads // layout.tp, model.num_heads // layout.tp),
                                       micro_batch=layout.micro_batch, seq_len=SEQ, tp=layout.tp,
                                       sequence_parallel=layout.sequence_parallel, recompute=layout.recompute,
                                       assume=ASSUMPTIONS)
        planner = sum(v for k, v in mem.activation_terms.items() if k in names)
        out.append((run, planner, korthikanti_eq_activation_bytes(model, layout, run.global_batch)))
    return out


def format_table(table: list[Row]) -> str:
    lines = [f"{'source':<10} {'table':<12} {'row':<34} {'metric':<15} {'published':>10} {'predicted':>10} {'error':>8}"]
    for r in table:
        src = "Korthikanti" if r.run.source.startswith("Korthikanti") else "Narayanan"
        lines.append(f"{src:<10} {r.run.table:<12} {r.run.row:<34} {r.run.metric:<15} {r.run.value:>10.2f} "
                     f"{r.predicted:>10.2f} {100 * r.error:>+7.1f}%")
    s = summary(table)
    lines.append(f"mean |error| {100 * s['mean_abs_error']:.1f}% over {s['rows']} rows, worst {100 * s['max_abs_error']:.1f}%")
    return "\n".join(lines)


def format_memory(mem_rows) -> str:
    lines = [f"{'row':<34} {'planner GiB':>12} {'formula GiB':>12} {'error':>8}"]
    for run, planner, formula in mem_rows:
        lines.append(f"{run.row:<34} {planner / GIB:>12.2f} {formula / GIB:>12.2f} {100 * (planner - formula) / formula:>+7.1f}%")
    return "\n".join(lines)
