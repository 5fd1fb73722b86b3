"""Capacity-weighted tensor parallelism: tp ranks of unequal speed get shares of the work in proportion to it.

``tp_weights`` (``--tp-weights 3,1`` on generate, train, serve and verify; ``ParallelConfig(tp_weights=...)``
in Python) gives rank ``r`` the share ``w_r / sum(w)`` of every sharded dimension: query heads (whole GQA groups
where there are enough groups for the weights, else whole heads with a straddling group's KV head on both ranks;
:meth:`tensorpar.layers.attention.HeadLayout.make`), MLP
intermediate columns, routed-expert intermediate columns and vocabulary rows. The one rule is
:func:`tensorpar.shard.split_sizes` (largest remainder, ties to the lower rank, at least one unit per rank); the
planner's ``--devices`` uses the same function. Results equal the unsharded model's exactly as for an even
split: only the slice boundaries move. Checkpoints hold full tensors, so they load under any weights.

``tp_weights="auto"`` times a GEMM on every rank at start-up (:func:`measure_matmul_gflops`, all ranks at
once, so that ranks sharing a host compete as they will when running), gathers the speeds over the world and
derives the weights (:func:`weights_from_speeds`); every rank computes the same weights from the same gathered
numbers. Under data or pipeline parallelism a tp position takes the slowest speed measured at that position, so
that every replica has the same shard shapes.

Nothing here holds state; the parallel context carries the resolved weights (``ctx.tp_weights``).
"""
from __future__ import annotations

import math
import time
from typing import Sequence

import torch

from tensorpar.shard import AUTO, check_tp_weights, feasible_weights, split_sizes  # noqa: F401  (re-exported)



def weights_from_speeds(speeds: Sequence[float]) -> tuple[float, ...]:
    """Weights proportional to measured ``speeds`` (any unit), the fastest rank 1.0, rounded to 2 decimals
    (at least 0.01), so that every rank that computes them from the same numbers gets the same weights."""
    top = max(speeds)
    if not (top > 0 and all(math.isfinite(s) and s > 0 for s in speeds)):
        raise ValueError(f"measured matmul speeds {list(speeds)} must be positive; cannot derive tp_weights")
    return tuple(max(round(s / top, 2), 0.01) for s in speeds)


def measure_matmul_gflops(device: torch.device | str = "cpu", *, dtype: torch.dtype = torch.float32,
                          n: int | None = None, seconds: float = 0.5) -> float:
    """This process's speed at a square GEMM ``[n, n] @ [n, n]`` on ``device``, in GFLOP/s (``2 n^3`` flops per
    product), timed over at least ``seconds`` of wall clock after one warm-up product. ``n`` defaults to 384 on
    CPU and 4096 on accelerators. The time is wall clock, so a rank that is descheduled or throttled measures
    slower, as it will run."""
    device = torch.device(device)
    if n is None:
        n = 384 if device.type == "cpu" else 4096
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    torch.matmul(a, b)
    sync()
    count, t0 = 0, time.perf_counter()
    while True:
        torch.matmul(a, b)
        count += 1
        if count % 4 == 0 or device.type == "cpu":
            sync()
            el = time.perf_counter() - t0
            if el >= seconds:
                break
    return 2.0 * n ** 3 * count / el / 1e9


