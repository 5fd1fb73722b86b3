"""Training-step benchmark: tensorpar at tp = 1 (1 and 2 threads) and tp = 2 (with and without sequence
parallelism), and PyTorch's own ``parallelize_module`` (ColwiseParallel / RowwiseParallel, loss_parallel)
on the same transformers Llama, in the same run.

    python bench/bench_train.py            # writes bench/results/train.json and bench/results/train.md

Measured per variant, in ``--rounds`` interleaved rounds: the wall time of a full training step (forward,
vocab-parallel loss, backward, gradient completion, clipping, AdamW), best and median over all timed
steps (the best is the least disturbed by other processes); tokens/s from the best; activation
memory per rank: the bytes autograd keeps for backward during one forward (every saved tensor's storage
counted once, parameters excluded), measured with ``torch.autograd.graph.saved_tensors_hooks``, beside the
planner's prediction for the same shapes (``tensorpar.planner.memory``); and, for tensorpar at tp = 2, the
exposed communication per step: the seconds the rank's main thread spends blocked in collectives
(``CommCounter.exposed_seconds``), with the column-parallel backward overlapping its input-gradient
collective with the weight gradients (the default) and with it synchronous ("sync backward").
bf16 rows run the same step under bf16 autocast (fp32 weights and optimizer).

tp = 2 runs two ranks with one thread each on this host, so "tp = 2" and "tp = 1 with 2 threads" use the same
two cores. Each tp = 2 row names the transport of the tp group's collectives: "gloo" (torch.distributed over
loopback TCP; the asynchronous collectives overlap with the weight gradients) or "shm" (tensorpar.shm's
shared-memory collectives, what ``tensorpar train`` uses by default when the tp ranks share a host; they run
synchronously). Numbers from a shared machine are noisy: the load average at start is recorded.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tensorpar.parallel import ParallelContext  # noqa: E402
from tensorpar.testing import WorkerPool  # noqa: E402
from tensorpar.train.config import TrainConfig  # noqa: E402
from tensorpar.hf.presets import PRESETS
from tensorpar.train.data import TrainData  # noqa: E402


def _data(vocab: int) -> TrainData:
    g = torch.Generator().manual_seed(0)
    return TrainData.from_tokens(torch.randint(0, vocab, (400_000,), generator=g), vocab, val_fraction=0.05)


class SavedBytes:
    """Sum of the storages autograd saves for backward (each storage once), parameters excluded."""

    def __init__(self, params):
        self.skip = {self._key(p)[0] for p in params}
        self.seen: dict = {}

    @staticmethod
    def _key(t):
        from torch.distributed.tensor import DTensor
        t = t._local_tensor if isinstance(t, DTensor) else t
        while type(t) is not torch.Tensor and hasattr(t, "elem"):  # functional-collective wrapper tensors
            t = t.elem
        try:
            s = t.untyped_storage()
            return s.data_ptr(), s.nbytes()
        except RuntimeError:  # a wrapper subclass without real storage: count its own bytes
            return ("id", id(t)), t.numel() * t.element_size()

    def pack(self, t):
        key, nbytes = self._key(t)
        if key not in self.skip and t.device.type != "meta":
            self.seen[key] = nbytes
        return t

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def _time_steps(step_fn, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        step_fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step_fn()
        times.append(time.perf_counter() - t0)
    return times


def _with_kwargs(ctx, fn, args: tuple, kwargs: dict):
    """Run ``fn(ctx, *args, **kwargs)`` on a rank (WorkerPool passes positional arguments only)."""
    return fn(ctx, *args, **kwargs)


def job_tensorpar(ctx, cfg: TrainConfig, warmup: int, steps: int, overlap: bool = True,
                  shm_thread: bool = False) -> dict:
    """tensorpar's trainer; every rank returns its step times, activation bytes and exposed communication
    (seconds blocked in collectives) of each of ``steps`` extra steps run with the counter on. The tp group's
    collectives use shared memory when ``cfg.fast_collectives`` is "on" (installed here, removed at the end, as
    ``tensorpar train`` does at start-up), else gloo. ``shm_thread`` (experiment): the column-parallel backward's
    asynchronous collectives run the shared-memory collective on one helper thread (issue order kept), so they
    overlap with the weight gradients as gloo's do; the library runs them synchronously."""
    from tensorpar.shm import disable_fast_collectives
    from tensorpar.train.cli import enable_tp_fast_collectives

    if ctx.tp.size > 1:
        enable_tp_fast_collectives(cfg, ctx, 120.0)
    undo = _shm_on_helper_thread(ctx.tp) if shm_thread else None
    try:
        return _tensorpar_steps(ctx, cfg, warmup, steps, overlap)
    finally:
        if undo is not None:
            undo()
        disable_fast_collectives(ctx.tp)


