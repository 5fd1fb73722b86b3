"""3D-parallel training benchmark: every (tp, pp, dp) layout of 4 ranks on this machine, next to the planner's
prediction for the same layout, and the pipeline bubble measured against (P-1)/(M+P-1).

    python bench/bench_3d.py            # writes bench/results/3d.json and bench/results/3d.md (~5-10 min)

One launch of 4 gloo ranks (one thread each) runs every layout in turn, each on its own process groups over the
same ranks: (tp, pp, dp) in (4,1,1) (2,2,1) (2,1,2) (1,4,1) (1,2,2) (1,1,4), with the 1F1B and GPipe schedules
where pp > 1 and the interleaved 1F1B schedule at pp = 2 (4 layers = 4 chunks). The model is the ``small``
preset (hidden 256, 4 layers, 8 heads / 4 KV heads, tied embedding, byte vocabulary 256), fp32 AdamW, batch 8 x
seq 128, random tokens (the data does not change the step time). Per layout and rank:

* step time: a step's time is its slowest rank's; the best of the timed steps after warm-up over all rounds (best
  of N: the step least disturbed by the other users of this shared machine) next to the planner on an idle machine,
  and their median next to the planner given the cores that other users kept busy while the run lasted
  (:class:`tensorpar.train.autoplan.CompetitionSampler`); tokens/s from the best; the 1-minute load average at
  the start of each run (rank 0's reading, which includes the 4 ranks); the CPU time of a step summed over the
  ranks, next to the planner's work;
* peak memory per rank, two ways: the live tensors of the second step tracked by a dispatch mode
  (:func:`tensorpar.train.autoplan.step_with_tensor_peak`: weights, gradients, optimizer state, activations,
  pipeline buffers; the second step is the first that holds AdamW's state during backward; what the planner's
  memory model counts) and the resident-set growth since the model was
  built (``VmHWM`` reset at the layout's start; includes the allocator's retained pages and library buffers);
* the planner's prediction for the same layout (micro-batch = batch / (dp M), no recomputation, v = 2 for the
  interleaved schedule) on the calibrated device of ``tensorpar train --plan auto`` (measured at the start of this
  run unless ``--cached``: :func:`tensorpar.train.autoplan.rank_device`, gloo collectives as this benchmark's
  groups use; the 4 ranks share the cores, :mod:`tensorpar.planner.sharing`). The planner models 1F1B: for
  GPipe its time is the same (under shared cores too) and its memory too low (GPipe keeps all M micro-batches'
  activations).

Bubble: for pp = 2 and 4 (1F1B, micro-batches of one sequence), the forward-backward time of a step
(``Trainer.forward_backward``: the schedule, without gradient completion and optimizer) at M = P, 2P, 4P
is fitted as ``a + s M``; in the model ``T_fb(M) = (M + P - 1) t``, so ``a / s`` estimates P - 1 and
``a / T_fb(M)`` the bubble fraction, next to (P-1)/(M+P-1).

The machine has 2 cores shared with other users, and 4 ranks share them: times are noisy; the load average at
start and end, and at each run, is recorded. With more ranks than cores, a stage that waits frees its core for
another stage, so the bubble costs less than on one device per rank (the planner models this).
"""
from __future__ import annotations

import argparse
import dataclasses
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

from tensorpar.parallel import ParallelConfig  # noqa: E402
from tensorpar.testing import WorkerPool  # noqa: E402
from tensorpar.train.config import TrainConfig  # noqa: E402
from tensorpar.hf.presets import preset_config

LAYOUTS = [(4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 4, 1), (1, 2, 2), (1, 1, 4)]
VOCAB = 256


