"""``tensorpar train --plan auto | plan.json``: run the layout the planner chooses, then compare its prediction.

* ``--plan auto`` scores every (tp, pp, dp, micro-batch, sequence parallelism, recomputation, interleaving)
  layout of the ranks it was given with :mod:`tensorpar.planner` on *this machine*, measured by
  :func:`tensorpar.planner.calibrate.calibrate` (matmul rate, memory bandwidth, loopback all-reduce), keeps the
  layouts that ``tensorpar train`` runs (no distributed optimizer, no selective recomputation, no expert
  parallelism; the trainer's own checks pass) and takes the fastest that fits in memory.
* ``--plan FILE`` runs the first plan of a ``tensorpar plan --json`` file (a list) that the trainer runs, or the
  one plan object of a file, after checking that its degrees multiply to the ranks given and that it is valid
  and fits for the model trained.

The calibration is cached in ``<cache>/calibration/<machine key>.json`` (written atomically, under a file lock
so that torchrun's ranks measure once and then read the same file, and so choose the same layout). Delete the
file to measure again. The key names the host, its usable cores, torch's version and the GPU.

From the calibration the planner gets one rank's share of the machine (:func:`rank_device`):

* CUDA: one GPU per rank: the measured matmul rate, copy bandwidth, AdamW step and memory as they are;
* CPU: the ranks share the host, and on a shared machine with other users' processes. Matmuls, copy bandwidth,
  the AdamW step (:func:`tensorpar.planner.calibrate.measure_optimizer`) and the fixed overheads
  (:func:`measure_train_overhead`) are measured on one thread; a rank runs ``max(1, cores // nproc)`` threads
  (:func:`tensorpar.parallel.set_rank_threads`). The device holds one rank's rates *alone* on the host, and the
  planner's cost model shares the cores among the runnable threads (processor sharing,
  :mod:`tensorpar.planner.sharing`): ``min(1, cores / runnable threads)`` each, where the runnable threads are
  the busy ranks' (a pipeline stage that waits frees its core) and the other users', estimated by the 1-minute
  load average minus one (the measuring process), at calibration and again before the ranks start
  (:func:`rank_device`). The RAM is divided by ``nproc``.
* Collectives: the calibration measures 2-rank all-reduces over gloo and over tensorpar's shared-memory
  collectives; the device gets the backend that the trainer's groups use (``rank_device(backend=,
  tp_backend=)``; tensorpar train: gloo for every group unless shared memory is installed on the tp group).

Training is fp32 AdamW here (``dtype=float32``; bf16 autocast keeps fp32 weights): 4-byte weights and
gradients, 8 bytes of optimizer state per parameter (momentum and variance, no master copy), 4-byte
activations (2 under bf16 autocast), attention by ``sdpa`` (the trainer's).

After the run, :func:`comparison_line` prints the predicted step time next to the median of the measured steps
after warm-up, and the predicted memory per rank next to the measured peak (:class:`PeakMemory`).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

CALIBRATION_VERSION = 6  # 6: the pipeline's send/recv link and per-micro-batch schedule CPU (measure_pipeline)
WARMUP_STEPS = 2  # steps left out of the measured median (first-call allocation, pipeline set-up)
CPU_RESERVE_GIB = 0.5  # per rank on a CPU host: interpreter, torch and its libraries, process-group buffers


# ---------------------------------------------------------------- calibration, cached



def _median_step_s(model, plan, ids, ctx, clock, reps: int, warmup: int) -> float:
    """Median seconds (by ``clock``) of ``reps`` training steps of ``model`` on ``ids`` ``[b, s]`` after ``warmup``
    untimed ones: forward, vocabulary-parallel cross-entropy (:mod:`tensorpar.layers.cross_entropy`), backward."""
    from tensorpar.layers import vocab_parallel_cross_entropy

    samples = []
    for i in range(reps + warmup):
        start = clock()
        loss = vocab_parallel_cross_entropy(model(input_ids=ids, use_cache=False).logits, ids, ctx.tp,
                                            partition=plan.vocab)
        loss.backward()
        if i >= warmup:
            samples.append(clock() - start)
    return statistics.median(samples)

def machine_key() -> str:
    """A file-name-safe key of this machine as a calibration depends on it: host, usable cores, torch, GPU."""
    import torch

    from tensorpar.launch import usable_cores

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    raw = f"{platform.node()}|{usable_cores()}|{torch.__version__}|{gpu}|v{CALIBRATION_VERSION}"
    return f"{platform.node() or 'host'}-{hashlib.sha256(raw.encode()).hexdigest()[:12]}"


def calibration_path(cache_dir=None) -> Path:
    from tensorpar.cache import cache_root

    return cache_root(cache_dir) / "calibration" / f"{machine_key()}.json"


def quick_calibration() -> dict:
    """A short calibration (a few seconds): 1-thread matmuls, copy bandwidth and AdamW step (CPU; bf16 matmuls and
    the GPU's copy and AdamW on CUDA), all-reduces of 4 KiB to 4 MiB between two local ranks over gloo and over
    tensorpar's shared-memory collectives (``collective["by_backend"]``; shm only where it installs), and the
    fixed per-layer and per-micro-batch times. Same fields as :class:`Calibration` plus ``matmul_threads`` (the
    thread count of the matmul, copy and optimizer measurements), ``optimizer_ns_per_param``, ``cores``."""
    import time

    import torch

    from tensorpar.launch import usable_cores
    from tensorpar.planner.calibrate import (measure_collectives, measure_matmul, measure_memory_bandwidth,
                                             measure_optimizer, measure_pipeline)

    cuda = torch.cuda.is_available()
    threads = torch.get_num_threads()
    load_start = _loadavg()
    # CPU: one torch thread, timed by its CPU time (time.thread_time): the speed of a thread alone on a core, which
    # other users' processes on a shared machine do not change (they change the wall time). CUDA: wall time.
    clock = time.perf_counter if cuda else time.thread_time
    if not cuda:
        torch.set_num_threads(1)
    try:
        name, matmul = measure_matmul(None if cuda else (128, 256, 512), min_seconds=0.1, clock=clock)
        hbm = measure_memory_bandwidth(1 << 26, min_seconds=0.1, clock=clock)
        optimizer = measure_optimizer(1 << 20, min_seconds=0.1, clock=clock)
        overhead = measure_train_overhead(clock=clock)
        peak = max(m["tflops"] for m in matmul)
        layer = ({} if cuda else
                 measure_layer_efficiency(peak, hbm, overhead["train_layer_overhead_us"], clock=clock))
    finally:
        torch.set_num_threads(threads)
    # the collectives are timed by the wall clock (waiting is their cost): record the competition meanwhile
    with CompetitionSampler(interval=0.05) as others:
        try:
            coll = measure_collectives(tuple(2 ** k for k in range(12, 23, 2)), backends=("gloo", "shm"))
        except RuntimeError:  # shared memory not available here (not x86, no /dev/shm): gloo only
            coll = measure_collectives(tuple(2 ** k for k in range(12, 23, 2)))
        try:  # the pipeline's send/recv link and the schedule's fixed CPU per micro-batch (2 gloo ranks)
            pipeline = measure_pipeline()
        except RuntimeError:  # leave them out (0: not modelled) rather than fail the plan
            pipeline = {}
    taken = others.others_cores_between()
    if taken is not None:
        coll["others_busy_cores"] = taken
    return {**overhead, **layer, "pipeline": pipeline, "loadavg_1min": (load_start + _loadavg()) / 2, "version": CALIBRATION_VERSION,
            "backend": name, "matmul": matmul,
            "matmul_tflops": max(m["tflops"] for m in matmul), "matmul_threads": 0 if cuda else 1,
            "hbm_gbps": hbm, "optimizer_ns_per_param": optimizer, "collective": coll, "cores": usable_cores(),
            "cuda": cuda, "memory_gib": _machine_memory_gib(), "clock": "wall" if cuda else "thread_cpu"}


def measure_train_overhead(reps: int = 25, clock=None) -> dict:
    """Fixed time of a training step that no FLOP or byte count explains, on this process's threads.

    Forward, vocabulary-parallel cross-entropy and backward of tensorpar's tp = 1 model of a tiny Llama (hidden
    32, 8 tokens: the arithmetic is negligible) with 1 and with 4 layers; the median of ``reps`` steps (on a
    shared machine, the time a step takes under the load of the moment, like the steps it predicts) give, by
    difference, ``train_layer_overhead_us`` (per layer, forward + backward) and ``train_micro_batch_overhead_us``
    (the rest: embedding, final norm, LM head, loss), in microseconds. ``clock``: ``time.perf_counter`` (wall time)
    by default; ``time.thread_time`` (the thread's CPU time, with one torch thread) gives the time alone on a core.
    """
    import time

    import torch
    from transformers import LlamaConfig

    from tensorpar.parallel import ParallelContext
    from tensorpar.train.config import TrainConfig
    from tensorpar.train.model import ModelSource, build_model

    clock = clock or time.perf_counter
    ctx = ParallelContext.single()
    cfg = TrainConfig(model="calibration", seq_len=8, batch_size=1)
    ids = torch.arange(8).view(1, 8) % 64
    median = {}
    for layers in (1, 4):
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                             tie_word_embeddings=True)
        model, plan = build_model(cfg, ModelSource(config, None, None), ctx.tp, 64)
        median[layers] = _median_step_s(model, plan, ids, ctx, clock, reps, warmup=3)
    per_layer = max(0.0, (median[4] - median[1]) / 3)
    return {"train_layer_overhead_us": per_layer * 1e6,
            "train_micro_batch_overhead_us": max(0.0, median[1] - per_layer) * 1e6}


# The decoder layer that calibrates a CPU's layer efficiency (measure_layer_efficiency): a generic small Llama layer,
# not any model trained here: hidden 384 (6 heads of 64, 2 KV heads), SwiGLU 1024, 2 sequences of 128 tokens.
EFFICIENCY_LAYER = dict(hidden_size=384, intermediate_size=1024, num_attention_heads=6, num_key_value_heads=2,
                        head_dim=64, batch=2, seq=128)


def measure_layer_efficiency(peak_tflops: float, hbm_gbps: float, layer_overhead_us: float,
                             reps: int = 3, clock=None) -> dict:
    """The fraction of the square-matmul peak that a decoder layer's matmuls reach on this CPU, measured.

    Forward and backward of tensorpar's tp = 1 model of :data:`EFFICIENCY_LAYER` with 1 and 2 layers (the median
    of ``reps`` steps each, after one warm-up); the difference is one layer's time, ``T``. The planner's time of
    that layer at ``matmul_efficiency`` ``e`` is
    ``F / (e peak) + E + O`` (``F``: its matmul and attention FLOPs forward and backward, ``E``: its elementwise
    traffic at ``hbm_gbps``, ``O``: the measured fixed ``layer_overhead_us``, :func:`tensorpar.planner.cost.
    layer_times`), so ``e = F / (peak (T - E - O))``, clamped to [0.05, 1]. The counterpart of the A100's
    ``matmul_efficiency``, which was fitted to measured layer times too (Korthikanti et al. 2022, Table 4): the
    shapes of a layer's matmuls (skinny, batched attention) run below a large square matmul's rate.
    Returns ``{"layer_matmul_efficiency", "layer_seconds", "layer_predicted_at_peak_seconds"}``.
    """
    import time
    from dataclasses import replace

    import torch
    from transformers import LlamaConfig

    from tensorpar.parallel import ParallelContext
    from tensorpar.planner.cluster import ClusterSpec, DeviceSpec
    from tensorpar.planner.cost import layer_times
    from tensorpar.planner.layout import Assumptions, Layout, Workload
    from tensorpar.planner.model_spec import from_hf_config
    from tensorpar.train.config import TrainConfig
    from tensorpar.train.model import ModelSource, build_model

    clock = clock or time.perf_counter
    shape = dict(EFFICIENCY_LAYER)
    batch, seq = shape.pop("batch"), shape.pop("seq")
    ctx = ParallelContext.single()
    cfg = TrainConfig(model="calibration", seq_len=seq, batch_size=batch)
    ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(0))
    median = {}
    for layers in (1, 2):
        config = LlamaConfig(vocab_size=256, num_hidden_layers=layers, max_position_embeddings=seq,
                             tie_word_embeddings=True, **shape)
        model, plan = build_model(cfg, ModelSource(config, None, None), ctx.tp, 256)
        median[layers] = _median_step_s(model, plan, ids, ctx, clock, reps, warmup=1)
    measured = max(1e-9, median[2] - median[1])
    spec = from_hf_config(config.to_dict(), name="calibration")
    device = DeviceSpec("calibration", 1.0, peak_tflops, 0.0, 0.0, matmul_efficiency=1.0, hbm_gbps=hbm_gbps,
                        local_link_gbps=1.0, train_layer_overhead_us=layer_overhead_us)
    assume = Assumptions(activation_bytes=4, param_bytes=4, grad_bytes=4, optimizer_bytes=8, attention="sdpa")
    lay = Layout(tp=1, pp=1, dp=1, micro_batch=batch)
    work = Workload(batch, seq)
    at_peak = layer_times(spec, lay, ClusterSpec(device, 1, 1), work, assume).total
    no_matmul = layer_times(spec, lay, ClusterSpec(replace(device, peak_tflops=1e9), 1, 1), work, assume).total
    flops_seconds = at_peak - no_matmul  # the matmul and attention FLOPs at the peak
    efficiency = flops_seconds / max(1e-12, measured - no_matmul)
    return {"layer_matmul_efficiency": min(1.0, max(0.05, efficiency)), "layer_seconds": measured,
            "layer_predicted_at_peak_seconds": at_peak}


def autogroup_enabled() -> bool:
    """Whether this Linux kernel shares the CPU among sessions first (``/proc/sys/kernel/sched_autogroup_enabled``)."""
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            return f.read().strip() == "1"
    except OSError:
        return False


class CompetitionSampler:
    """Other users' competition for the cores, sampled every ``interval`` s in a background thread (Linux ``/proc``):
    the runnable threads (state R in ``/proc/<pid>/task/<tid>/stat``) of every process but this one, ``pids()``
    (e.g. the ranks it started) and, under autogroup, the processes of our own scheduling group (session), and the
    distinct scheduling groups they are in (``/proc/<pid>/autogroup``).
    Unlike the 1-minute load average it is not smoothed over a minute, does not count our own threads, and sees
    the groups that the kernel shares the CPU among. A context manager; :meth:`mean_between` averages the samples
    of a time window (``time.time()``). Where ``/proc`` is missing, there are no samples."""

    def __init__(self, pids=lambda: [], interval: float = 0.1):
        import threading

        self.pids, self.interval = pids, interval
        self.samples: list[tuple[float, int, int]] = []  # (time, other runnable threads, their groups)
        self.cpu: list[tuple[float, float, float]] = []  # (time, busy core-seconds of the host, ours), cumulative
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @staticmethod
    def _read(path: str) -> str | None:
        try:
            with open(path) as f:
                return f.read()
        except OSError:
            return None

    def sample(self) -> tuple[int, int] | None:
        """(other runnable threads, distinct groups holding them) now; None without ``/proc``."""
        try:
            procs = [d for d in os.listdir("/proc") if d.isdigit()]
        except OSError:
            return None
        ours = {str(os.getpid()), *(str(p) for p in self.pids())}
        group = self._group("self") if autogroup_enabled() else None
        threads, groups = 0, set()
        for pid in procs:
            if pid in ours:
                continue
            theirs = self._group(pid)
            if group is not None and theirs == group:
                continue  # in our scheduling group (our session: e.g. the ranks we started)
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            running = 0
            for tid in tids:
                stat = self._read(f"/proc/{pid}/task/{tid}/stat")
                if stat and stat.rsplit(")", 1)[-1].split()[:1] == ["R"]:
                    running += 1
            if running:
                threads += running
                groups.add(theirs or pid)
        return threads, len(groups)

    def _group(self, pid: str) -> str | None:
        text = self._read(f"/proc/{pid}/autogroup")
        return text.split(" ")[0] if text else None

    def cpu_seconds(self) -> tuple[float, float] | None:
        """(busy core-seconds of the whole host since boot, of this process and ``pids()``), from ``/proc/stat``
        (user + nice + system + irq + softirq + steal) and ``/proc/<pid>/stat`` (utime + stime); None without /proc."""
        hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        text = self._read("/proc/stat")
        if not text:
            return None
        f = [int(x) for x in text.splitlines()[0].split()[1:]]
        busy = sum(f[:3]) + sum(f[5:8])   # user nice system (idle iowait) irq softirq steal
        ours = 0
        for pid in [os.getpid(), *self.pids()]:
            stat = self._read(f"/proc/{pid}/stat")
            if stat:
                rest = stat.rsplit(")", 1)[-1].split()
                ours += int(rest[11]) + int(rest[12])   # utime, stime (fields 14 and 15)
        return busy / hz, ours / hz

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            now = time.time()
            cpu = self.cpu_seconds()
            if cpu is not None:
                self.cpu.append((now, *cpu))
            got = self.sample()
            if got is not None:
                self.samples.append((now, *got))

    def others_cores_between(self, start: float = 0.0, end: float = float("inf")) -> float | None:
        """Cores the other processes of the host kept busy on average in ``[start, end]`` (busy host time minus ours,
        over the wall time between the first and last sample inside); None with fewer than 2 samples."""
        inside = [c for c in self.cpu if start <= c[0] <= end]
        if len(inside) < 2:
            return None
        (t0, b0, o0), (t1, b1, o1) = inside[0], inside[-1]
        return max(0.0, ((b1 - b0) - (o1 - o0)) / (t1 - t0))

    def mean_between(self, start: float = 0.0, end: float = float("inf")) -> tuple[float, float] | None:
        """Mean (other runnable threads, their groups) of the samples in ``[start, end]``; None if there are none."""
        inside = [(n, g) for t, n, g in self.samples if start <= t <= end]
        if not inside:
            return None
        return statistics.mean(x[0] for x in inside), statistics.mean(x[1] for x in inside)


def _loadavg() -> float:
    """The 1-minute load average (runnable processes), 0 where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return 0.0