def _shm_on_helper_thread(group):
    """Route ``comm.{all_reduce,all_gather,reduce_scatter}_async`` on ``group.fast`` to one helper thread (a
    single-worker executor: the collectives run in issue order, one at a time, as ShmCommunicator needs; the
    column-parallel backward issues no synchronous collective while one is pending). Returns the undo."""
    from concurrent.futures import ThreadPoolExecutor

    from tensorpar import comm
    from tensorpar.shard import Partition

    ex = ThreadPoolExecutor(1, thread_name_prefix="shm-async")
    orig = {k: getattr(comm, k) for k in ("all_reduce_async", "all_gather_async", "reduce_scatter_async")}

    class _Fut:
        def __init__(self, fut):
            self.fut = fut

        def wait(self):
            self.fut.result()

    def pending(kind, g, x, numel, fn, *args):
        g.counter.record(kind, numel, x.element_size(), g.size)
        fut = ex.submit(fn, *args)
        return comm.Pending(kind, g, x, _Fut(fut), fut.result)

    def sizes_of(g, x, dim, sizes):
        return (list(sizes.sizes if isinstance(sizes, Partition) else sizes) if sizes is not None
                else [x.shape[dim % x.dim()]] * g.size)

    def all_reduce_async(x, g):
        if g is not group or g.fast is None or not x.is_cpu:
            return orig["all_reduce_async"](x, g)
        return pending("all_reduce", g, x, x.numel(), g.fast.all_reduce, x)

    def all_gather_async(x, g, dim=-1, sizes=None):
        if g is not group or g.fast is None or not x.is_cpu:
            return orig["all_gather_async"](x, g, dim, sizes)
        s = sizes_of(g, x, dim, sizes)
        return pending("all_gather", g, x, x.numel() // max(x.shape[dim], 1) * sum(s), g.fast.all_gather, x,
                       dim % x.dim(), s)

    def reduce_scatter_async(x, g, dim=-1, sizes=None):
        if g is not group or g.fast is None or not x.is_cpu:
            return orig["reduce_scatter_async"](x, g, dim, sizes)
        s = sizes_of(g, x, dim, sizes) if sizes is not None else [x.shape[dim % x.dim()] // g.size] * g.size
        return pending("reduce_scatter", g, x, x.numel(), g.fast.reduce_scatter, x, dim % x.dim(), s)

    comm.all_reduce_async, comm.all_gather_async = all_reduce_async, all_gather_async
    comm.reduce_scatter_async = reduce_scatter_async

    def undo():
        for k, f in orig.items():
            setattr(comm, k, f)
        ex.shutdown(wait=True)
    return undo


def _tensorpar_steps(ctx, cfg: TrainConfig, warmup: int, steps: int, overlap: bool) -> dict:
    from tensorpar import comm
    from tensorpar.layers.linear import set_grad_comm_overlap
    from tensorpar.train.loop import Trainer
    from tensorpar.train.model import build_model, resolve_source

    data = _data(256)
    model, plan = build_model(cfg, resolve_source(cfg, 256), ctx.tp, 256)
    set_grad_comm_overlap(model, overlap)
    tr = Trainer(cfg, ctx, model, plan, data)
    meter = SavedBytes(tr.params)
    x, y = next(tr.batches)
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda t: t):
        loss = tr.loss(x, y)
    loss.backward()
    tr.optimizer.zero_grad(set_to_none=True)
    times = _time_steps(tr.train_step, warmup, steps)
    exposed = []
    for _ in range(steps if ctx.tp.size > 1 else 0):
        with comm.counting(ctx.tp) as c:
            tr.train_step()
        exposed.append(c.exposed_seconds())
    return {"times": times, "activation_bytes": meter.total, "exposed": exposed}