def runs(batch: int, seq: int) -> list[dict]:
    """Every measured run: the layouts with their schedules, then the bubble sweeps."""
    from tensorpar.train.cli import default_micro_batches

    out = []
    for tp, pp, dp in LAYOUTS:
        m = default_micro_batches(pp, dp, batch)
        schedules = ["1f1b", "gpipe"] + (["interleaved-1f1b"] if pp == 2 else []) if pp > 1 else ["-"]
        for sched in schedules:
            out.append(dict(kind="layout", tp=tp, pp=pp, dp=dp, micro_batches=m, schedule=sched, batch=batch, seq=seq))
    for tp, pp, dp in [(2, 2, 1), (1, 4, 1)]:
        for m in (pp, 2 * pp, 4 * pp):
            out.append(dict(kind="bubble", tp=tp, pp=pp, dp=dp, micro_batches=m, schedule="1f1b", batch=dp * m,
                            seq=seq))
    return out


def _data():
    from tensorpar.train.data import TrainData

    g = torch.Generator().manual_seed(0)
    return TrainData.from_tokens(torch.randint(0, VOCAB, (200_000,), generator=g), VOCAB, val_fraction=0.05)


def job(ctx, run_list, steps: int, warmup: int):
    """On each of the 4 ranks: every run on its own groups; per run this rank's step times, forward-backward
    times, tensor peak and resident-set growth."""
    from tensorpar.parallel import init_parallel
    from tensorpar.train.autoplan import PeakMemory, step_with_tensor_peak
    from tensorpar.train.loop import Trainer
    from tensorpar.train.model import ModelSource, build_model

    data = _data()
    results = []
    for i, r in enumerate([run_list[0]] + run_list):   # the first run warms the processes up and is dropped
        sub = init_parallel(ParallelConfig(tp=r["tp"], pp=r["pp"], dp=r["dp"]), rank=ctx.rank,
                            world_size=ctx.world_size, backend="gloo", set_threads=False)
        cfg = TrainConfig(model="small", tp=r["tp"], pp=r["pp"], dp=r["dp"], micro_batches=r["micro_batches"],
                          schedule="1f1b" if r["schedule"] == "-" else r["schedule"], seq_len=r["seq"],
                          batch_size=r["batch"], steps=steps, warmup_steps=2, lr=1e-3)
        peak = PeakMemory(sub.device)
        model, plan = build_model(cfg, ModelSource(preset_config("small", VOCAB, r["seq"]), None, None), sub.tp,
                                  VOCAB)
        tr = Trainer(cfg, sub, model, plan, data)
        del model
        fb: list[float] = []
        if hasattr(tr, "forward_backward"):
            inner = tr.forward_backward

            def timed(*a, _inner=inner, **k):
                t0 = time.perf_counter()
                out = _inner(*a, **k)
                fb.append(time.perf_counter() - t0)
                return out
            tr.forward_backward = timed
        load_start, t_start = os.getloadavg()[0], time.time()
        first = tr.train_step()
        second, tensor_peak = step_with_tensor_peak(tr)   # holds the optimizer state made by the first step
        cpu0 = time.process_time()   # this rank's CPU time (all its threads: torch's and gloo's)
        times = [first.time_s, second.time_s] + [tr.train_step().time_s for _ in range(steps - 2)]
        results.append({"step_times": times, "fb_times": fb, "tensor_peak": tensor_peak,
                        "rss_growth": peak.peak_bytes(), "loss": first.loss,
                        "cpu_per_step": (time.process_time() - cpu0) / max(1, steps - 2),
                        "loadavg": [load_start, os.getloadavg()[0]], "wall_clock": [t_start, time.time()]})
        del tr
    return results[1:]