def _machine_memory_gib() -> float:
    from tensorpar.planner.calibrate import _memory_gib

    return _memory_gib()


def cached_calibration(cache_dir=None, *, log=None) -> tuple[dict, Path, bool]:
    """``(calibration, its file, whether it was read from the cache)``; measures and saves it when absent.

    Raises RuntimeError when a calibration rank fails (its message says which).
    """
    from tensorpar.cache import atomic_file, file_lock

    path = calibration_path(cache_dir)
    with file_lock(path.with_suffix(".lock"), what="a calibration of this machine"):
        try:
            data = json.loads(path.read_text())
            if data.get("version") == CALIBRATION_VERSION:
                return data, path, True
        except (OSError, ValueError):
            pass  # absent or unreadable: measure again
        if log:
            log(f"measuring this machine once for the planner (cached in {path}) ...")
        data = quick_calibration()
        with atomic_file(path, "w") as f:
            json.dump(data, f, indent=2)
    return data, path, False


def collective_fit(cal: dict, backend: str) -> dict:
    """The calibration's all-reduce fit (``latency_us``, ``bandwidth_gbps``, ``backend``) of ``backend`` ("gloo" or
    "shm"). Raises ValueError when the calibration did not measure it."""
    coll = cal["collective"]
    fits = coll.get("by_backend") or {coll.get("backend", "gloo"): coll}
    if backend not in fits:
        raise ValueError(f"collective backend {backend!r} was not calibrated on this machine (measured: "
                         f"{', '.join(fits)}); delete {calibration_path()} to measure again")
    return fits[backend]


