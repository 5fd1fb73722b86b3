"""Links between two local ranks (tensorpar's worker pool): all-reduce timings over gloo and over tensorpar's
shared-memory collectives (:func:`measure_collectives`), gloo send/recv ping-pongs and the CPU of a pipeline
schedule's send or receive (:func:`measure_pipeline`), and the least-squares latency-bandwidth fit they share
(:func:`fit_alpha_beta`).
"""
from __future__ import annotations

import math
import time

COLLECTIVE_SIZES = tuple(2 ** k for k in range(12, 25, 2))  # 4 KiB .. 16 MiB payloads


def _time_all_reduce(ctx, sizes: tuple[int, ...], backend: str = "gloo") -> list[dict]:
    """Job for :class:`tensorpar.testing.WorkerPool`: mean seconds of ``comm.all_reduce`` (tensorpar's
    own path, clone included) over the tp group, for fp32 payloads of each size in bytes. ``backend="shm"``
    installs tensorpar's shared-memory collectives on the group for the measurement (and removes them after)."""
    import torch

    from tensorpar import comm

    if backend == "shm":
        from tensorpar.shm import disable_fast_collectives, enable_fast_collectives
        enable_fast_collectives(ctx.tp, "on")
        try:
            return _time_all_reduce(ctx, sizes, "gloo")
        finally:
            disable_fast_collectives(ctx.tp)
    samples = []
    for nbytes in sizes:
        x = torch.ones(nbytes // 4, dtype=torch.float32)
        for _ in range(2):  # warm-up: connection set-up, buffer allocation
            comm.all_reduce(x, ctx.tp)
        iters = max(3, min(50, (1 << 22) // nbytes))
        comm.all_reduce(torch.zeros(1), ctx.tp)  # line the ranks up
        start = time.perf_counter()
        for _ in range(iters):
            comm.all_reduce(x, ctx.tp)
        samples.append({"bytes": nbytes, "seconds": (time.perf_counter() - start) / iters})
    return samples


def fit_alpha_beta(samples: list[dict], world: int) -> tuple[float, float]:
    """Least-squares (latency s, bandwidth bytes/s) of ``t = latency + 2 (g-1)/g bytes / bandwidth``."""
    xs = [2 * (world - 1) / world * s["bytes"] for s in samples]
    ys = [s["seconds"] for s in samples]
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    latency = max(0.0, my - slope * mx)
    return latency, (1 / slope if slope > 0 else float("inf"))


COLLECTIVE_BACKENDS = ("gloo", "shm")


def measure_collectives(sizes: tuple[int, ...] = COLLECTIVE_SIZES, timeout_s: float = 120.0,
                        backends: tuple[str, ...] = ("gloo",)) -> dict:
    """All-reduce timings of 2 ranks on this host (tensorpar's worker pool), and their alpha-beta fit, for
    each of ``backends``: ``"gloo"`` (torch.distributed over loopback) and ``"shm"`` (tensorpar's shared-memory
    collectives, :mod:`tensorpar.shm`, installed on the same ranks). The first backend's fit is returned at the
    top level (``backend``, ``samples``, ``latency_us``, ``bandwidth_gbps``); with several, ``by_backend`` holds
    each one's. Where the times do not grow with the size (no positive slope: another process took the CPU during
    a small message), the bandwidth is the largest message's rate with its latency in it (a lower bound), never
    infinite: a device file refuses that.

    Raises:
        ValueError: an unknown backend.
        RuntimeError: a rank failed or gave no answer within ``timeout_s`` (with its traceback).
    """
    from tensorpar.testing import RankFailure, WorkerPool

    bad = [b for b in backends if b not in COLLECTIVE_BACKENDS]
    if bad or not backends:
        raise ValueError(f"collective backends {list(backends)!r}: use some of {', '.join(COLLECTIVE_BACKENDS)}")
    world = 2
    fits = {}
    try:
        with WorkerPool(world, collective_timeout_s=30.0, job_timeout_s=timeout_s) as pool:
            for backend in backends:
                samples = pool.run(_time_all_reduce, tuple(sizes), backend)[0]
                latency, bandwidth = fit_alpha_beta(samples, world)
                if not math.isfinite(bandwidth):    # the times did not grow with the size (a loaded host): the
                    big = max(samples, key=lambda q: q["bytes"])     # largest sample's rate, latency included
                    bandwidth = 2 * (world - 1) / world * big["bytes"] / big["seconds"]
                fits[backend] = {"backend": backend, "world_size": world, "samples": samples,
                                 "latency_us": latency * 1e6, "bandwidth_gbps": bandwidth / 1e9}
    except RankFailure as err:
        raise RuntimeError(f"collective calibration failed: {err}") from None
    out = dict(fits[backends[0]])
    if len(backends) > 1:
        out["by_backend"] = fits
    return out


P2P_SIZES = tuple(2 ** k for k in range(12, 23, 2))  # 4 KiB .. 4 MiB messages
PIPELINE_MICRO_BATCHES = (2, 18)  # the two schedules whose difference is 16 micro-batches' fixed time


def _time_p2p(ctx, sizes: tuple[int, ...], reps: int = 20) -> list[dict]:
    """Job for :class:`tensorpar.testing.WorkerPool` (2 ranks, the tp group): one-way seconds of a gloo
    ``send``/``recv`` of fp32 payloads of each size in bytes, as half the median ping-pong round trip (rank 0 sends,
    rank 1 receives and sends it back). Returned by every rank (the same list)."""
    import statistics

    import torch
    import torch.distributed as dist

    pg, me = ctx.tp.pg, ctx.tp.rank
    peer = 1 - ctx.rank  # the pool's 2 ranks: global ranks 0 and 1
    out = []
    for nbytes in sizes:
        x = torch.ones(nbytes // 4, dtype=torch.float32)
        trips = []
        for i in range(reps + 2):  # 2 warm-up round trips: connection and buffer set-up
            start = time.perf_counter()
            if me == 0:
                dist.send(x, dst=peer, group=pg)
                dist.recv(x, src=peer, group=pg)
            else:
                dist.recv(x, src=peer, group=pg)
                dist.send(x, dst=peer, group=pg)
            if i >= 2:
                trips.append(time.perf_counter() - start)
        out.append({"bytes": nbytes, "seconds": statistics.median(trips) / 2})
    return out


def _time_pipeline_overhead(ctx, micro_batches: tuple[int, ...] = PIPELINE_MICRO_BATCHES, hidden: int = 16,
                            reps: int = 9) -> dict:
    """Job for :class:`tensorpar.testing.WorkerPool` (2 ranks, the tp group used as a 2-stage pipeline): the fixed
    CPU time that ``torch.distributed.pipelining``'s 1F1B schedule (the trainer's) adds per micro-batch and stage.

    Each stage is a ``Linear(hidden, hidden)`` on one token (its arithmetic is negligible); the schedule runs with
    each of ``micro_batches``; per step this rank's CPU time (``time.process_time``: all its threads, gloo's
    included) and wall time, median of ``reps`` steps after one warm-up. The same stage's forward, loss and
    backward without the pipeline, per micro-batch, is subtracted (the trainer's own fixed times cover that).
    Returns ``{"cpu_s": {m: s}, "wall_s": {m: s}, "local_cpu_s": s per micro-batch}`` for this rank.
    """
    import statistics

    import torch
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.manual_seed(0)
    pg, me = ctx.tp.pg, ctx.tp.rank
    mod = torch.nn.Linear(hidden, hidden)

    def loss_fn(y, target):
        return ((y - target) ** 2).mean()

    cpu, wall = {}, {}
    for m in micro_batches:
        stage = PipelineStage(mod, me, 2, torch.device("cpu"), group=pg)
        sched = Schedule1F1B(stage, m, loss_fn=loss_fn)
        x, t = torch.randn(m, 1, hidden), torch.randn(m, 1, hidden)
        cs, ws = [], []
        for i in range(reps + 1):
            c0, w0 = time.process_time(), time.perf_counter()
            if me == 0:
                sched.step(x)
            else:
                sched.step(target=t, losses=[])
            if i:
                cs.append(time.process_time() - c0)
                ws.append(time.perf_counter() - w0)
            mod.zero_grad(set_to_none=True)
        cpu[m], wall[m] = statistics.median(cs), statistics.median(ws)
    # the stage's own work per micro-batch, without the pipeline: forward (+ loss on the last stage) and backward
    x, t = torch.randn(1, 1, hidden), torch.randn(1, 1, hidden)
    samples = []
    for i in range(50):
        c0 = time.process_time()
        y = mod(x.requires_grad_(me == 1))
        (loss_fn(y, t) if me == 1 else y.sum()).backward()
        if i >= 5:
            samples.append(time.process_time() - c0)
    return {"cpu_s": cpu, "wall_s": wall, "local_cpu_s": statistics.median(samples)}


def measure_pipeline(timeout_s: float = 120.0, rounds: int = 2) -> dict:
    """Point-to-point link and the CPU of a pipeline send or receive on this host (2 gloo ranks).

    * ``p2p_latency_us``, ``p2p_bandwidth_gbps``: least squares of ``one-way time = latency + bytes / bandwidth``
      over the median gloo send/recv ping-pongs of 4 KiB to 4 MiB (:func:`_time_p2p`), the link a pipeline's
      activations and gradients cross (wall clock: waiting is its cost). A bandwidth the fit cannot resolve (no
      positive slope: the wake-up latency dominates every size) is 0: the planner then uses the collectives'.
    * ``pipeline_p2p_op_cpu_us``: CPU microseconds of one send or receive of the pipeline schedule, the schedule's
      Python included: torch.distributed.pipelining's 1F1B on 2 trivial stages (:func:`_time_pipeline_overhead`),
      the slope of a rank's CPU time per step (``time.process_time``: gloo's threads and the kernel's loopback
      included) between 2 and 18 micro-batches, less the stage's own forward and backward without the pipeline,
      per micro-batch, divided by the 2 point-to-point operations each of the 2 stages does per micro-batch
      (stage 0 sends the activation and receives its gradient, stage 1 the reverse); the mean over both ranks and
      ``rounds`` rounds. Timed by CPU time; single measurements vary (hence the mean).
    * ``pipeline_p2p_op_cpu_shared_us``: the same with twice as many ranks as the host's cores (2-stage pipelines
      side by side, ``pipeline_shared_ranks`` ranks, at most 16): a rank whose peer is not running waits longer
      in gloo and spends more CPU on each operation (here 0.7-0.9 ms with 4 ranks on 2 cores against 0.2-0.35 ms
      with 2). The cost model uses it when a host's ranks outnumber its cores.

    Raises RuntimeError when a rank fails or does not answer within ``timeout_s``.
    """
    import math

    from tensorpar.launch import usable_cores
    from tensorpar.parallel import ParallelConfig
    from tensorpar.testing import RankFailure, WorkerPool

    lo, hi = PIPELINE_MICRO_BATCHES

    def op_cpu(results: list[dict]) -> tuple[float, list[float]]:
        slopes = [(r["cpu_s"][hi] - r["cpu_s"][lo]) / (hi - lo) - r["local_cpu_s"] for r in results]
        return max(0.0, sum(slopes) / len(slopes)) / 2 * 1e6, [x * 1e6 for x in slopes]

    # ranks that outnumber the cores: 2-stage pipelines side by side, twice as many ranks as cores (at most 16)
    shared_world = max(4, min(16, 2 * usable_cores()) // 2 * 2)
    try:
        with WorkerPool(2, collective_timeout_s=30.0, job_timeout_s=timeout_s) as pool:
            p2p = pool.run(_time_p2p, P2P_SIZES)[0]
            pipe = [r for _ in range(rounds) for r in pool.run(_time_pipeline_overhead)]
        with WorkerPool(shared_world, ParallelConfig(tp=2, dp=shared_world // 2), collective_timeout_s=60.0,
                        job_timeout_s=timeout_s) as pool:
            shared = [r for _ in range(rounds) for r in pool.run(_time_pipeline_overhead)]
    except RankFailure as err:
        raise RuntimeError(f"pipeline calibration failed: {err}") from None
    latency, bandwidth = fit_alpha_beta(p2p, 2)  # 2 (g-1)/g = 1 at g = 2: one-way bytes
    alone, slopes = op_cpu(pipe)
    oversubscribed, shared_slopes = op_cpu(shared)
    return {"p2p_samples": p2p, "p2p_latency_us": latency * 1e6,
            "p2p_bandwidth_gbps": bandwidth / 1e9 if math.isfinite(bandwidth) else 0.0,
            "pipeline_p2p_op_cpu_us": alone, "pipeline_p2p_op_cpu_shared_us": oversubscribed,
            "pipeline_shared_ranks": shared_world, "pipeline_cpu_slopes_us": slopes,
            "pipeline_shared_cpu_slopes_us": shared_slopes, "pipeline_wall_s": [r["wall_s"] for r in pipe]}