def predict(r: dict, device, shared: bool = True) -> dict:
    from tensorpar.planner.enumerate import score
    from tensorpar.planner.layout import Layout
    from tensorpar.train import autoplan

    cfg = TrainConfig(model="small", seq_len=r["seq"], batch_size=r["batch"])
    inputs = autoplan.planner_inputs(cfg, preset_config("small", VOCAB, r["seq"]), device, 4)
    if not shared:  # every rank at the all-busy share of the cores, one device per rank from there on
        from tensorpar.planner.sharing import thread_share

        f = thread_share(4 * device.threads_per_rank, device.host_cores, device.external_threads)
        d = dataclasses.replace(device, host_cores=0.0, peak_tflops=device.peak_tflops * f,
                                hbm_gbps=device.hbm_gbps * f,
                                train_layer_overhead_us=device.train_layer_overhead_us / f,
                                train_micro_batch_overhead_us=device.train_micro_batch_overhead_us / f,
                                pipeline_p2p_op_cpu_us=device.pipeline_p2p_op_cpu_us / f,
                                pipeline_p2p_op_cpu_shared_us=device.pipeline_p2p_op_cpu_shared_us / f,
                                optimizer_ns_per_param=device.optimizer_ns_per_param / f)
        inputs = (inputs[0], dataclasses.replace(inputs[1], device=d), *inputs[2:])
    lay = Layout(tp=r["tp"], pp=r["pp"], dp=r["dp"], micro_batch=r["batch"] // (r["dp"] * r["micro_batches"]),
                 virtual_stages=2 if r["schedule"] == "interleaved-1f1b" else 1)
    plan = score(lay, *inputs)
    return {"step_time_s": plan.cost.step.total, "memory_bytes": plan.memory.total,
            "bubble_s": plan.cost.step.bubble, "breakdown_s": plan.cost.step.as_dict()}