def rank_device(cal: dict, nproc: int, local_nproc: int | None = None, load_now: float | None = None,
                backend: str = "gloo", tp_backend: str | None = None):
    """One rank's :class:`~tensorpar.planner.cluster.DeviceSpec` from a calibration (module docstring).

    ``backend``: the collectives of the pipeline and data-parallel groups (the trainer's: gloo); ``tp_backend``:
    those of the tensor-parallel group when it differs ("shm" where the trainer installs tensorpar.shm on it; None:
    the same as ``backend``). Each is the calibration's measured fit of that backend, labelled as this machine's
    local link.

    ``load_now``: the 1-minute load average before the ranks start (None: an idle machine). On a CPU the rates
    are one rank's *alone* on the host (``threads = max(1, cores // ranks)`` threads, each on a core), and the
    planner shares the cores among the runnable threads itself (``host_cores``, ``threads_per_rank``,
    ``external_threads``: :mod:`tensorpar.planner.sharing`). The calibration ran with ``ext_cal = loadavg - 1``
    other runnable threads (its record); a calibration timed by wall clock (an older cache) had
    ``s_cal = min(1, cores / (1 + ext_cal))`` of a core for its single thread: rate alone = measured rate / s_cal
    x threads; fixed times and the optimizer's time per parameter x s_cal (/ threads for the optimizer). A
    calibration timed by the thread's CPU time (``clock`` "thread_cpu", the current one) needs no correction
    (s_cal = 1). The collectives' fit is used as measured. The other users' threads when the ranks run are
    ``load_now - 1``. Copy bandwidth: measured on one thread, x threads / s_cal. The matmul efficiency is the
    calibration's ``layer_matmul_efficiency`` (:func:`measure_layer_efficiency`; 1 where absent).
    """
    from tensorpar.planner.cluster import DeviceSpec
    from tensorpar.planner.sharing import thread_share

    local = local_nproc or nproc
    fit = collective_fit(cal, backend)
    tp_fit = collective_fit(cal, tp_backend) if tp_backend and tp_backend != backend else None
    label = "this machine's local link: 2 {} processes on loopback, measured (not NVLink, not a network)"
    overhead = {k: cal[k] for k in ("train_layer_overhead_us", "train_micro_batch_overhead_us")}
    pipe = cal.get("pipeline") or {}
    # the pipeline's measured send/recv link (wall clock, as the collectives) and schedule CPU (CPU time)
    overhead.update(p2p_link_gbps=pipe.get("p2p_bandwidth_gbps", 0.0),
                    p2p_link_latency_us=pipe.get("p2p_latency_us", 0.0),
                    pipeline_p2p_op_cpu_us=pipe.get("pipeline_p2p_op_cpu_us", 0.0),
                    pipeline_p2p_op_cpu_shared_us=pipe.get("pipeline_p2p_op_cpu_shared_us", 0.0))
    if cal["cuda"]:
        link = dict(local_link_gbps=fit["bandwidth_gbps"], local_link_latency_us=fit["latency_us"],
                    local_link_label=label.format(fit["backend"]))
        if tp_fit:
            link.update(tp_link_gbps=tp_fit["bandwidth_gbps"], tp_link_latency_us=tp_fit["latency_us"],
                        tp_link_label=label.format(tp_fit["backend"]))
        return DeviceSpec(f"calibrated {cal['backend']}", cal["memory_gib"], cal["matmul_tflops"], 0.0, 0.0,
                          matmul_efficiency=1.0, hbm_gbps=cal["hbm_gbps"],
                          optimizer_ns_per_param=cal.get("optimizer_ns_per_param", 0.0), **overhead, **link)
    cores = cal["cores"]
    threads = max(1, cores // local)
    ext_cal = max(0.0, cal.get("loadavg_1min", 0.0) - 1)
    ext_now = max(0.0, (load_now or 0.0) - 1)
    # timed by the thread's CPU time (clock "thread_cpu"): already the speed alone; by wall time (older caches): the
    # share of a core the measuring thread had
    s_cal = 1.0 if cal.get("clock") == "thread_cpu" else thread_share(1, cores, ext_cal)

    def link_of(f: dict) -> tuple[float, float]:
        # as measured (wall clock, under the load of the moment): a collective's time is mostly waiting (wake-ups,
        # the peer's turn on a core), which no share of a core converts to an idle machine's; the cores the
        # other users kept busy meanwhile are recorded in the calibration (collective["others_busy_cores"])
        return f["bandwidth_gbps"], f["latency_us"]

    gbps, lat = link_of(fit)
    link = dict(local_link_gbps=gbps, local_link_latency_us=lat, local_link_label=label.format(fit["backend"]))
    if tp_fit:
        gbps, lat = link_of(tp_fit)
        link.update(tp_link_gbps=gbps, tp_link_latency_us=lat, tp_link_label=label.format(tp_fit["backend"]))
    load = f" at load {load_now:.1f}" if load_now is not None else ""
    return DeviceSpec(f"calibrated {cal['backend'].split(' (')[0]}, 1 of {local} ranks on {cores} cores{load}",
                      cal["memory_gib"] / local, cal["matmul_tflops"] / s_cal * threads, 0.0, 0.0,
                      matmul_efficiency=cal.get("layer_matmul_efficiency", 1.0),
                      hbm_gbps=cal["hbm_gbps"] / s_cal * threads,
                      train_layer_overhead_us=cal["train_layer_overhead_us"] * s_cal,
                      train_micro_batch_overhead_us=cal["train_micro_batch_overhead_us"] * s_cal,
                      p2p_link_gbps=overhead["p2p_link_gbps"], p2p_link_latency_us=overhead["p2p_link_latency_us"],
                      pipeline_p2p_op_cpu_us=overhead["pipeline_p2p_op_cpu_us"],
                      pipeline_p2p_op_cpu_shared_us=overhead["pipeline_p2p_op_cpu_shared_us"],
                      optimizer_ns_per_param=cal.get("optimizer_ns_per_param", 0.0) * s_cal / threads,
                      host_cores=float(cores), threads_per_rank=threads, external_threads=ext_now, **link)


# ---------------------------------------------------------------- the planner's view of a training run


def planner_inputs(cfg, model_config, device, nproc: int, local_nproc: int | None = None):
    """``(ModelSpec, ClusterSpec, Workload, Assumptions)`` of ``cfg`` on ``nproc`` ranks of ``device``."""
    from tensorpar.planner.cluster import ClusterSpec
    from tensorpar.planner.layout import Assumptions, Workload
    from tensorpar.planner.model_spec import from_hf_config

    model = from_hf_config(model_config.to_dict(), name=cfg.model)
    per_node = local_nproc or nproc
    cluster = ClusterSpec(device, nproc, per_node if nproc % per_node == 0 else nproc)
    reserve = CPU_RESERVE_GIB if device.name.startswith("calibrated cpu") else Assumptions.reserve_gib
    assume = Assumptions(activation_bytes=2 if cfg.dtype == "bfloat16" else 4, param_bytes=4, grad_bytes=4,
                         optimizer_bytes=8, attention="sdpa", reserve_gib=reserve,
                         max_micro_batch=cfg.batch_size, virtual_stages=(1, 2))
    return model, cluster, Workload(cfg.batch_size, cfg.seq_len), assume


def layout_config(cfg, layout, global_batch: int):
    """The :class:`TrainConfig` that runs planner ``layout`` (raises the config's ValueError if it cannot). The
    schedule: interleaved 1F1B for ``virtual_stages`` 2, else the run's (1F1B unless ``--schedule gpipe``)."""
    m = layout.num_micro_batches(global_batch)
    if layout.virtual_stages > 1:
        schedule = "interleaved-1f1b"
    else:
        schedule = "1f1b" if cfg.schedule == "interleaved-1f1b" else cfg.schedule
    return cfg.replace(tp=layout.tp, pp=layout.pp, dp=layout.dp, micro_batches=m, schedule=schedule,
                       sequence_parallel=layout.sequence_parallel, recompute=layout.recompute == "full")


def unsupported(layout) -> str | None:
    """Why ``tensorpar train`` cannot run ``layout`` (None when it can)."""
    if layout.distributed_optimizer:
        return "distributed_optimizer=true (the trainer keeps the whole optimizer state on every dp replica)"
    if layout.recompute == "selective":
        return "recompute=selective (the trainer recomputes whole blocks: use recompute=full or none)"
    if layout.ep > 1:
        return f"ep={layout.ep} (expert parallelism is not trained)"
    if layout.virtual_stages > 2:
        return f"virtual_stages={layout.virtual_stages} (the interleaved schedule uses 2 chunks per stage)"
    return None


def runtime_problem(cfg, model_config) -> str | None:
    """The trainer's own checks of a layout (its config, the sharding plan, the pipeline cut), as one line."""
    from tensorpar.hf.plan import make_plan
    from tensorpar.pipeline.stages import check_pipeline

    try:
        cfg = cfg.replace()  # __post_init__: micro-batches, schedule, sequence parallelism
        make_plan(model_config, cfg.tp, sequence_parallel=cfg.sequence_parallel)
        if cfg.pp > 1:
            check_pipeline(model_config, cfg.pp, 2 if cfg.schedule == "interleaved-1f1b" else 1,
                           cfg.micro_batches, cfg.schedule)
    except ValueError as e:
        return " ".join(str(e).split())
    return None


@dataclass(frozen=True)
class Choice:
    """The layout to run: the planner's scored ``plan``, the ``cfg`` that runs it, and where it came from."""

    plan: object  # tensorpar.planner.enumerate.Plan
    cfg: object  # TrainConfig
    device: object  # DeviceSpec
    source: str  # "auto" or the plan file
    note: str = ""

    def summary(self) -> str:
        """One line: the layout and its predicted step time and memory per rank."""
        c, p = self.cfg, self.plan
        sched = f" schedule={c.schedule}" if c.pp > 1 else ""
        return (f"plan ({self.source}): tp={c.tp} pp={c.pp} dp={c.dp} micro-batches={c.micro_batches}{sched} "
                f"sp={'on' if c.sequence_parallel else 'off'} recompute={'on' if c.recompute else 'off'}: "
                f"predicted step {p.cost.step.total * 1e3:.1f} ms, {_mib(p.memory.total)} per rank "
                f"(device: {self.device.name}{'; ' + self.note if self.note else ''})")

    def prediction(self) -> dict:
        return {"step_time_s": self.plan.cost.step.total, "memory_bytes": self.plan.memory.total,
                "layout": self.plan.layout.to_dict()}


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2 ** 20:.1f} MiB"