def job_torch_tp(ctx, cfg: TrainConfig, warmup: int, steps: int) -> dict:
    """The same model and step with torch.distributed.tensor.parallel (DTensor) instead of tensorpar."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                                   parallelize_module)
    from transformers import AutoModelForCausalLM

    from tensorpar.hf.presets import preset_config

    mesh = init_device_mesh("cpu", (ctx.tp.size,), mesh_dim_names=("tp",))
    config = preset_config(cfg.model, 256, cfg.seq_len)
    config._attn_implementation = "sdpa"
    config.use_cache = False
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    block = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
             "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
             "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh, block)
    parallelize_module(model, mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
    model.train()
    # foreach=False: the norms stay plain tensors while the linears hold DTensors, and foreach kernels refuse
    # the mix (as torch.nn.utils.clip_grad_norm_ does; see _clip below)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                            weight_decay=cfg.weight_decay, foreach=False)
    batches = _data(256).train_batches(batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed)

    def loss_of(x, y):
        logits = model(input_ids=x, use_cache=False).logits            # DTensor sharded over the vocabulary
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def step():
        x, y = next(batches)
        with loss_parallel():
            loss = loss_of(x, y)
            loss.backward()
        _clip(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    meter = SavedBytes(list(model.parameters()))
    x, y = next(batches)
    with loss_parallel():
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda t: t):
            loss = loss_of(x, y)
        loss.backward()
    opt.zero_grad(set_to_none=True)
    return {"times": _time_steps(step, warmup, steps), "activation_bytes": meter.total}


def _clip(params, max_norm: float) -> torch.Tensor:
    """Global-norm clipping for a mix of DTensor (sharded) and plain (replicated) gradients.

    ``torch.nn.utils.clip_grad_norm_`` raises on the mix; a DTensor's norm is reduced over its mesh,
    a replicated tensor's is counted once.
    """
    from torch.distributed.tensor import DTensor
    grads = [p.grad for p in params if p.grad is not None]
    sq = torch.zeros(())
    for g in grads:
        n = torch.linalg.vector_norm(g)
        sq = sq + (n.full_tensor() if isinstance(n, DTensor) else n) ** 2
    total = sq.sqrt()
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale)
    return total


def _summary(name: str, runs: list[list[dict]], tokens: int, threads: int, tp: int) -> dict:
    """``runs``: per round, the per-rank results. A step ends when its slowest rank does."""
    times = [max(ts) for per_rank in runs for ts in zip(*[r["times"] for r in per_rank])]
    best, med = min(times), statistics.median(times)
    row = {"variant": name, "tp": tp, "threads_per_rank": threads, "step_s_best": best, "step_s_median": med,
           "step_s_all": times, "tokens_per_s": tokens / best,
           "activation_mib_per_rank": max(r["activation_bytes"] for r in runs[0]) / 2**20}
    # exposed communication of a step: the rank blocked longest in collectives (median over the counted steps)
    per_step = [max(sum(e.values()) for e in es) for per_rank in runs
                for es in zip(*[r.get("exposed", []) for r in per_rank])]
    if per_step:
        row["exposed_comm_s_median"] = statistics.median(per_step)
        row["exposed_comm_s_min"] = min(per_step)
    return row


def planner_activation_mib(preset: str, batch: int, seq: int, tp: int, sequence_parallel: bool) -> float:
    """The planner's activation bytes per rank (fp32, sdpa attention, Hugging Face kernels) for the bench model."""
    from tensorpar.planner.layout import Assumptions, Layout, Workload
    from tensorpar.planner.memory import memory_per_device
    from tensorpar.planner.model_spec import from_dims

    p = PRESETS[preset]
    spec = from_dims(layers=p["num_hidden_layers"], hidden=p["hidden_size"], heads=p["num_attention_heads"],
                     kv_heads=p["num_key_value_heads"], ffn=p["intermediate_size"], vocab=256,
                     tied_embeddings=p["tie_word_embeddings"])
    m = memory_per_device(spec, Layout(tp, 1, 1, batch, sequence_parallel=sequence_parallel), Workload(batch, seq),
                          Assumptions(activation_bytes=4, param_bytes=4, grad_bytes=4, attention="sdpa"))
    return m.activations / 2**20


