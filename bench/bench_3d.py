"""3D-parallel training benchmark: every (tp, pp, dp) layout of 4 ranks on this machine, next to the planner's
prediction for the same layout, and the pipeline bubble measured against (P-1)/(M+P-1).

    python bench/bench_3d.py            # writes bench/results/3d.json and bench/results/3d.md (~5-10 min)

One launch of 4 gloo ranks (one thread each) runs every layout in turn, each on its own process groups over the
same ranks: (tp, pp, dp) in (4,1,1) (2,2,1) (2,1,2) (1,4,1) (1,2,2) (1,1,4), with the 1F1B and GPipe schedules
where pp > 1 and the interleaved 1F1B schedule at pp = 2 (4 layers = 4 chunks). The model is the ``small``
preset (hidden 256, 4 layers, 8 heads / 4 KV heads, tied embedding, byte vocabulary 256), fp32 AdamW, batch 8 x
seq 128, random tokens (the data does not change the step time). Per layout and rank:

* step time: median of the timed steps after warm-up (the slowest rank's median); tokens/s from it;
* peak memory per rank, two ways: the live tensors of the second step tracked by a dispatch mode
  (:func:`tensorpar.train.autoplan.step_with_tensor_peak`: weights, gradients, optimizer state, activations,
  pipeline buffers; the second step is the first that holds AdamW's state during backward; what the planner's
  memory model counts) and the resident-set growth since the model was
  built (``VmHWM`` reset at the layout's start; includes the allocator's retained pages and library buffers);
* the planner's prediction for the same layout (micro-batch = batch / (dp M), no recomputation, v = 2 for the
  interleaved schedule) on the calibrated device of ``tensorpar train --plan auto`` (cached calibration of this
  machine, one rank's share of it: :func:`tensorpar.train.autoplan.rank_device`). The planner models 1F1B: for
  GPipe its time is the same and its memory too low (GPipe keeps all M micro-batches' activations).

Bubble: for pp = 2 and 4 (1F1B, micro-batches of one sequence), the forward-backward time of a step
(``ParallelTrainer.forward_backward``: the schedule, without gradient completion and optimizer) at M = P, 2P, 4P
is fitted as ``a + s M``; in the model ``T_fb(M) = (M + P - 1) t``, so ``a / s`` estimates P - 1 and
``a / T_fb(M)`` the bubble fraction, next to (P-1)/(M+P-1).

The machine has 2 cores shared with other users, and 4 ranks share them: times are noisy; the load average at
start and end is recorded. With more ranks than cores, a stage that waits frees its core for another stage, so the
bubble costs less than on one device per rank.
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

from tensorpar.parallel import ParallelConfig  # noqa: E402
from tensorpar.testing import WorkerPool  # noqa: E402
from tensorpar.train.config import TrainConfig, preset_config  # noqa: E402

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
    from tensorpar.pipeline.trainer import ParallelTrainer
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
        if r["pp"] == r["dp"] == r["micro_batches"] == 1:
            tr = Trainer(cfg, sub.tp, model, plan, data)
        else:
            tr = ParallelTrainer(cfg, sub, model, plan, data)
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
        first = tr.train_step()
        second, tensor_peak = step_with_tensor_peak(tr)   # holds the optimizer state made by the first step
        times = [first.time_s, second.time_s] + [tr.train_step().time_s for _ in range(steps - 2)]
        results.append({"step_times": times, "fb_times": fb, "tensor_peak": tensor_peak,
                        "rss_growth": peak.peak_bytes(), "loss": first.loss})
        del tr
    return results[1:]


def predict(r: dict, device) -> dict:
    from tensorpar.planner.enumerate import score
    from tensorpar.planner.layout import Layout
    from tensorpar.train import autoplan

    cfg = TrainConfig(model="small", seq_len=r["seq"], batch_size=r["batch"])
    inputs = autoplan.planner_inputs(cfg, preset_config("small", VOCAB, r["seq"]), device, 4)
    lay = Layout(tp=r["tp"], pp=r["pp"], dp=r["dp"], micro_batch=r["batch"] // (r["dp"] * r["micro_batches"]),
                 virtual_stages=2 if r["schedule"] == "interleaved-1f1b" else 1)
    plan = score(lay, *inputs)
    return {"step_time_s": plan.cost.step.total, "memory_bytes": plan.memory.total,
            "bubble_s": plan.cost.step.bubble, "breakdown_s": plan.cost.step.as_dict()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="steps per run (the first --warmup are not timed)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="passes over all runs (interleaved); the step time is the "
                                                         "median of the rounds' medians, their spread is reported")
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
    device = autoplan.rank_device(cal, 4, load_now=os.getloadavg()[0])
    run_list = runs(a.batch, a.seq)
    t0 = time.perf_counter()
    with WorkerPool(4, collective_timeout_s=300.0, job_timeout_s=3000.0) as pool:
        rounds = [pool.run(job, run_list, a.steps, a.warmup) for _ in range(a.rounds)]
    wall = time.perf_counter() - t0
    load_end = os.getloadavg()

    rows = []
    for i, r in enumerate(run_list):
        per_round, fb_round = [], []
        for per_rank in rounds:
            ranks = [per_rank[k][i] for k in range(4)]
            per_round.append(max(statistics.median(x["step_times"][a.warmup:]) for x in ranks))  # slowest rank
            fb = [statistics.median(x["fb_times"][a.warmup:]) for x in ranks if x["fb_times"]]
            fb_round.append(max(fb) if fb else None)
        ranks = [rounds[0][k][i] for k in range(4)]  # memory: the first round's (the same every round)
        step = statistics.median(per_round)
        pred = predict(r, device)
        rows.append({**r, "step_time_s": step, "step_time_rounds_s": per_round,
                     "fb_time_s": statistics.median(fb_round) if fb_round[0] is not None else None,
                     "tokens_per_s": r["batch"] * r["seq"] / step,
                     "tensor_peak_bytes_per_rank": [x["tensor_peak"] for x in ranks],
                     "rss_growth_bytes_per_rank": [x["rss_growth"] for x in ranks],
                     "predicted": pred,
                     "step_time_error": autoplan.relative_error(pred["step_time_s"], step),
                     "memory_error": autoplan.relative_error(pred["memory_bytes"],
                                                             max(x["tensor_peak"] for x in ranks))})

    # bubble fits
    bubbles = []
    for tp, pp, dp in [(2, 2, 1), (1, 4, 1)]:
        sweep = [r for r in rows if r["kind"] == "bubble" and (r["tp"], r["pp"], r["dp"]) == (tp, pp, dp)]
        ms = [r["micro_batches"] for r in sweep]
        ts = [r["fb_time_s"] for r in sweep]
        mx, my = statistics.mean(ms), statistics.mean(ts)
        slope = sum((m - mx) * (t - my) for m, t in zip(ms, ts)) / sum((m - mx) ** 2 for m in ms)
        icpt = my - slope * mx
        bubbles.append({"tp": tp, "pp": pp, "dp": dp, "fit_intercept_s": icpt, "fit_slope_s": slope,
                        "idle_in_micro_batches": icpt / slope if slope > 0 else None, "expected_idle": pp - 1,
                        "points": [{"M": m, "fb_time_s": t, "measured_bubble": icpt / (icpt + slope * m),
                                    "theory_bubble": (pp - 1) / (m + pp - 1),
                                    "predicted_bubble": r["predicted"]["bubble_s"] / r["predicted"]["step_time_s"]}
                                   for m, t, r in zip(ms, ts, sweep)]})

    # the planner's own choice for these 4 ranks (what --plan auto would run), for the record
    cfg = TrainConfig(model="small", seq_len=a.seq, batch_size=a.batch)
    choice = autoplan.choose_auto(cfg, preset_config("small", VOCAB, a.seq), device, 4)
    found = search(*autoplan.planner_inputs(cfg, preset_config("small", VOCAB, a.seq), device, 4))

    # the same predictions without the load correction (as on an idle machine), for comparison
    idle = autoplan.rank_device({**cal, "loadavg_1min": 0.0}, 4)
    for r in rows:
        r["predicted_idle_machine_s"] = predict(r, idle)["step_time_s"]
        r["step_time_error_idle_machine"] = autoplan.relative_error(r["predicted_idle_machine_s"], r["step_time_s"])
    errs_t = [r["step_time_error"] for r in rows if r["kind"] == "layout"]
    errs_m = [r["memory_error"] for r in rows if r["kind"] == "layout" and r["schedule"] != "gpipe"]
    layout_rows = [r for r in rows if r["kind"] == "layout"]
    fastest = min(layout_rows, key=lambda r: r["step_time_s"])
    c = choice.cfg
    chosen = [r for r in layout_rows if (r["tp"], r["pp"], r["dp"]) == (c.tp, c.pp, c.dp)
              and r["schedule"] in ("-", c.schedule) and r["micro_batches"] == c.micro_batches]
    summary = {
        "step_time_error": _dist(errs_t), "memory_error_1f1b": _dist(errs_m),
        "step_time_error_idle_machine_model": _dist([r["step_time_error_idle_machine"] for r in rows
                                                     if r["kind"] == "layout"]),
        "planner_choice": choice.summary(), "fitting_layouts": len(found.ranked),
        "measured_fastest": {k: fastest[k] for k in ("tp", "pp", "dp", "micro_batches", "schedule", "step_time_s")},
        "planner_choice_measured_s": chosen[0]["step_time_s"] if chosen else None,
    }
    meta = {"date": started, "machine": f"{os.cpu_count()} CPUs, {platform.machine()}", "torch": torch.__version__,
            "loadavg_start": [round(v, 2) for v in load_start], "loadavg_end": [round(v, 2) for v in load_end],
            "wall_s": round(wall, 1), "rounds": a.rounds, "steps": a.steps, "warmup": a.warmup, "batch": a.batch,
            "seq": a.seq,
            "model": "small preset (hidden 256, 4 layers, 8 heads / 4 KV, MLP 688, tied, vocab 256), fp32 AdamW",
            "calibration": {k: v for k, v in cal.items() if k not in ("matmul", "collective")} | {
                "allreduce_latency_us": cal["collective"]["latency_us"],
                "allreduce_bandwidth_gbps": cal["collective"]["bandwidth_gbps"],
                "measured": "from the cache" if cached else "at the start of this run"},
            "device_per_rank": {k: getattr(device, k) for k in ("name", "memory_gib", "peak_tflops", "hbm_gbps",
                                                                "train_layer_overhead_us",
                                                                "train_micro_batch_overhead_us")}}
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
    lines = [
        "# 3D layouts of 4 ranks: measured vs the planner (bench/bench_3d.py)", "",
        f"Model: {m['model']}; batch {m['batch']} x seq {m['seq']} = {m['batch'] * m['seq']} tokens/step; "
        f"{m['steps']} steps per run, the first {m['warmup']} not timed, {m['rounds']} rounds; all runs in one "
        f"launch of 4 gloo ranks "
        f"(1 thread each) on {m['machine']}, torch {m['torch']}; {m['date']}, {m['wall_s']} s.",
        f"**Load average (1, 5, 15 min) {m['loadavg_start']} at start, {m['loadavg_end']} at the end**: 4 ranks "
        f"share 2 cores that other users also use, so step times are noisy (several x when the load is high).",
        "",
        f"Planner device (one rank's share of the machine calibrated {m['calibration']['measured']}, as "
        f"`tensorpar train --plan auto` sees it): "
        f"{d['name']}; {d['peak_tflops'] * 1e3:.1f} GFLOP/s, copy {d['hbm_gbps']:.2f} GB/s, "
        f"{d['memory_gib']:.1f} GiB, fixed {d['train_layer_overhead_us'] / 1e3:.2f} ms per layer and "
        f"{d['train_micro_batch_overhead_us'] / 1e3:.2f} ms per micro-batch (forward + backward); all-reduce "
        f"{m['calibration']['allreduce_latency_us']:.0f} us + bytes / "
        f"{m['calibration']['allreduce_bandwidth_gbps']:.2f} "
        f"GB/s.",
        "",
        "Memory: *tensors* = peak of live tensors during the second step (the first that holds AdamW's state) plus "
        "the parameters and optimizer state (dispatch-mode tracking; what the planner models); *RSS* = resident-set "
        "high-water growth since the model was built (VmHWM).",
        "",
        "Step time: per round, the median of the timed steps of the slowest rank; the table gives the median over "
        "the rounds and, in brackets, each round's value (their spread is the noise of this machine).",
        "",
        "| tp | pp | dp | M | schedule | step ms (measured) | rounds | predicted | error | tokens/s | tensors "
        "MiB/rank (max) | predicted | error | RSS growth MiB/rank (max) |",
        "|---:|---:|---:|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in p["rows"]:
        if r["kind"] != "layout":
            continue
        pr = r["predicted"]
        lines.append(
            f"| {r['tp']} | {r['pp']} | {r['dp']} | {r['micro_batches']} | {r['schedule']} | "
            f"{r['step_time_s'] * 1e3:.0f} | {', '.join(f'{t * 1e3:.0f}' for t in r['step_time_rounds_s'])} | "
            f"{pr['step_time_s'] * 1e3:.0f} | {100 * r['step_time_error']:+.0f}% | "
            f"{r['tokens_per_s']:,.0f} | {_mib(max(r['tensor_peak_bytes_per_rank']))} | {_mib(pr['memory_bytes'])} | "
            f"{100 * r['memory_error']:+.0f}% | {_mib(max(r['rss_growth_bytes_per_rank']))} |")
    et, em = s["step_time_error"], s["memory_error_1f1b"]
    lines += [
        "",
        f"**Planner error on this machine** (predicted - measured) / measured, over the {et['n']} layout runs: step "
        f"time mean |error| {100 * et['mean_abs']:.0f}% (median {100 * et['median_abs']:.0f}%, max "
        f"{100 * et['max_abs']:.0f}%, mean signed {100 * et['mean_signed']:+.0f}%); memory (tensors, {em['n']} runs "
        f"without GPipe) mean |error| {100 * em['mean_abs']:.0f}% (median {100 * em['median_abs']:.0f}%, max "
        f"{100 * em['max_abs']:.0f}%).",
        f"Without the load correction (every thread assumed alone with the 4 ranks on the cores, as on an idle "
        f"machine) the step-time error would be mean |error| "
        f"{100 * s['step_time_error_idle_machine_model']['mean_abs']:.0f}% (mean signed "
        f"{100 * s['step_time_error_idle_machine_model']['mean_signed']:+.0f}%).",
        f"The planner's own choice for 4 ranks ({s['fitting_layouts']} layouts fit): {s['planner_choice']}",
        "",
        f"Measured fastest: tp={s['measured_fastest']['tp']} pp={s['measured_fastest']['pp']} "
        f"dp={s['measured_fastest']['dp']} M={s['measured_fastest']['micro_batches']} "
        f"{s['measured_fastest']['schedule']}, {s['measured_fastest']['step_time_s'] * 1e3:.0f} ms"
        + (f"; the planner's choice measured {s['planner_choice_measured_s'] * 1e3:.0f} ms in this run."
           if s['planner_choice_measured_s'] else "; the planner's choice is not among the measured layouts."),
        "",
        "## Pipeline bubble", "",
        "Forward-backward time of a step (the schedule only) at M = P, 2P, 4P micro-batches of one sequence, 1F1B, "
        "fitted as a + s M; the model says a / s = P - 1 and bubble = a / T_fb(M).", "",
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