def choose_auto(cfg, model_config, device, nproc: int, local_nproc: int | None = None, *, note: str = "") -> Choice:
    """The fastest layout of ``nproc`` ranks that fits and that the trainer runs.

    Raises ValueError (naming ``--plan auto`` and the ranks) when none does, with the first reason.
    """
    from tensorpar.planner.enumerate import search

    model, cluster, work, assume = planner_inputs(cfg, model_config, device, nproc, local_nproc)
    found = search(model, cluster, work, assume)
    reasons = []
    for plan in found.ranked:
        why = unsupported(plan.layout)
        if why is None:
            try:  # the trainer's config checks (e.g. 1F1B needs micro-batches >= pp)
                run_cfg = layout_config(cfg, plan.layout, work.global_batch)
            except ValueError as e:
                why, run_cfg = " ".join(str(e).split()), None
            if why is None:
                why = runtime_problem(run_cfg, model_config)
            if why is None:
                return Choice(plan, run_cfg, device, "auto", note)
        reasons.append(f"{plan.layout.short()}: {why}")
    if found.too_big and not found.ranked:
        best = found.too_big[0]
        raise ValueError(f"--plan auto: no layout of {nproc} ranks fits in {device.memory_gib:.2f} GiB per rank; "
                         f"the smallest ({best.layout.short()}) needs {best.memory.total / 2 ** 30:.2f} GiB; use "
                         f"more ranks, a smaller --batch-size or --seq-len")
    first = reasons[0] if reasons else "; ".join(p.message for r in found.rejected[:1] for p in r.problems)
    raise ValueError(f"--plan auto: no layout of {nproc} ranks is runnable for --model {cfg.model} (first: {first}); "
                     f"try another rank count (--nproc)")


