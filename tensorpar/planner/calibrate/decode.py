"""The weight-read rate of a decode step's one-row matmuls at given per-rank shapes, with one or several
processes on this host reading at once, and what each of the step's collectives adds to it
(:func:`measure_decode_reads`; not run by :func:`~tensorpar.planner.calibrate.calibrate`: it needs the model's
shapes).
"""
from __future__ import annotations

import time


def _time_decode_reads(ctx, layer_shapes: tuple, layers: int, head_shape: tuple, collectives: str = "",
                       passes: int = 12) -> dict:
    """Job for :class:`tensorpar.testing.WorkerPool`: one rank's weight reads of a decode step, without the model.

    Each rank allocates its own fp32 matrices, ``layers`` x ``layer_shapes`` (``(out, in)`` each, in the order of
    the lean decode path's matmuls: fused QKV, attention output, fused gate-up, down) and ``head_shape`` (the
    LM head), and runs one token's one-row matmuls over them as :class:`tensorpar.decode.lean.LeanDecoder` does
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


def measure_int8_reduce(ctx, hidden: int, calls: int = 200) -> dict:
    """Job for :class:`tensorpar.testing.WorkerPool` (one rank): the CPU time (this thread's) of one ``--tp-comm
    int8`` all-reduce's own work at a decode step's ``[1, hidden]`` fp32 partial, without the wire
    (:func:`tensorpar.comm.compress.all_reduce_int8` less its all-gather): quantize into the payload, dequantize two
    ranks' payloads, sum them. The median of 5 timings of ``calls`` calls after 50 warm-up calls. Returns
    ``{"int8_reduce_cpu_us"}``. No collectives."""
    import statistics

    import torch

    from tensorpar.comm.compress import decode_sum, encode

    torch.set_num_threads(1)
    x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(0))

    def one():                  # all_reduce_int8 less its all-gather, for 2 ranks
        payload = encode(x)
        return decode_sum(torch.stack([payload, payload]), hidden)

    for _ in range(50):
        one()
    times = []
    for _ in range(5):
        t0 = time.thread_time()
        for _ in range(calls):
            one()
        times.append((time.thread_time() - t0) / calls)
    return {"int8_reduce_cpu_us": statistics.median(times) * 1e6}
