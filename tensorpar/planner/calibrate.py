"""``tensorpar plan --calibrate``: measure this machine instead of trusting datasheets.

* Matmul throughput: square matmuls timed with torch (bf16 on a GPU, fp32 on a CPU), 2 n^3 FLOPs each.
* Collective latency and bandwidth: two ranks on this host (tensorpar's worker pool, gloo over loopback, and
  tensorpar's shared-memory collectives installed on the same ranks), tensorpar's all-reduce of growing sizes; a
  least-squares fit of ``time = latency + wire_bytes / bandwidth`` per backend (ring all-reduce on 2 ranks sends
  ``2 (g-1)/g = 1`` x the payload).
* Optimizer: torch's AdamW step over 1 Mi fp32 parameters, nanoseconds per parameter.
* Decode (:func:`measure_decode_reads`, not run by :func:`calibrate`: it needs the model's shapes): the one-row
  matmul read rate of a decode step at given per-rank weight shapes, one or several processes at once, and what
  each of the step's collectives adds to it.
* Pipeline (:func:`measure_pipeline`): gloo send/recv latency and bandwidth between two ranks (ping-pong), and the
  CPU of one send or receive of torch.distributed.pipelining's 1F1B schedule (trivial stages).

Also: :func:`saved_activation_bytes`, the bytes autograd keeps for backward while a function runs, which
the tests compare with the activation model.
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field

COLLECTIVE_SIZES = tuple(2 ** k for k in range(12, 25, 2))  # 4 KiB .. 16 MiB payloads


@dataclass(frozen=True)
class Calibration:
    backend: str
    matmul: list[dict]  # {"n", "dtype", "tflops"}
    matmul_tflops: float  # best measured
    collective: dict  # {"backend", "world_size", "samples": [{"bytes", "seconds"}], "latency_us", "bandwidth_gbps"}
    device: dict  # DeviceSpec fields, for --device-file
    pipeline: dict = field(default_factory=dict)  # measure_pipeline's (empty where it could not run)

    def to_dict(self) -> dict:
        return asdict(self)


def measure_matmul(sizes: tuple[int, ...] | None = None, min_seconds: float = 0.2,
                   clock=time.perf_counter) -> tuple[str, list[dict]]:
    """(device description, [{"n", "dtype", "tflops"}]) for square n x n matmuls. ``clock``: wall time by default;
    ``time.thread_time`` (CPU, one torch thread) gives the rate of the thread alone on a core, whatever else runs."""
    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    sizes = sizes or ((2048, 4096, 8192) if cuda else (256, 512, 1024))
    out = []
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        for _ in range(2):  # warm-up: kernel selection, caches
            a @ b
        iters = 1
        while True:  # double the repetitions until one timing lasts min_seconds
            if cuda:
                torch.cuda.synchronize()
            start = clock()
            for _ in range(iters):
                a @ b
            if cuda:
                torch.cuda.synchronize()
            elapsed = clock() - start
            if elapsed >= min_seconds:
                break
            iters *= 2
        out.append({"n": n, "dtype": str(dtype).removeprefix("torch."), "tflops": 2 * n ** 3 * iters / elapsed / 1e12})
    name = torch.cuda.get_device_name(0) if cuda else f"cpu ({torch.get_num_threads()} threads)"
    return name, out


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


def measure_memory_bandwidth(nbytes: int = 1 << 28, min_seconds: float = 0.2, clock=time.perf_counter) -> float:
    """Device-memory bandwidth, GB/s: bytes read plus bytes written per second by ``dst.copy_(src)`` of
    ``nbytes`` fp32 tensors (on the GPU when there is one, else in host memory with torch's threads). ``clock``:
    as :func:`measure_matmul`."""
    import torch

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: page faults, allocation
    iters = 1
    while True:
        if cuda:
            torch.cuda.synchronize()
        start = clock()
        for _ in range(iters):
            dst.copy_(src)
        if cuda:
            torch.cuda.synchronize()
        elapsed = clock() - start
        if elapsed >= min_seconds:
            return 2 * nbytes * iters / elapsed / 1e9
        iters *= 2


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
    each one's.

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
                fits[backend] = {"backend": backend, "world_size": world, "samples": samples,
                                 "latency_us": latency * 1e6, "bandwidth_gbps": bandwidth / 1e9}
    except RankFailure as err:
        raise RuntimeError(f"collective calibration failed: {err}") from None
    out = dict(fits[backends[0]])
    if len(backends) > 1:
        out["by_backend"] = fits
    return out


def measure_optimizer(params: int = 1 << 20, min_seconds: float = 0.1, clock=time.perf_counter) -> float:
    """Nanoseconds per parameter of one ``torch.optim.AdamW`` step (the trainer's optimizer, torch's default
    implementation, fp32, weight decay on) over ``params`` parameters in 8 tensors, on this process's threads
    (on the GPU when there is one): the median of repeated steps after two warm-up steps (which make the state).
    ``clock``: as :func:`measure_matmul`.
    """
    import statistics

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    ps = [torch.nn.Parameter(torch.randn(params // 8, device=device)) for _ in range(8)]
    for p in ps:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1)
    samples: list[float] = []
    total = 0.0
    for i in range(200):
        if device == "cuda":
            torch.cuda.synchronize()
        start = clock()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = clock() - start
        if i >= 2:
            samples.append(elapsed)
            total += elapsed
            if total >= min_seconds and len(samples) >= 5:
                break
    return statistics.median(samples) / (len(ps) * (params // 8)) * 1e9


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


def _memory_gib() -> float:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / 2 ** 30
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30


def calibrate() -> Calibration:
    """Measure matmul throughput, memory bandwidth, torch's AdamW step and loopback collectives (gloo, and
    tensorpar's shared memory in ``collective["by_backend"]`` where it installs). The ``device`` it returns uses
    the *measured* matmul rate as its peak (``matmul_efficiency`` 1), the measured copy bandwidth as
    ``hbm_gbps``, the AdamW time as ``optimizer_ns_per_param``, the measured gloo link as ``local_link_*``,
    labelled as this machine's local link (the NVLink and inter-node fields stay 0: not measured), and the
    pipeline's gloo send/recv link and the CPU of one of its sends or receives (:func:`measure_pipeline`) as
    ``p2p_link_*`` and ``pipeline_p2p_op_cpu_us``."""
    name, matmul = measure_matmul()
    bandwidth = measure_memory_bandwidth()
    optimizer = measure_optimizer()
    try:
        coll = measure_collectives(backends=("gloo", "shm"))
    except RuntimeError:  # no shared-memory collectives here (not x86, no /dev/shm): gloo only
        coll = measure_collectives()
    try:
        pipeline = measure_pipeline()
    except RuntimeError:  # not measured: the pipeline uses the collectives' link and no schedule overhead
        pipeline = {}
    best = max(m["tflops"] for m in matmul)
    label = (f"this machine's local link: {coll['world_size']} {coll['backend']} processes on loopback, "
             "measured (not NVLink, not a network)")
    device = {"name": f"calibrated {name}", "memory_gib": round(_memory_gib(), 2), "peak_tflops": best,
              "intra_node_gbps": 0.0, "inter_node_gbps": 0.0, "matmul_efficiency": 1.0,
              "hbm_gbps": round(bandwidth, 3), "optimizer_ns_per_param": round(optimizer, 3),
              "local_link_gbps": coll["bandwidth_gbps"], "local_link_latency_us": coll["latency_us"],
              "local_link_label": label, "p2p_link_gbps": pipeline.get("p2p_bandwidth_gbps", 0.0),
              "p2p_link_latency_us": pipeline.get("p2p_latency_us", 0.0),
              "pipeline_p2p_op_cpu_us": pipeline.get("pipeline_p2p_op_cpu_us", 0.0),
              "pipeline_p2p_op_cpu_shared_us": pipeline.get("pipeline_p2p_op_cpu_shared_us", 0.0),
              # decode's read rate and in-step collective cost depend on the model's matrix shapes: not measured
              # here (0: hbm_gbps and the link); measure_decode_reads at decode_matrices(model, tp) measures them
              # (bench/bench_plan_inference.py).
              "decode_read_gbps": 0.0, "decode_read_host_gbps": 0.0, "decode_collective_us": 0.0}
    return Calibration(backend=name, matmul=matmul, matmul_tflops=best, collective=coll, device=device,
                       pipeline=pipeline)


def saved_activation_bytes(fn, params=()) -> tuple[object, int]:
    """Run ``fn()`` and return (its result, bytes of the distinct storages autograd saves for backward
    while it runs), leaving out the storages of ``params`` (a linear layer saves a view of its weight)."""
    import torch

    skip = {p.untyped_storage().data_ptr() for p in params}
    storages: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, sum(storages.values())


def peak_memory_bytes(fn, baseline=()) -> tuple[object, int]:
    """Run ``fn()`` and return (its result, the peak bytes of live tensor storages while it ran, above
    those of ``baseline`` tensors, e.g. the parameters). Works on CPU, where torch keeps no allocator
    statistics: every operator's outputs are recorded through a dispatch mode and dropped once their
    storage is freed. Slow (a Python call per operator); meant for small models in tests."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class LiveStorages(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.refs: dict[int, tuple[StorageWeakRef, int]] = {}
            self.current = self.peak = 0

        def track(self, tensors) -> None:
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    if st.data_ptr() and st.data_ptr() not in self.refs:
                        self.refs[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
                        self.current += st.nbytes()
            self.peak = max(self.peak, self.current)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for key in [k for k, (ref, _) in self.refs.items() if ref.expired()]:
                self.current -= self.refs.pop(key)[1]  # freed before the outputs reuse its address
            self.track(tree_flatten(out)[0])
            return out

    mode = LiveStorages()
    mode.track(baseline)
    start = mode.current
    with mode:
        result = fn()
    return result, mode.peak - start


def _time_decode_reads(ctx, layer_shapes: tuple, layers: int, head_shape: tuple, collectives: str = "",
                       passes: int = 12) -> dict:
    """Job for :class:`tensorpar.testing.WorkerPool`: one rank's weight reads of a decode step, without the model.

    Each rank allocates its own fp32 matrices, ``layers`` x ``layer_shapes`` (``(out, in)`` each, in the order of
    the lean decode path's matmuls: fused QKV, attention output, fused gate-up, down) and ``head_shape`` (the
    LM head), and runs one token's one-row matmuls over them as :class:`tensorpar.lean.LeanDecoder` does
    (``torch.mm(x [1, in], W.t())`` for the layers, ``F.linear`` for the head), ``passes`` times after two
    warm-up passes; all ranks run at once (lined up by one all-reduce), so ranks on one host share its memory
    bandwidth as tp ranks do. The same calls on 8 x 8 matrices time the per-call dispatch, which the framework
    floor (``layer_overhead_us``) already holds.

    ``collectives``: ``""`` none; ``"gloo"`` or ``"shm"`` (tensorpar's shared-memory collectives installed on the
    group for the job): the same passes are timed again with the decode step's collectives interleaved where the
    lean path runs them: one all-reduce of ``[1, h]`` before the layers (embedding), one after each attention
    output and each down projection, then the greedy token pick's all-gather of ``[1, 2]`` fp64 and a broadcast
    of 2 int64 (``2 x layers + 3``).

    Returns ``{"bytes", "pass_s" (median seconds of a pass without collectives), "dispatch_s" (the same on 8 x 8
    matrices), "comm_pass_s" (median seconds of a pass with the collectives; ``pass_s`` without),
    "collective_s" (median seconds inside one collective, waits for the slower rank included; 0 without),
    "collectives_per_pass"}`` for this rank.
    """
    import statistics

    import torch
    import torch.nn.functional as F

    from tensorpar import comm

    if collectives == "shm":
        from tensorpar.shm import disable_fast_collectives, enable_fast_collectives
        enable_fast_collectives(ctx.tp, "on")
        try:
            return _time_decode_reads(ctx, layer_shapes, layers, head_shape, "gloo", passes)
        finally:
            disable_fast_collectives(ctx.tp)
    gen = torch.Generator().manual_seed(ctx.rank)
    sync = bool(collectives) and ctx.tp.size > 1

    def make(shapes):
        return [torch.randn(o, i, generator=gen) * 0.01 for o, i in shapes]

    real = [make(layer_shapes) for _ in range(layers)]
    head = torch.randn(*head_shape, generator=gen) * 0.01
    tiny = [make([(8, 8)] * len(layer_shapes)) for _ in range(layers)]
    tiny_head = torch.randn(8, 8, generator=gen)
    nbytes = 4 * (sum(w.numel() for ws in real for w in ws) + head.numel())
    spent = [0.0, 0]

    def coll(fn, *a):
        t0 = time.perf_counter()
        out = fn(*a)
        spent[0] += time.perf_counter() - t0
        spent[1] += 1
        return out

    def one_pass(mats, hw, inputs, with_comm):
        x = inputs[hw.shape[1]]
        if with_comm:
            x = coll(comm.all_reduce, x, ctx.tp)                     # the embedding's all-reduce
        for ws in mats:
            for j, w in enumerate(ws):
                y = torch.mm(inputs[w.shape[1]], w.t())
                if with_comm and j in (1, 3):                         # attention output, down projection
                    coll(comm.all_reduce, y, ctx.tp)
        logits = F.linear(x, hw)
        if with_comm:                                                 # greedy token pick and its broadcast
            coll(comm.all_gather, torch.zeros(1, 1, 2, dtype=torch.float64), ctx.tp, 0)
            coll(comm.broadcast, torch.zeros(2, dtype=torch.long), ctx.tp, 0)
        return logits

    def timed(mats, hw, with_comm):
        inputs = {w.shape[1]: torch.randn(1, w.shape[1], generator=gen) for ws in mats for w in ws}
        inputs[hw.shape[1]] = torch.randn(1, hw.shape[1], generator=gen)
        for _ in range(2):
            one_pass(mats, hw, inputs, with_comm)
        if ctx.tp.size > 1:
            comm.all_reduce(torch.zeros(1), ctx.tp)  # line the ranks up
        out, per_coll = [], []
        for _ in range(passes):
            spent[0], spent[1] = 0.0, 0
            t0 = time.perf_counter()
            one_pass(mats, hw, inputs, with_comm)
            out.append(time.perf_counter() - t0)
            if spent[1]:
                per_coll.append(spent[0] / spent[1])
        return statistics.median(out), (statistics.median(per_coll) if per_coll else 0.0), spent[1]

    with torch.no_grad():
        pass_s, _, _ = timed(real, head, False)
        comm_pass_s, coll_s, count = timed(real, head, True) if sync else (pass_s, 0.0, 0)
        dispatch_s, _, _ = timed(tiny, tiny_head, False)
    return {"bytes": nbytes, "pass_s": pass_s, "dispatch_s": dispatch_s, "comm_pass_s": comm_pass_s,
            "collective_s": coll_s, "collectives_per_pass": count}


def measure_decode_reads(layer_shapes, layers: int, head_shape, processes: int = 1, collectives: str = "",
                         timeout_s: float = 600.0) -> dict:
    """Weight-read rate of a decode step's one-row matmuls at the given per-rank shapes (fp32), with ``processes``
    ranks on this host reading at once (:func:`_time_decode_reads`; shapes e.g. from
    :func:`tensorpar.planner.inference.decode_matrices`).

    Returns ``{"processes", "bytes" (per rank), "gbps" (per rank: bytes / (pass - dispatch), the slowest rank's),
    "host_gbps" (``gbps x processes``), "dispatch_us" (per pass), "collective_us" (what one collective adds to a
    step: (pass with the collectives - pass without) / collectives, the mean over ranks: its latency, the waits
    for the slower rank and the reads it slows; 0 without ``collectives``), "inside_collective_us" (the time
    inside one, the largest rank's), "collectives_per_pass", "ranks"}``.

    Raises RuntimeError when a rank fails or does not answer within ``timeout_s``.
    """
    from tensorpar.testing import RankFailure, WorkerPool

    try:
        with WorkerPool(processes, collective_timeout_s=120.0, job_timeout_s=timeout_s) as pool:
            ranks = pool.run(_time_decode_reads, tuple(map(tuple, layer_shapes)), layers, tuple(head_shape),
                             collectives)
    except RankFailure as err:
        raise RuntimeError(f"decode-read calibration failed: {err}") from None
    slow = max(ranks, key=lambda r: r["pass_s"] - r["dispatch_s"])
    gbps = slow["bytes"] / max(slow["pass_s"] - slow["dispatch_s"], 1e-9) / 1e9
    return {"processes": processes, "bytes": slow["bytes"], "gbps": gbps, "host_gbps": gbps * processes,
            "dispatch_us": slow["dispatch_s"] * 1e6,
            "collective_us": (sum((r["comm_pass_s"] - r["pass_s"]) / max(r["collectives_per_pass"], 1) for r in ranks)
                              / len(ranks) * 1e6),
            "inside_collective_us": max(r["collective_s"] for r in ranks) * 1e6,
            "collectives_per_pass": slow["collectives_per_pass"], "ranks": ranks}