PLAN_KEYS = ("tp", "pp", "dp", "micro_batch", "sequence_parallel", "recompute", "distributed_optimizer",
             "virtual_stages", "ep")


def read_plan_file(path: str) -> list:
    """``[(position, Layout)]`` of every plan of a ``tensorpar plan --json`` file, in its order (best ranked first,
    positions from 1), or ``[(0, Layout)]`` for a file holding one plan object. Raises ValueError naming the file
    and the field."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"--plan {path}: cannot read it ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--plan {path}: not JSON ({e}); save one with tensorpar plan ... --json > {path}") from None
    if isinstance(data, list):
        if not data:
            raise ValueError(f"--plan {path}: the list of plans is empty (no layout fitted when it was made)")
        return [(i + 1, _plan_layout(path, d, i + 1)) for i, d in enumerate(data)]
    return [(0, _plan_layout(path, data, 0))]


def _plan_layout(path: str, data, position: int):
    from tensorpar.planner.layout import Layout

    where = f"plan #{position}" if position else "the plan"
    if not isinstance(data, dict):
        raise ValueError(f"--plan {path}: expected a plan object or the list that tensorpar plan --json prints")
    missing = [k for k in ("tp", "pp", "dp", "micro_batch") if k not in data]
    if missing:
        raise ValueError(f"--plan {path}: {where} lacks {', '.join(missing)}; save one with tensorpar plan --json")
    values = {k: data[k] for k in PLAN_KEYS if k in data}
    for k in ("tp", "pp", "dp", "micro_batch", "virtual_stages", "ep"):
        if k in values and (not isinstance(values[k], int) or isinstance(values[k], bool) or values[k] < 1):
            raise ValueError(f"--plan {path}: {where}: {k}={values[k]!r} must be a positive integer")
    for k in ("sequence_parallel", "distributed_optimizer"):
        if k in values and not isinstance(values[k], bool):
            raise ValueError(f"--plan {path}: {where}: {k}={values[k]!r} must be true or false")
    return Layout(**values)


def check_plan_file(path: str, nproc: int | None, nproc_source: str = "--nproc"):
    """``(layout, position)``: the first plan of ``path`` (:func:`read_plan_file`; position 1-based, 0 for a lone
    object) that the trainer runs (no distributed optimizer, selective recomputation or expert parallelism), if
    its degrees multiply to ``nproc`` (when given); else ValueError naming ``--plan``, the setting and the ranks."""
    plans = read_plan_file(path)
    skipped = []
    for position, lay in plans:
        why = unsupported(lay)
        if why is None:
            break
        skipped.append(why)
    else:
        more = f" (nor can it the other {len(plans) - 1} plans of the file)" if len(plans) > 1 else ""
        raise ValueError(f"--plan {path}: tensorpar train cannot run {skipped[0]}{more}")
    if nproc is not None and lay.num_devices != nproc:
        raise ValueError(f"--plan {path}: tp x pp x dp = {lay.tp} x {lay.pp} x {lay.dp} = {lay.num_devices}, but "
                         f"{nproc} ranks were given ({nproc_source}); make a plan for --gpus {nproc}")
    return lay, position


def choose_from_file(path: str, cfg, model_config, device, nproc: int | None, local_nproc: int | None = None,
                     *, nproc_source: str = "--nproc", note: str = "") -> Choice:
    """The layout saved in ``path``, checked against the ranks given (``nproc``; None: the plan's own count),
    the model and this machine's memory. Raises ValueError naming ``--plan`` and the setting."""
    from tensorpar.planner.enumerate import score
    from tensorpar.planner.layout import problems

    lay, position = check_plan_file(path, nproc, nproc_source)
    if position > 1:
        note = (f"plan #{position} of the file: the ones before it need what tensorpar train does not run"
                + (f"; {note}" if note else ""))
    nproc = lay.num_devices
    model, cluster, work, assume = planner_inputs(cfg, model_config, device, nproc,
                                                  local_nproc if local_nproc and nproc % local_nproc == 0 else None)
    broken = [p for p in problems(lay, model, cluster, work, assume) if p.rule != "tp-node"]
    if broken:
        raise ValueError(f"--plan {path}: the layout does not fit --model {cfg.model} with --batch-size "
                         f"{cfg.batch_size} --seq-len {cfg.seq_len}: " + "; ".join(p.message for p in broken))
    plan = score(lay, model, cluster, work, assume)
    if not plan.fits:
        raise ValueError(f"--plan {path}: {lay.short()} needs {plan.memory.total / 2 ** 30:.2f} GiB per rank, more "
                         f"than the {plan.usable_bytes / 2 ** 30:.2f} GiB usable here; use more ranks or a smaller "
                         f"batch")
    run_cfg = layout_config(cfg, lay, work.global_batch)
    why = runtime_problem(run_cfg, model_config)
    if why:
        raise ValueError(f"--plan {path}: {why}")
    return Choice(plan, run_cfg, device, str(path), note)


# ---------------------------------------------------------------- measuring a run


class PeakMemory:
    """Peak memory of this rank while training, above what it held before the model was built.

    * CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (the caching allocator's
      tensors; what the planner models), minus the bytes allocated at the start;
    * CPU: the resident-set high-water mark ``VmHWM`` of ``/proc/self/status``, reset to the current resident
      set at the start by writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0), minus the resident set at
      the start. It counts the allocator's retained pages and library buffers too. Where the reset is not
      possible, ``getrusage``'s ``ru_maxrss`` (the process's lifetime peak) is used and ``method`` says so.
    """

    def __init__(self, device):
        import torch

        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            self.method = "torch.cuda.max_memory_allocated"
            return
        self.base = _status_kib("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.method = "RSS high-water (VmHWM, reset at start)"
        except OSError:
            self.method = "RSS high-water (ru_maxrss, process lifetime)"
        self.base = (self.base or 0) * 1024

    def peak_bytes(self) -> int:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device) - self.base)
        hwm = _status_kib("VmHWM")
        if hwm is None or "ru_maxrss" in self.method:
            import resource
            hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return max(0, int(hwm * 1024 - self.base))


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def measured_step_time(step_times: list[float], warmup: int = WARMUP_STEPS) -> tuple[float, int]:
    """``(median seconds, steps counted)`` of the steps after ``warmup`` (all of them if too few)."""
    kept = step_times[warmup:] if len(step_times) > warmup else step_times
    return (statistics.median(kept) if kept else float("nan")), len(kept)