BF16 = dict(dtype="bfloat16")
GLOO = dict(fast_collectives="off")
SHM = dict(fast_collectives="on")
SP = dict(sequence_parallel=True)
VARIANTS = (  # name, tp, threads per rank, job, config changes, job options
    ("tensorpar tp=1 (1 thread)", 1, 1, "tensorpar", {}, {}),
    ("tensorpar tp=1 (2 threads)", 1, 2, "tensorpar", {}, {}),
    ("tensorpar tp=2, gloo", 2, 1, "tensorpar", dict(tp=2, **GLOO), {}),
    ("tensorpar tp=2, gloo, sync backward", 2, 1, "tensorpar", dict(tp=2, **GLOO), dict(overlap=False)),
    ("tensorpar tp=2, shm", 2, 1, "tensorpar", dict(tp=2, **SHM), {}),
    ("tensorpar tp=2 + sequence parallel, gloo", 2, 1, "tensorpar", dict(tp=2, **SP, **GLOO), {}),
    ("tensorpar tp=2 + sequence parallel, gloo, sync backward", 2, 1, "tensorpar", dict(tp=2, **SP, **GLOO),
     dict(overlap=False)),
    ("tensorpar tp=2 + sequence parallel, shm", 2, 1, "tensorpar", dict(tp=2, **SP, **SHM), {}),
    ("tensorpar tp=2, shm, overlap on a helper thread (experiment)", 2, 1, "tensorpar", dict(tp=2, **SHM),
     dict(shm_thread=True)),
    ("tensorpar tp=2 + sequence parallel, shm, overlap on a helper thread (experiment)", 2, 1, "tensorpar",
     dict(tp=2, **SP, **SHM), dict(shm_thread=True)),
    ("torch parallelize_module tp=2", 2, 1, "torch", dict(tp=2), {}),
    ("tensorpar tp=1 (2 threads) bf16", 1, 2, "tensorpar", BF16, {}),
    ("tensorpar tp=2 bf16, gloo", 2, 1, "tensorpar", dict(tp=2, **BF16, **GLOO), {}),
    ("tensorpar tp=2 bf16, shm", 2, 1, "tensorpar", dict(tp=2, **BF16, **SHM), {}),
    ("tensorpar tp=2 + sequence parallel bf16, gloo", 2, 1, "tensorpar", dict(tp=2, **SP, **BF16, **GLOO), {}),
    ("tensorpar tp=2 + sequence parallel bf16, shm", 2, 1, "tensorpar", dict(tp=2, **SP, **BF16, **SHM), {}),
)
TP2 = ("tensorpar tp=2, gloo", "tensorpar tp=2, shm", "tensorpar tp=2 + sequence parallel, gloo",
       "tensorpar tp=2 + sequence parallel, shm")
