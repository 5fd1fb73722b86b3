"""Ranks that share a host's CPU cores: processor sharing, and the pipeline schedule run under it.

On a GPU each rank has a device of its own, and a pipeline stage that waits leaves its device idle: the bubble
is ``(p-1)/(v m)`` of the ideal time (Narayanan et al. 2021, section 2.2). On a CPU host with more runnable
threads than cores (4 ranks on 2 cores here) the operating system shares the cores among the runnable threads
(Linux CFS: an equal share of CPU time to every runnable thread of equal weight, the processor-sharing model of
queueing theory, Kleinrock 1967), and a rank that blocks in a receive (gloo's TCP pair waits on a condition
variable, it does not spin) gives its share to the others. Then:

* while all ``n`` ranks of the host run, each of their threads gets ``min(1, cores / (n k + e))`` of a core
  (``k`` threads per rank, ``e`` other users' runnable threads), or, where the kernel shares the CPU among
  scheduling groups (Linux autogroup: one per session), the cores are shared equally among the groups first:
  :func:`thread_share`;
* during a pipeline's fill and drain fewer stages are runnable and they run faster, so the bubble costs less
  than ``(p-1)/v`` micro-batch times. :func:`pipeline_makespan` runs the schedule's operations (the per-rank
  order of torch.distributed.pipelining's GPipe, 1F1B and interleaved 1F1B, :func:`schedule_order`) through an
  event simulation in which every runnable stage progresses at the speed of the share of the moment.

Pure Python (no torch); used by :mod:`tensorpar.planner.cost` only for a device with ``host_cores`` > 0
(:func:`shared_core_step`: a training step's time under it).
"""
from __future__ import annotations

from typing import Callable


def thread_share(runnable_threads: float, cores: float, external_threads: float = 0.0,
                 external_groups: float = 0.0) -> float:
    """Fraction of a core that each of our ``runnable_threads`` threads gets on ``cores`` cores while other users'
    ``external_threads`` threads also run (1 when nothing runs).

    * ``external_groups`` 0: every runnable thread gets an equal share (CFS without groups):
      ``min(1, cores / (runnable + external))``;
    * ``external_groups`` > 0: Linux's autogroup (``/proc/sys/kernel/sched_autogroup_enabled``) or cgroups share
      the CPU equally among *scheduling groups* (a session each), then among a group's threads. Our threads are one
      group (one launch), the others' ``external_threads`` are spread over ``external_groups`` groups. The cores
      are water-filled: every group gets an equal level ``L`` of cores, a group needing less (fewer runnable
      threads than ``L``) keeps only what it needs, and the rest is shared by the others; our threads then get
      ``min(1, our cores / runnable)`` each.

    Raises ValueError for cores <= 0 or a negative count.
    """
    if cores <= 0 or runnable_threads < 0 or external_threads < 0 or external_groups < 0:
        raise ValueError(f"thread_share: cores ({cores!r}) must be > 0 and thread and group counts "
                         f"({runnable_threads!r}, {external_threads!r}, {external_groups!r}) >= 0")
    if runnable_threads == 0:
        return 1.0
    if external_groups <= 0 or external_threads <= 0:
        total = runnable_threads + external_threads
        return 1.0 if total <= cores else cores / total
    counts = {runnable_threads: 1.0}
    other = external_threads / external_groups
    counts[other] = counts.get(other, 0.0) + external_groups
    # water-filling over the distinct demands, smallest first
    left, groups = float(cores), sum(counts.values())
    level = None
    for demand in sorted(counts):
        if demand * groups <= left:  # every remaining group can have this much: the smallest are satisfied
            left -= demand * counts[demand]
            groups -= counts[demand]
            continue
        level = left / groups
        break
    ours = runnable_threads if level is None else min(runnable_threads, level)
    return min(1.0, ours / runnable_threads)


def core_sharing_ranks(cluster) -> int:
    """Ranks that share one machine's ``host_cores``: a node's (``devices_per_node``), or the device's
    ``machine_ranks`` where several nodes are one machine (namespace or container hosts), at most the cluster's."""
    return min(cluster.num_devices, max(cluster.devices_per_node, cluster.device.machine_ranks))