def relative_error(predicted: float, measured: float) -> float:
    """``(predicted - measured) / measured``: negative when the planner is optimistic."""
    return (predicted - measured) / measured if measured else float("nan")


def comparison_line(prediction: dict, medians: list[float], counted: int, peaks: list[tuple]) -> str:
    """Predicted vs measured step time (each rank's median after warm-up; the slowest rank's) and peak memory per
    rank (the largest): the tensors' peak where measured (CUDA allocator, or the second step's live tensors on a
    CPU), else the resident-set growth. ``peaks``: per rank ``(bytes, method)``."""
    t, n = max(medians), counted
    mem, method = max(peaks, key=lambda p: p[0]) if peaks else (0, "not measured")
    pt, pm = prediction["step_time_s"], prediction["memory_bytes"]
    per_rank = ", ".join(_mib(p[0]) for p in peaks)
    return (f"plan vs measured: step time predicted {pt * 1e3:.1f} ms, measured {t * 1e3:.1f} ms (median of {n} "
            f"steps after {WARMUP_STEPS} warm-up, slowest rank; error {100 * relative_error(pt, t):+.0f}%); peak "
            f"memory per rank predicted {_mib(pm)}, measured {_mib(mem)} ({method}; ranks [{per_rank}]; "
            f"error {100 * relative_error(pm, mem):+.0f}%)")