def predicted_cpu_seconds(r: dict, device) -> float:
    """The planner's CPU work of one step summed over the 4 ranks (core-seconds): under processor sharing a host
    with ``c`` cores, ``c`` -> 0, is always busy while any rank runs, so its step time x ``c`` is the total work."""
    c = 1e-6
    return predict(r, dataclasses.replace(device, host_cores=c, external_threads=0.0))["step_time_s"] * c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="steps per run (the first --warmup are not timed)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="passes over all runs (interleaved); the step time is the "
                                                         "best of the timed steps of all rounds (the one least "
                                                         "disturbed by other users), the median is reported too")
    ap.add_argument("--cached", action="store_true", help="use the cached calibration of --plan auto instead of "
                                                          "measuring now (under the load of this run)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "3d"))
    a = ap.parse_args()

    from tensorpar.planner.enumerate import search
    from tensorpar.train import autoplan

    load_start = os.getloadavg()
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    if a.cached:
        cal, _, cached = autoplan.cached_calibration(log=print)
    else:  # measured now, so that the calibration and the runs see a similar load (not saved in the cache)
        cal, cached = autoplan.quick_calibration(), False
    # the trainer's collectives in this benchmark: gloo on every group (init_parallel's fast_collectives="off")
    device = autoplan.rank_device(cal, 4, load_now=os.getloadavg()[0], backend="gloo")
    idle = autoplan.rank_device(cal, 4, backend="gloo")   # no other users' threads while the ranks run
    run_list = runs(a.batch, a.seq)
    t0 = time.perf_counter()
    with WorkerPool(4, collective_timeout_s=300.0, job_timeout_s=3000.0) as pool, \
            autoplan.CompetitionSampler(lambda: [p.pid for p in pool._procs], interval=0.5) as sampler:
        rounds = [pool.run(job, run_list, a.steps, a.warmup) for _ in range(a.rounds)]
    wall = time.perf_counter() - t0
    load_end = os.getloadavg()

    rows = []
    for i, r in enumerate(run_list):
        per_round, fb_round, steps_all, fb_all, loads, others, busy = [], [], [], [], [], [], []
        for per_rank in rounds:
            ranks = [per_rank[k][i] for k in range(4)]
            # a step's time is its slowest rank's (the ranks wait for each other in every step)
            step_max = [max(x["step_times"][j] for x in ranks) for j in range(a.warmup, a.steps)]
            steps_all += step_max
            per_round.append(statistics.median(step_max))
            if ranks[0]["fb_times"]:
                fb_max = [max(x["fb_times"][j] for x in ranks) for j in range(a.warmup, a.steps)]
                fb_all += fb_max
                fb_round.append(statistics.median(fb_max))
            loads.append(ranks[0]["loadavg"])
            others.append(sampler.mean_between(*ranks[0]["wall_clock"]))   # (threads, groups) or None
            busy.append(sampler.others_cores_between(*ranks[0]["wall_clock"]))   # cores the others kept busy
        ranks = [rounds[0][k][i] for k in range(4)]  # memory: the first round's (the same every round)
        best, step = min(steps_all), statistics.median(steps_all)
        # CPU-seconds of a step, summed over the 4 ranks (the lowest round: least disturbed); other users change the
        # wall time, not this (up to cache and context-switch effects)
        cpu = min(sum(per_rank[k][i]["cpu_per_step"] for k in range(4)) for per_rank in rounds)
        # the planner at the other users' runnable threads measured while this row ran (mean over its rounds)
        measured_others = [x for x in others if x is not None]
        ext = statistics.mean(x[0] for x in measured_others) if measured_others else 0.0
        groups = statistics.mean(x[1] for x in measured_others) if measured_others else 0.0
        taken = statistics.mean(x for x in busy if x is not None) if any(x is not None for x in busy) else 0.0
        # the planner given what the other users took: the cores they kept busy while the row ran are not ours
        pred = predict(r, dataclasses.replace(idle, host_cores=max(0.05, idle.host_cores - taken)))
        pred_idle = predict(r, idle)
        rows.append({**r, "step_time_best_s": best, "step_time_s": step, "step_time_rounds_s": per_round,
                     "timed_steps": len(steps_all), "loadavg_rounds": loads, "other_runnable_threads_rounds": others,
                     "other_runnable_threads": ext, "other_runnable_groups": groups,
                     "others_busy_cores_rounds": busy, "others_busy_cores": taken,
                     "fb_time_s": statistics.median(fb_all) if fb_all else None,
                     "fb_time_best_s": min(fb_all) if fb_all else None,
                     "tokens_per_s": r["batch"] * r["seq"] / best,
                     "tensor_peak_bytes_per_rank": [x["tensor_peak"] for x in ranks],
                     "rss_growth_bytes_per_rank": [x["rss_growth"] for x in ranks],
                     "predicted": pred, "predicted_idle_machine": pred_idle,
                     "step_time_error": autoplan.relative_error(pred_idle["step_time_s"], best),
                     "step_time_error_median_at_load": autoplan.relative_error(pred["step_time_s"], step),
                     "cpu_seconds_per_step": cpu, "predicted_cpu_seconds": predicted_cpu_seconds(r, idle),
                     "cpu_error": autoplan.relative_error(predicted_cpu_seconds(r, idle), cpu),
                     "memory_error": autoplan.relative_error(pred["memory_bytes"],
                                                             max(x["tensor_peak"] for x in ranks))})

    # bubble fits
    bubbles = []
    for tp, pp, dp in [(2, 2, 1), (1, 4, 1)]:
        sweep = [r for r in rows if r["kind"] == "bubble" and (r["tp"], r["pp"], r["dp"]) == (tp, pp, dp)]
        ms = [r["micro_batches"] for r in sweep]
        ts = [r["fb_time_best_s"] for r in sweep]
        mx, my = statistics.mean(ms), statistics.mean(ts)
        slope = sum((m - mx) * (t - my) for m, t in zip(ms, ts)) / sum((m - mx) ** 2 for m in ms)
        icpt = my - slope * mx
        bubbles.append({"tp": tp, "pp": pp, "dp": dp, "fit_intercept_s": icpt, "fit_slope_s": slope,
                        "idle_in_micro_batches": icpt / slope if slope > 0 else None, "expected_idle": pp - 1,
                        "points": [{"M": m, "fb_time_s": t, "measured_bubble": icpt / (icpt + slope * m),
                                    "theory_bubble": (pp - 1) / (m + pp - 1),
                                    "predicted_bubble": r["predicted_idle_machine"]["bubble_s"]
                                    / r["predicted_idle_machine"]["step_time_s"]}
                                   for m, t, r in zip(ms, ts, sweep)]})

    # the planner's own choice for these 4 ranks (what --plan auto would run), for the record
    cfg = TrainConfig(model="small", seq_len=a.seq, batch_size=a.batch)
    choice = autoplan.choose_auto(cfg, preset_config("small", VOCAB, a.seq), device, 4)
    found = search(*autoplan.planner_inputs(cfg, preset_config("small", VOCAB, a.seq), device, 4))

    # the earlier model, for comparison: every rank always at its share of the cores with all ranks busy (no core
    # freed by a waiting pipeline stage), i.e. the (p-1)/v bubble of one device per rank
    flat = dataclasses.replace(idle, external_threads=0.0)
    for r in rows:
        r["predicted_no_core_sharing_s"] = predict(r, flat, shared=False)["step_time_s"]
        r["step_time_error_no_core_sharing"] = autoplan.relative_error(r["predicted_no_core_sharing_s"],
                                                                       r["step_time_best_s"])
    errs_t = [r["step_time_error"] for r in rows if r["kind"] == "layout"]
    errs_cpu = [r["cpu_error"] for r in rows if r["kind"] == "layout"]
    errs_m = [r["memory_error"] for r in rows if r["kind"] == "layout" and r["schedule"] != "gpipe"]
    layout_rows = [r for r in rows if r["kind"] == "layout"]
    fastest = min(layout_rows, key=lambda r: r["step_time_best_s"])
    c = choice.cfg
    chosen = [r for r in layout_rows if (r["tp"], r["pp"], r["dp"]) == (c.tp, c.pp, c.dp)
              and r["schedule"] in ("-", c.schedule) and r["micro_batches"] == c.micro_batches]
    summary = {
        "step_time_error": _dist(errs_t), "memory_error_1f1b": _dist(errs_m), "cpu_error": _dist(errs_cpu),
        "step_time_error_median_at_load": _dist([r["step_time_error_median_at_load"] for r in rows
                                                 if r["kind"] == "layout"]),
        "step_time_error_no_core_sharing": _dist([r["step_time_error_no_core_sharing"] for r in rows
                                                  if r["kind"] == "layout"]),
        "planner_choice": choice.summary(), "fitting_layouts": len(found.ranked),
        "measured_fastest": {k: fastest[k] for k in ("tp", "pp", "dp", "micro_batches", "schedule",
                                                      "step_time_best_s")},
        "planner_choice_measured_s": chosen[0]["step_time_best_s"] if chosen else None,
    }
    meta = {"date": started, "machine": f"{os.cpu_count()} CPUs, {platform.machine()}", "torch": torch.__version__,
            "loadavg_start": [round(v, 2) for v in load_start], "loadavg_end": [round(v, 2) for v in load_end],
            "wall_s": round(wall, 1), "rounds": a.rounds, "steps": a.steps, "warmup": a.warmup, "batch": a.batch,
            "seq": a.seq,
            "model": "small preset (hidden 256, 4 layers, 8 heads / 4 KV, MLP 688, tied, vocab 256), fp32 AdamW",
            "calibration": {k: v for k, v in cal.items() if k not in ("matmul", "collective")} | {
                "allreduce_latency_us": cal["collective"]["latency_us"],
                "allreduce_bandwidth_gbps": cal["collective"]["bandwidth_gbps"],
                **({"shm_latency_us": cal["collective"]["by_backend"]["shm"]["latency_us"],
                    "shm_bandwidth_gbps": cal["collective"]["by_backend"]["shm"]["bandwidth_gbps"]}
                   if "shm" in cal["collective"].get("by_backend", {}) else {}),
                "measured": "from the cache" if cached else "at the start of this run"},
            "device_per_rank": {**{k: getattr(idle, k) for k in (
                "name", "memory_gib", "peak_tflops", "hbm_gbps", "train_layer_overhead_us",
                "train_micro_batch_overhead_us", "optimizer_ns_per_param", "local_link_gbps",
                "local_link_latency_us", "host_cores", "threads_per_rank", "p2p_link_gbps", "p2p_link_latency_us",
                "pipeline_p2p_op_cpu_us", "pipeline_p2p_op_cpu_shared_us")},
                "external_threads_at_start": device.external_threads}}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"meta": meta, "summary": summary, "rows": rows, "bubbles": bubbles}
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    os.replace(tmp, out.with_suffix(".json"))
    md = render(payload)
    tmp = out.with_suffix(".md.tmp")
    tmp.write_text(md)
    os.replace(tmp, out.with_suffix(".md"))
    print(md)