def schedule_order(schedule: str, pp: int, virtual: int, micro_batches: int) -> list[list[tuple[str, int, int]]]:
    """Per pipeline rank, its operations in the order it runs them: ``("F" | "B", micro-batch, chunk)``.

    * ``gpipe``: every forward, then every backward;
    * ``1f1b``: ``min(p - 1 - r, m)`` warm-up forwards on rank r, then one forward and one backward alternately,
      then the remaining backwards (Narayanan et al. 2021, section 2.2; torch's ``Schedule1F1B``);
    * ``interleaved-1f1b`` (``virtual`` chunks per rank, ``m`` a multiple of ``p``): ``(v-1) p + 2 (p-1-r)``
      warm-up forwards; the k-th forward of a rank is micro-batch ``(k // (p v)) p + k % p`` on chunk
      ``(k // p) % v``, the k-th backward the same micro-batch on chunk ``v - 1 - (k // p) % v`` (Narayanan et
      al. 2021, section 2.2.1; torch's ``ScheduleInterleaved1F1B``).

    Chunk c of rank r is virtual stage ``c p + r``. Raises ValueError for an unknown schedule or an interleaved
    schedule whose ``m`` is not a multiple of ``p``.
    """
    p, v, m = pp, virtual, micro_batches
    if schedule == "gpipe" or (schedule == "1f1b" and v == 1):
        if v != 1:
            raise ValueError(f"schedule {schedule!r} runs one chunk per rank, not virtual={v}")
        out = []
        for r in range(p):
            fwd = [("F", i, 0) for i in range(m)]
            bwd = [("B", i, 0) for i in range(m)]
            if schedule == "gpipe":
                out.append(fwd + bwd)
                continue
            warm = min(p - 1 - r, m)
            order = fwd[:warm]
            for i in range(m - warm):
                order += [fwd[warm + i], bwd[i]]
            out.append(order + bwd[m - warm:])
        return out
    if schedule not in ("1f1b", "interleaved-1f1b"):
        raise ValueError(f"schedule {schedule!r}: use gpipe, 1f1b or interleaved-1f1b")
    if m % p:
        raise ValueError(f"interleaved 1F1B needs micro_batches ({m}) to be a multiple of pp ({p})")
    total = m * v
    out = []
    for r in range(p):
        def mb(k: int) -> int:
            return (k // (p * v)) * p + k % p
        fwd = [("F", mb(k), (k // p) % v) for k in range(total)]
        bwd = [("B", mb(k), v - 1 - (k // p) % v) for k in range(total)]
        warm = min((v - 1) * p + 2 * (p - 1 - r), total)
        order = fwd[:warm]
        for i in range(total - warm):
            order += [fwd[warm + i], bwd[i]]
        out.append(order + bwd[total - warm:])
    return out


def pipeline_makespan(order: list[list[tuple[str, int, int]]], forward: list[list[float]],
                      backward: list[list[float]], hop_seconds: float,
                      speed: Callable[[int], float]) -> float:
    """Seconds from the first forward to the last backward of a pipeline whose ranks share cores.

    Args:
        order: per rank, its operations (:func:`schedule_order`).
        forward, backward: ``[rank][chunk]`` seconds of one micro-batch's forward / backward of that chunk when the
            rank runs at full speed (its threads each alone on a core).
        hop_seconds: delay of a point-to-point send between ranks (latency and bytes over the link; it is not
            counted as work of either rank).
        speed: ``speed(n)`` = the fraction of its full speed at which each runnable rank progresses while ``n``
            of the pipeline's ranks are runnable (:func:`thread_share` of the threads they and the host's other
            ranks run).

    An operation is runnable when its input is there: the forward of virtual stage ``j > 0`` needs the same
    micro-batch's forward on stage ``j - 1`` (plus ``hop_seconds`` from another rank), the backward of stage
    ``j`` that of stage ``j + 1`` (the last stage's backward follows its own forward). Sends do not block.
    Raises RuntimeError if the order deadlocks (not for the orders of :func:`schedule_order`).
    """
    p = len(order)
    v = max(c for ops in order for _, _, c in ops) + 1
    last = p * v - 1
    done: dict[tuple[str, int, int], float] = {}  # (kind, micro-batch, virtual stage) -> finish time
    index = [0] * p
    left = [(forward if ops and ops[0][0] == "F" else backward)[r][ops[0][2]] if ops else 0.0
            for r, ops in enumerate(order)]
    now, eps = 0.0, 1e-15

    def ready_at(r: int) -> float | None:
        kind, i, c = order[r][index[r]]
        j = c * p + r
        if kind == "F":
            if j == 0:
                return 0.0
            dep, src = ("F", i, j - 1), (j - 1) % p
        else:
            if j == last:
                dep, src = ("F", i, j), r
            else:
                dep, src = ("B", i, j + 1), (j + 1) % p
        if dep not in done:
            return None
        return done[dep] + (hop_seconds if src != r else 0.0)

    while any(index[r] < len(order[r]) for r in range(p)):
        active = [r for r in range(p) if index[r] < len(order[r])]
        ready = {r: ready_at(r) for r in active}
        running = [r for r in active if ready[r] is not None and ready[r] <= now + eps]
        waiting = [ready[r] for r in active if ready[r] is not None and ready[r] > now + eps]
        if not running and not waiting:
            raise RuntimeError("pipeline schedule deadlocks: no rank can run its next operation")
        rate = speed(len(running)) if running else 0.0
        step = min([left[r] / rate for r in running] + [t - now for t in waiting])
        now += step
        for r in running:
            left[r] -= step * rate
            if left[r] <= 1e-12 * max(1.0, now):
                kind, i, c = order[r][index[r]]
                done[(kind, i, c * p + r)] = now
                index[r] += 1
                if index[r] < len(order[r]):
                    k2, _, c2 = order[r][index[r]]
                    left[r] = (forward if k2 == "F" else backward)[r][c2]
    return now


def shared_core_step(per_stage: list[tuple], slowest: int, after: tuple, p2p: float, layout, m: int,
                     cluster, wire_tp: bool = False):
    """:class:`~tensorpar.planner.cost.StepTime` of ``layout`` (a :class:`~tensorpar.planner.layout.Layout`, ``m``
    micro-batches) when the ranks of a node of ``cluster`` (a :class:`~tensorpar.planner.cluster.ClusterSpec`) share
    its ``host_cores`` CPU cores; :func:`tensorpar.planner.cost.step_cost` calls it for such a device.

    ``per_stage[i] = (micro-batch time, compute, tp, ep, forward part, cp)`` at full speed (every thread alone on a
    core). The schedule runs through :func:`~tensorpar.planner.sharing.pipeline_makespan` (pp = 1: ``m``
    micro-batches back to back), each runnable stage at the share of a core its threads get among the runnable
    ranks' threads (all the machine's: :func:`core_sharing_ranks`) and the host's other users' (``external_threads``
    in ``external_groups`` scheduling groups:
    :func:`~tensorpar.planner.sharing.thread_share`); the pipeline sends are delays between
    ranks. The per-step work after the last backward (TP step collectives, DP reduction, optimizer) runs on
    every rank at once. Reported: compute, TP and EP at the all-ranks-busy share, the sends, and as bubble what
    the schedule adds to that (0 when the freed cores make up for it; then the other terms are scaled to the
    schedule's time). ``wire_tp``: the tp group spans hosts over a link between them (``inter_node_*``), whose
    time is the wire's, not the cores': its collectives are taken out of the shared work and added unscaled, one
    after another with it (the stage waits for them).
    """
    from tensorpar.planner.cost import StepTime

    d = cluster.device
    t, p, v = layout.tp, layout.pp, layout.virtual_stages
    host_ranks = core_sharing_ranks(cluster)
    per_stage_ranks = host_ranks / p  # the dp replicas of a stage run in step with it

    def speed(running_stages: int) -> float:
        return thread_share(running_stages * per_stage_ranks * d.threads_per_rank, d.host_cores,
                            d.external_threads, d.external_groups)

    full = speed(p)
    hop = p2p / (2 * v)  # one send of the 2 v per micro-batch
    fwd, bwd = [], []
    for i, (micro, _c, tp_i, _e, forward, _cp) in enumerate(per_stage):
        work = micro - p2p
        if wire_tp:  # half of a layer's tp collectives run in its forward, half in its backward (hf kernels)
            work, forward = work - tp_i, forward - tp_i / 2
        f = [forward / v] * v
        b = [(work - forward) / v] * v
        fwd.append(f)
        bwd.append(b)
    schedule = "interleaved-1f1b" if v > 1 else "1f1b"
    makespan = pipeline_makespan(schedule_order(schedule, p, v, m), fwd, bwd, hop if p > 1 else 0.0, speed)
    _, compute, tp, ep, _, cp = per_stage[slowest]
    wire = m * tp if wire_tp else 0.0
    parts = [m * compute / full, 0.0 if wire_tp else m * tp / full, m * ep / full, m * p2p, m * cp / full]
    nominal = sum(parts)
    bubble = makespan - nominal
    if bubble < 0:  # freed cores made the schedule faster than all ranks busy all the time
        parts = [x * makespan / nominal for x in parts]
    if bubble < 1e-9 * nominal:  # none (or rounding)
        bubble = 0.0
    tp_once, dp, opt, cp_once = after
    return StepTime(compute=parts[0], tp_comm=parts[1] + wire + tp_once / (1 if wire_tp else full),
                    ep_comm=parts[2], pp_comm=parts[3],
                    bubble=bubble, dp_comm=dp / full, optimizer=opt / full, cp_comm=parts[4] + cp_once / full)