def gather_measurements(ctx, step_times: list[float], rss_peak: int, tensor_peak: int | None = None):
    """``(every rank's median step time, steps counted, every rank's (peak bytes, how measured))`` on every rank
    (one all-gather of JSON over all ranks). The peak is ``tensor_peak`` when given, else ``rss_peak``."""
    import torch.distributed as dist

    med, n = measured_step_time(step_times)
    how = ("live tensors of the second step, parameters and optimizer state" if tensor_peak is not None else
           "resident-set growth since the model was built" if ctx.device.type == "cpu" else
           "torch.cuda.max_memory_allocated")
    mine = (med, (tensor_peak if tensor_peak is not None else rss_peak, how))
    if ctx.world_size == 1 or not dist.is_initialized():
        return [med], n, [mine[1]]
    from tensorpar.comm import all_gather_json
    box = all_gather_json(mine, dist.group.WORLD)  # JSON, not all_gather_object: nothing from a peer is unpickled
    return [b[0] for b in box], n, [tuple(b[1]) for b in box]


def step_with_tensor_peak(trainer):
    """``(trainer.train_step(), peak bytes)``: the step runs under
    :func:`tensorpar.planner.calibrate.peak_memory_bytes` (every operator's outputs tracked until freed), and the
    peak of live tensors above the parameters and the optimizer state is added to their bytes: weights,
    gradients, optimizer state and activations, what the planner's memory model counts. Run it on a step after
    the first (AdamW makes its state in the first step, so only later steps hold it during backward). Slower
    than a plain step."""
    import torch

    from tensorpar.planner.calibrate import peak_memory_bytes

    held = list(trainer.params) + [t for st in trainer.optimizer.state.values() for t in st.values()
                                   if isinstance(t, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}
    r, above = peak_memory_bytes(trainer.train_step, baseline=held)
    return r, sum(storages.values()) + above


def describe_device_source(path: Path, cached: bool) -> str:
    return f"calibration {'read from' if cached else 'measured now, saved to'} {path}"


def env_nproc() -> tuple[int | None, int | None]:
    """(WORLD_SIZE, LOCAL_WORLD_SIZE) under torchrun, else (None, None)."""
    from tensorpar.launch import under_torchrun

    if not under_torchrun():
        return None, None
    world = int(os.environ["WORLD_SIZE"])
    return world, int(os.environ.get("LOCAL_WORLD_SIZE", world))