def _dist(errs: list[float]) -> dict:
    a = [abs(e) for e in errs]
    return {"n": len(errs), "mean_abs": statistics.mean(a), "median_abs": statistics.median(a), "max_abs": max(a),
            "mean_signed": statistics.mean(errs), "values": errs}


def _mib(b) -> str:
    return f"{b / 2 ** 20:.1f}"


def render(p: dict) -> str:
    m, s = p["meta"], p["summary"]
    d = m["device_per_rank"]
    c = m["calibration"]
    lines = [
        "# 3D layouts of 4 ranks: measured vs the planner (bench/bench_3d.py)", "",
        f"Model: {m['model']}; batch {m['batch']} x seq {m['seq']} = {m['batch'] * m['seq']} tokens/step; "
        f"{m['steps']} steps per run, the first {m['warmup']} not timed, {m['rounds']} rounds (interleaved: every "
        f"run once, then again); all runs in one launch of 4 gloo ranks "
        f"(1 thread each) on {m['machine']}, torch {m['torch']}; {m['date']}, {m['wall_s']} s.",
        f"**Load average (1, 5, 15 min) {m['loadavg_start']} at start, {m['loadavg_end']} at the end**; the 1-minute "
        f"load at the start of each row's runs is in the table (it includes this benchmark's own 4 ranks). 4 ranks "
        f"share 2 cores that other users also use, so step times are noisy.",
        "",
        f"Planner device: one rank *alone* on this machine, calibrated {c['measured']} (as `tensorpar train --plan "
        f"auto` measures it, load {c['loadavg_1min']:.1f} while measuring): {d['peak_tflops'] * 1e3:.1f} GFLOP/s "
        f"(square matmuls; a decoder layer's reach {c.get('layer_matmul_efficiency', 1.0):.2f} of it, measured), copy "
        f"{d['hbm_gbps']:.2f} GB/s, AdamW {d['optimizer_ns_per_param']:.1f} ns per parameter, fixed "
        f"{d['train_layer_overhead_us'] / 1e3:.2f} ms per layer and {d['train_micro_batch_overhead_us'] / 1e3:.2f} ms "
        f"per micro-batch (forward + backward), on 1 thread; all-reduce over gloo {d['local_link_latency_us']:.0f} us "
        f"+ bytes / {d['local_link_gbps']:.2f} GB/s (2 ranks"
        + (f"; shared memory: {c['shm_latency_us']:.0f} us + bytes / {c['shm_bandwidth_gbps']:.2f} GB/s, not used "
           f"by this benchmark's groups" if c.get("shm_latency_us") is not None else "")
        + f"); pipeline send/recv over gloo {d.get('p2p_link_latency_us', 0):.0f} us + bytes / "
        f"{d.get('p2p_link_gbps', 0):.2f} GB/s (0: the all-reduce's), and {d.get('pipeline_p2p_op_cpu_us', 0) / 1e3:.2f} "
        f"ms CPU per pipeline send or receive ({d.get('pipeline_p2p_op_cpu_shared_us', 0) / 1e3:.2f} ms with twice as "
        f"many ranks as cores, as here) "
        f"(`tensorpar.planner.calibrate.measure_pipeline`; 0 = not measured). The 4 ranks share {d['host_cores']:.0f} cores: processor sharing in the planner "
        f"(`tensorpar.planner.sharing`: each runnable thread gets min(1, cores / runnable threads), a waiting "
        f"pipeline stage frees its core).",
        "",
        "Memory: *tensors* = peak of live tensors during the second step (the first that holds AdamW's state) plus "
        "the parameters and optimizer state (dispatch-mode tracking; what the planner models); *RSS* = resident-set "
        "high-water growth since the model was built (VmHWM).",
        "",
        f"Step time: a step's time is its slowest rank's; **best** = the fastest of the "
        f"{p['rows'][0]['timed_steps']} timed steps over all rounds (best of N: the step least disturbed by other "
        f"users), compared with the planner on an idle machine (no other users' threads); *median* = the median of "
        f"those steps (per round in brackets), compared with the planner given the cores that the other users "
        f"*kept busy while the row ran* (column *others*: host busy time from /proc/stat minus this benchmark's "
        f"processes', per second, mean over the row's rounds; the planner's host then has 2 - others cores; in "
        f"brackets the other processes' runnable threads and their scheduling groups, Linux autogroup sessions, at "
        f"the 0.5 s samples of `tensorpar.train.autoplan.CompetitionSampler`). *load*: the 1-minute load average at "
        f"the start of each round's run (it includes the 4 ranks).",
        "",
        "| tp | pp | dp | M | schedule | load | others | step ms best | predicted (idle) | error | median (rounds) | "
        "predicted (others) | error | tokens/s (best) | tensors MiB/rank (max) | predicted | error | "
        "RSS growth MiB/rank (max) |",
        "|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in p["rows"]:
        if r["kind"] != "layout":
            continue
        pr, pi = r["predicted"], r["predicted_idle_machine"]
        load = "/".join(f"{x[0]:.1f}" for x in r["loadavg_rounds"])
        lines.append(
            f"| {r['tp']} | {r['pp']} | {r['dp']} | {r['micro_batches']} | {r['schedule']} | {load} | "
            f"{r['others_busy_cores']:.2f} ({r['other_runnable_threads']:.0f} in {r['other_runnable_groups']:.0f}) | "
            f"{r['step_time_best_s'] * 1e3:.0f} | {pi['step_time_s'] * 1e3:.0f} | {100 * r['step_time_error']:+.0f}% | "
            f"{r['step_time_s'] * 1e3:.0f} ({', '.join(f'{t * 1e3:.0f}' for t in r['step_time_rounds_s'])}) | "
            f"{pr['step_time_s'] * 1e3:.0f} | {100 * r['step_time_error_median_at_load']:+.0f}% | "
            f"{r['tokens_per_s']:,.0f} | {_mib(max(r['tensor_peak_bytes_per_rank']))} | {_mib(pr['memory_bytes'])} | "
            f"{100 * r['memory_error']:+.0f}% | {_mib(max(r['rss_growth_bytes_per_rank']))} |")
    et, em, el = s["step_time_error"], s["memory_error_1f1b"], s["step_time_error_median_at_load"]
    ns = s["step_time_error_no_core_sharing"]
    lines += [
        "",
        f"**Planner error on this machine** (predicted - measured) / measured, over the {et['n']} layout runs: step "
        f"time (best of N vs idle machine) mean |error| {100 * et['mean_abs']:.0f}% (median "
        f"{100 * et['median_abs']:.0f}%, max {100 * et['max_abs']:.0f}%, mean signed {100 * et['mean_signed']:+.0f}%); "
        f"median step vs the prediction given the cores the other users kept busy during the row: mean |error| "
        f"{100 * el['mean_abs']:.0f}% (median {100 * el['median_abs']:.0f}%, max "
        f"{100 * el['max_abs']:.0f}%, mean signed {100 * el['mean_signed']:+.0f}%); memory (tensors, {em['n']} runs "
        f"without GPipe) mean |error| {100 * em['mean_abs']:.0f}% (median {100 * em['median_abs']:.0f}%, max "
        f"{100 * em['max_abs']:.0f}%).",
        f"Without core sharing in the pipeline (every rank at the all-busy share of the cores throughout, the "
        f"(p-1)/v bubble of one device per rank; the model before this change, same calibration) the best-step "
        f"error would be mean |error| {100 * ns['mean_abs']:.0f}% (mean signed {100 * ns['mean_signed']:+.0f}%).",
        f"The planner's own choice for 4 ranks at the start's load ({s['fitting_layouts']} layouts fit): "
        f"{s['planner_choice']}",
        "",
        f"Measured fastest (best step): tp={s['measured_fastest']['tp']} pp={s['measured_fastest']['pp']} "
        f"dp={s['measured_fastest']['dp']} M={s['measured_fastest']['micro_batches']} "
        f"{s['measured_fastest']['schedule']}, {s['measured_fastest']['step_time_best_s'] * 1e3:.0f} ms"
        + (f"; the planner's choice measured {s['planner_choice_measured_s'] * 1e3:.0f} ms in this run."
           if s['planner_choice_measured_s'] else "; the planner's choice is not among the measured layouts."),
        "",
        "Predicted parts of each step (ms, idle machine): compute, TP collectives, pipeline sends, bubble, DP "
        "reduction, optimizer. CPU s/step: the CPU time of a step summed over the 4 ranks (`time.process_time`, all "
        "of a rank's threads; the lowest round), which other users change much less than the wall time, against the "
        "planner's work summed over the ranks (its step time on a host of c -> 0 cores, times c): mean |error| "
        f"{100 * s['cpu_error']['mean_abs']:.0f}% (mean signed {100 * s['cpu_error']['mean_signed']:+.0f}%).", "",
        "| tp | pp | dp | M | schedule | compute | tp | pp sends | bubble | dp | optimizer | total | measured best | "
        "CPU s/step, 4 ranks: predicted | measured | error |",
        "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in p["rows"]:
        if r["kind"] != "layout":
            continue
        b = r["predicted_idle_machine"]["breakdown_s"]
        lines.append(f"| {r['tp']} | {r['pp']} | {r['dp']} | {r['micro_batches']} | {r['schedule']} | "
                     + " | ".join(f"{b[k] * 1e3:.1f}" for k in ("compute", "tp_comm", "pp_comm", "bubble", "dp_comm",
                                                                   "optimizer"))
                     + f" | {r['predicted_idle_machine']['step_time_s'] * 1e3:.1f} | "
                       f"{r['step_time_best_s'] * 1e3:.1f} | {r['predicted_cpu_seconds']:.3f} | "
                       f"{r['cpu_seconds_per_step']:.3f} | {100 * r['cpu_error']:+.0f}% |")
    lines += [
        "",
        "## Pipeline bubble", "",
        "Forward-backward time of a step (the schedule only; best of N) at M = P, 2P, 4P micro-batches of one "
        "sequence, 1F1B, fitted as a + s M; with one device per rank the model says a / s = P - 1 and bubble = "
        "a / T_fb(M). The last column is the planner's bubble share of the whole step (shared cores, idle machine).",
        "",
        "| tp | pp | M | T_fb ms | measured bubble | (P-1)/(M+P-1) | planner's bubble share of the step |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b in p["bubbles"]:
        for pt in b["points"]:
            lines.append(f"| {b['tp']} | {b['pp']} | {pt['M']} | {pt['fb_time_s'] * 1e3:.0f} | "
                         f"{100 * pt['measured_bubble']:.0f}% | {100 * pt['theory_bubble']:.0f}% | "
                         f"{100 * pt['predicted_bubble']:.0f}% |")
    lines.append("")
    for b in p["bubbles"]:
        idle = b["idle_in_micro_batches"]
        lines.append(f"- tp={b['tp']} pp={b['pp']}: fitted idle = {idle:.2f} micro-batch times (P - 1 = "
                     f"{b['expected_idle']}); intercept {b['fit_intercept_s'] * 1e3:.0f} ms, slope "
                     f"{b['fit_slope_s'] * 1e3:.0f} ms per micro-batch." if idle is not None else
                     f"- tp={b['tp']} pp={b['pp']}: no positive slope (noise)")
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