def measure_tp_weights(ctx, *, seconds: float = 0.5, dtype: torch.dtype = torch.float32) -> tuple[float, ...]:
    """``tp_weights`` from a GEMM timed on every rank of ``ctx`` at once (every rank must call it).

    Collectives: one barrier and one all-gather of a float64 scalar per rank over the default (world) group.
    A tp position's speed is the slowest of the replicas (dp, pp) at that position, so shard shapes agree
    across replicas. Returns one weight per tp rank, the same on every rank (:func:`weights_from_speeds`)."""
    import torch.distributed as dist

    if ctx.world_size == 1 or not dist.is_initialized():
        return (1.0,) * ctx.config.tp
    dist.barrier()
    speed = measure_matmul_gflops(ctx.device, dtype=dtype, seconds=seconds)
    mine = torch.tensor([speed], dtype=torch.float64, device=ctx.device)
    out = [torch.zeros_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(out, mine)
    speeds = torch.cat(out).cpu().view(ctx.config.dp, ctx.config.pp, ctx.config.tp)
    per_tp = speeds.reshape(-1, ctx.config.tp).min(dim=0).values.tolist()
    return weights_from_speeds(per_tp)


def min_units(config) -> int:
    """The fewest units any sharded dimension of a Hugging Face ``config`` has (query heads, MLP columns,
    expert columns, vocabulary): a weighted split must give every rank one of each."""
    from tensorpar.hf.plan import _get
    c = getattr(config, "text_config", None) or getattr(config, "vision_config", None) or config
    dims = [_get(c, "num_attention_heads", "n_head"), _get(c, "intermediate_size", "n_inner"),
            _get(c, "moe_intermediate_size"), _get(c, "shared_expert_intermediate_size"), _get(c, "vocab_size")]
    return min(int(d) for d in dims if isinstance(d, int) and d > 0)


def resolve_for_model(ctx, model_config) -> tuple[float, ...] | None:
    """The weights a rank shards ``model_config`` with: ``ctx.tp_weights``; when they were measured
    (``tp_weights="auto"``), raised where needed so that every rank keeps at least one head / column
    (:func:`feasible_weights`; every rank computes the same)."""
    w = getattr(ctx, "tp_weights", None)
    if w is None or getattr(ctx.config, "tp_weights", None) != AUTO:
        return w
    used = feasible_weights(w, min_units(model_config))
    if getattr(ctx, "rank", 0) == 0:  # the user asked for a measurement: say what it measured and what runs (stderr, one line)
        import sys
        fmt = ",".join
        print(f"tp_weights auto: measured {fmt(f'{v:.3g}' for v in w)}"
              + ("" if tuple(used) == tuple(w) else f", raised to {fmt(f'{v:.3g}' for v in used)} so every rank "
                 f"keeps a head and a column"), file=sys.stderr, flush=True)
    return used


def check_for_model(weights, tp_size: int, model_config, *, sequence_parallel: bool = False, user_plan=None,
                    what: str = "--tp-weights"):
    """Launching-process check of weights against a model: the plan is built with them (no weights read); a
    split that leaves a rank without a head or column is refused naming the weights and weights that work.
    Returns the normalised weights (``None``, ``"auto"`` or a tuple)."""
    weights = check_tp_weights(weights, tp_size, what=what)
    if weights is not None and weights != AUTO:
        plan_for_model(weights, tp_size, model_config, sequence_parallel=sequence_parallel, user_plan=user_plan,
                       what=what)
    return weights


def plan_for_model(weights, tp_size: int, model_config, *, sequence_parallel: bool = False, user_plan=None,
                   what: str = "--tp-weights", tp_name: str = "tp_size"):
    """``(weights, plan)``: :func:`check_for_model`'s normalised weights and the one plan it builds for them (an even
    split for ``None`` and for ``"auto"``, whose split the ranks measure). Raises the same ValueErrors; a degree above
    the model's query heads (the plan's rule, :func:`~tensorpar.layers.attention.tp_heads_error`) names the degree
    as ``tp_name`` (``--tp`` in the launching process; a plan file may lay out attention otherwise, so then the
    plan's own check speaks)."""
    from tensorpar.hf.plan import _get, make_plan
    from tensorpar.layers.attention import tp_heads_error

    c = getattr(model_config, "text_config", None) or getattr(model_config, "vision_config", None) or model_config
    heads = _get(c, "num_attention_heads", "n_head")
    if user_plan is None and isinstance(heads, int) and heads > 0:
        why = tp_heads_error(tp_size, heads, tp_name)
        if why is not None:
            raise ValueError(why)
    weights = check_tp_weights(weights, tp_size, what=what)
    given = None if weights is None or weights == AUTO else weights
    try:
        plan = make_plan(model_config, tp_size, sequence_parallel=sequence_parallel, tp_weights=given,
                         user_plan=user_plan)
    except ValueError as e:
        if given is None or "leave a rank with no part" not in str(e):
            raise
        fix = feasible_weights(given, min_units(model_config))
        raise ValueError(f"{what} {','.join(f'{v:g}' for v in given)} leaves a tp rank with no part of a sharded "
                         f"dimension ({str(e).split('no part of ', 1)[-1].split(';')[0]}); every rank needs at "
                         f"least one head and one column: use weights no more skewed than "
                         f"{','.join(f'{v:g}' for v in fix)}") from None
    return weights, plan


def add_argument(p) -> None:
    """``--tp-weights`` for an argparse parser (generate, train, serve, verify)."""
    p.add_argument("--tp-weights", default=None, metavar="W0,W1,...|auto",
                   help="relative speed of each tp rank (e.g. 3,1: rank 0 gets 3/4 of the heads, MLP columns and "
                        "vocabulary); 'auto' times a matmul on every rank at start-up. Default: an even split")
