"""One rank's device for the planner, from this machine's calibration (:func:`rank_device`).

A CUDA rank gets the calibrated GPU as measured; a CPU rank gets one rank's rates alone on the host, with the
cores, threads per rank and other users' threads that the planner's processor-sharing model needs; the links
are the calibration's measured all-reduce fits of the backends the trainer's groups use (:func:`collective_fit`).
"""
from __future__ import annotations

from tensorpar.train.autoplan.calibration import calibration_path


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
                backend: str = "gloo", tp_backend: str | None = None, machine_ranks: int | None = None):
    """One rank's :class:`~tensorpar.planner.cluster.DeviceSpec` from a calibration (module docstring).

    ``backend``: the collectives of the pipeline and data-parallel groups (the trainer's: gloo); ``tp_backend``:
    those of the tensor-parallel group when it differs ("shm" where the trainer installs tensorpar.shm on it; None:
    the same as ``backend``). Each is the calibration's measured fit of that backend, labelled as this machine's
    local link.

    ``machine_ranks``: the ranks of the run on this machine's cores where they outnumber ``local_nproc`` (hosts
    that are namespaces or containers of one machine: :func:`tensorpar.launch.machine_ranks`; None: the local
    ranks): they all share ``cores`` in the planner's processor sharing, and the memory.

    ``load_now``: the 1-minute load average before the ranks start (None: an idle machine). On a CPU the rates
    are one rank's *alone* on the host (the threads it runs: ``TENSORPAR_THREADS`` where set, else
    ``max(1, cores // ranks)``, :func:`tensorpar.launch.rank_thread_count`, each on a core), and the
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
    machine = max(local, machine_ranks or 0)  # the ranks sharing this machine's cores and memory
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
    from tensorpar.launch import rank_thread_count

    cores = cal["cores"]
    threads = rank_thread_count(local, cores)  # the ranks' rule: TENSORPAR_THREADS where set
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
    where = f"1 of {local} ranks on {cores} cores" if machine == local else \
        f"1 of {machine} ranks on this machine's {cores} cores ({local} per host)"
    return DeviceSpec(f"calibrated {cal['backend'].split(' (')[0]}, {where}, {threads} thread(s){load}",
                      cal["memory_gib"] / machine, cal["matmul_tflops"] / s_cal * threads, 0.0, 0.0,
                      matmul_efficiency=cal.get("layer_matmul_efficiency", 1.0),
                      hbm_gbps=cal["hbm_gbps"] / s_cal * threads,
                      train_layer_overhead_us=cal["train_layer_overhead_us"] * s_cal,
                      train_micro_batch_overhead_us=cal["train_micro_batch_overhead_us"] * s_cal,
                      p2p_link_gbps=overhead["p2p_link_gbps"], p2p_link_latency_us=overhead["p2p_link_latency_us"],
                      pipeline_p2p_op_cpu_us=overhead["pipeline_p2p_op_cpu_us"],
                      pipeline_p2p_op_cpu_shared_us=overhead["pipeline_p2p_op_cpu_shared_us"],
                      optimizer_ns_per_param=cal.get("optimizer_ns_per_param", 0.0) * s_cal / threads,
                      host_cores=float(cores), threads_per_rank=threads, external_threads=ext_now,
                      machine_ranks=machine if machine > local else 0, **link)