TP2_BF16 = ("tensorpar tp=2 bf16, gloo", "tensorpar tp=2 bf16, shm", "tensorpar tp=2 + sequence parallel bf16, gloo",
            "tensorpar tp=2 + sequence parallel bf16, shm")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per variant per round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="rounds over all variants (interleaved, so that a "
                                                          "burst of load from elsewhere hits every variant)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    cfg = TrainConfig(model=args.preset, data="synthetic", seq_len=args.seq_len, batch_size=args.batch_size,
                      steps=1000, warmup_steps=10)
    tokens = cfg.tokens_per_step
    load = os.getloadavg()[0]
    jobs = {"tensorpar": job_tensorpar, "torch": job_torch_tp}
    results: dict[str, list] = {v[0]: [] for v in VARIANTS}
    with WorkerPool(2, job_timeout_s=1800) as pool:
        for rnd in range(args.rounds):
            for name, tp, threads, job, change, opts in VARIANTS:
                c = cfg.replace(**change)
                if tp == 1:
                    torch.set_num_threads(threads)
                    per_rank = [jobs[job](ParallelContext.single(), c, args.warmup, args.steps, **opts)]
                    torch.set_num_threads(1)
                else:
                    per_rank = pool.run(_with_kwargs, jobs[job], (c, args.warmup, args.steps), opts)
                results[name].append(per_rank)
                print(f"round {rnd + 1}: {name}: {[round(max(t), 3) for t in zip(*[r['times'] for r in per_rank])]}"
                      f" s/step", flush=True)
    rows = [_summary(name, results[name], tokens, threads, tp) for name, tp, threads, _, _, _ in VARIANTS]
    base1, base2 = rows[0], rows[1]
    by = {r["variant"]: r for r in rows}
    for r, (_, tp, _, job, change, _) in zip(rows, VARIANTS):
        r["speedup_vs_tp1_1thread"] = base1["step_s_best"] / r["step_s_best"]
        r["speedup_vs_tp1_2threads"] = base2["step_s_best"] / r["step_s_best"]
        r["activation_vs_tp1"] = r["activation_mib_per_rank"] / base1["activation_mib_per_rank"]
        if job == "tensorpar" and change.get("dtype", "float32") == "float32":
            r["planner_activation_mib_per_rank"] = planner_activation_mib(
                args.preset, args.batch_size, args.seq_len, tp, change.get("sequence_parallel", False))
    torch_row = by["torch parallelize_module tp=2"]
    ratios = {name: torch_row["step_s_best"] / by[name]["step_s_best"] for name in TP2}

    def both(n: str, ref: dict) -> dict:
        return {"best": by[n]["step_s_best"] / ref["step_s_best"], "median": by[n]["step_s_median"] / ref["step_s_median"]}

    targets = {  # issue 13, items 5 and 7: step-time ratios (of the best steps and of the medians), memory exact
        "tp2 step / tp1 2-thread step (target <= 1.0)": {n: both(n, base2) for n in TP2},
        "tp2 step / torch parallelize_module step (target <= 0.9)": {n: both(n, torch_row) for n in TP2},
        "tp2+SP activation / tp1 activation (target <= 0.55)": by[TP2[2]]["activation_vs_tp1"],
        "bf16: tp2 step / tp1 2-thread bf16 step": {n: both(n, by["tensorpar tp=1 (2 threads) bf16"])
                                                    for n in TP2_BF16},
    }
    result = {
        "model": {"preset": args.preset, **PRESETS[args.preset], "vocab_size": 256},
        "seq_len": args.seq_len, "batch_size": args.batch_size, "tokens_per_step": tokens,
        "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "rows": rows,
        "torch_step_time_over_tensorpar": ratios, "targets": targets,
        "environment": {"torch": torch.__version__, "python": platform.python_version(),
                        "cpus": os.cpu_count(), "load_average_1min_at_start": load,
                        "load_average_1min_at_end": os.getloadavg()[0],
                        "date": datetime.now(timezone.utc).isoformat(timespec="seconds")},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _atomic_write(out / "train.json", json.dumps(result, indent=1))
    _atomic_write(out / "train.md", render_markdown(result))
    print(render_markdown(result))
    return 0


def render_markdown(res: dict) -> str:
    m = res["model"]
    env = res["environment"]
    lines = [
        f"Model: Llama preset `{m['preset']}` (hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, "
        f"{m['num_attention_heads']} heads / {m['num_key_value_heads']} KV heads, MLP {m['intermediate_size']}, "
        f"vocab {m['vocab_size']}), fp32, AdamW, batch {res['batch_size']} x seq {res['seq_len']} = "
        f"{res['tokens_per_step']} tokens/step; {res['rounds']} interleaved rounds of {res['steps']} timed steps "
        f"(after {res['warmup']} warm-up) per variant; step time = best step (tokens/s from it), median beside it.",
        f"Machine: {env['cpus']} CPUs, torch {env['torch']}, 1-min load average "
        f"{env['load_average_1min_at_start']:.1f} at start and {env['load_average_1min_at_end']:.1f} at the end "
        f"({env['date']}). **Step times are noisy "
        f"when the load average exceeds the core count** (other processes share the cores); the activation "
        f"memory column is exact.",
        "",
        "| variant | step (s), best | median | tokens/s | vs tp=1 (1 thread) | vs tp=1 (2 threads) | "
        "activation MiB/rank | activation vs tp=1 | planner MiB/rank | exposed comm s/step (median) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        planner = r.get("planner_activation_mib_per_rank")
        exposed = r.get("exposed_comm_s_median")
        lines.append(f"| {r['variant']} | {r['step_s_best']:.3f} | {r['step_s_median']:.3f} | "
                     f"{r['tokens_per_s']:,.0f} | "
                     f"{r['speedup_vs_tp1_1thread']:.2f}x | {r['speedup_vs_tp1_2threads']:.2f}x | "
                     f"{r['activation_mib_per_rank']:.1f} | {r['activation_vs_tp1']:.2f} | "
                     f"{'' if planner is None else f'{planner:.1f}'} | "
                     f"{'' if exposed is None else f'{exposed:.3f}'} |")
    lines.append("")
    for name, ratio in res["torch_step_time_over_tensorpar"].items():
        lines.append(f"- torch `parallelize_module` step time / {name} step time: **{ratio:.2f}**")
    for what, v in res.get("targets", {}).items():
        vals = (", ".join(f"{n}: {x['best']:.2f} (medians: {x['median']:.2f})" for n, x in v.items())
                if isinstance(v, dict) else f"{v:.2f}")
        lines.append(f"- {what}: {vals}")
    return "\n".join(lines) + "\n"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
