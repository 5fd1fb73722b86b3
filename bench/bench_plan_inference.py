"""`tensorpar plan --inference` against measured `tensorpar generate` on this machine (issue 15.3).

Measures, in fresh worker processes with one thread per rank:
1. this machine as the planner sees it, without running the model (the four decode constants by
   ``tensorpar.planner.calibrate.decode_device.measure_decode_constants``, what ``generate --plan auto`` measures
   and caches; uncached here):
   * matmul rate and copy bandwidth (``hbm_gbps``; reported, not used by decode once the read rate is measured);
   * ``decode_read_gbps``: the one-row matmul (GEMV) read rate of the model's own tp = 1 weight shapes, one
     process alone; ``decode_read_host_gbps``: the same at the tp = 2 rank's shapes with 2 processes reading at
     once, times 2 (``calibrate.measure_decode_reads``: private random matrices, net of the per-call dispatch);
   * ``decode_collective_us``: what one collective adds to the same GEMV passes when the decode step's
     ``2 x layers + 3`` collectives are interleaved where the lean path runs them (gloo, and the shared-memory
     collectives): latency, the wait for the slower rank and the reads it slows;
   * ``layer_overhead_us``: greedy decode of the same architecture with 8-wide matrices on the lean path (the
     path `tensorpar generate` runs for this model), tp = 1, divided by its layers;
   * for reference, the idle loopback all-reduce latency (gloo's 4 KiB sample of ``measure_collectives``, the
     median of 200 shared-memory all-reduces of one hidden state), the previous model's link latency;
2. greedy decode ms/token of `tensorpar generate` (``bench_generate.job_tp``) at tp = 1 and at tp = 2
   over gloo and over the shared-memory collectives;

then plans the same decode with those measured device numbers and prints predicted vs measured. No constant is
taken from the runs being predicted. Noisy on a shared machine: the load average is recorded.

    python bench/bench_plan_inference.py [--model smollm2] [--tokens 32] [--out bench/results]

Writes ``plan_inference.json`` and ``plan_inference.md`` under ``--out`` (atomically).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _device_job(ctx):
    import torch

    from tensorpar.planner.calibrate import measure_matmul, measure_memory_bandwidth
    torch.set_num_threads(1)
    _, matmul = measure_matmul(min_seconds=0.2)
    return {"matmul_tflops": max(m["tflops"] for m in matmul), "hbm_gbps": measure_memory_bandwidth()}


def _shm_latency_job(ctx, hidden):
    """Median seconds of one shared-memory all-reduce of a decode step's hidden state (fp32)."""
    import statistics

    import torch

    from tensorpar import comm
    from tensorpar.shm import enable_fast_collectives
    torch.set_num_threads(1)
    enable_fast_collectives(ctx.tp, "on")
    x = torch.randn(1, 1, hidden)
    for _ in range(20):
        comm.all_reduce(x, ctx.tp)
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        comm.all_reduce(x, ctx.tp)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    a = p.parse_args()

    from bench_generate import PROMPT, job_tp

    from tensorpar.decode.floor import floor_job
    from tensorpar.hub import resolve_model
    from tensorpar.planner.calibrate import measure_collectives, measure_decode_reads
    from tensorpar.planner.calibrate.decode_device import decode_shapes, measure_decode_constants
    from tensorpar.planner.cluster import ClusterSpec, DeviceSpec
    from tensorpar.planner.inference import InferenceWorkload, plan_one
    from tensorpar.planner.model_spec import from_hf_config
    from tensorpar.testing import WorkerPool

    folder = str(resolve_model(a.model))
    model = from_hf_config(Path(folder) / "config.json", name=a.model)

    def one(world, fn, *args):
        with WorkerPool(world, collective_timeout_s=120, job_timeout_s=1200) as pool:
            return pool.run(fn, *args)[0]

    load0 = os.getloadavg()[0]
    dev = one(1, _device_job)
    link = measure_collectives()
    shm_latency = one(2, _shm_latency_job, model.hidden_size)
    # the library's decode constants (what generate --plan auto measures and caches), shared memory in the step;
    # the same step over gloo for the gloo rows
    constants = measure_decode_constants(model, json.loads((Path(folder) / "config.json").read_text()), 2, "shm",
                                         floor_job, tokens=a.tokens)
    floor = {"step_ms": constants["floor_step_ms"], "path": constants["floor_path"]}
    reads = {"alone_tp1": constants["reads"]["alone_tp1"], f"{constants['backend']}_tp2": constants["reads"]["shared"]}
    reads["shared_tp2"] = reads[f"{constants['backend']}_tp2"]
    if "gloo_tp2" not in reads:
        reads["gloo_tp2"] = measure_decode_reads(*decode_shapes(model, 2), 2, "gloo")
        reads["gloo_tp2"].pop("ranks")
    reads.setdefault("shm_tp2", reads["gloo_tp2"])  # no shared-memory collectives here: measured over gloo
    measured = {("tp=1", 1): one(1, job_tp, folder, a.tokens, 1, False),
                ("tp=2 gloo", 2): one(2, job_tp, folder, a.tokens, 1, False),
                ("tp=2 shm", 2): one(2, job_tp, folder, a.tokens, 1, True)}
    load1 = os.getloadavg()[0]

    gloo_latency_us = link["samples"][0]["seconds"] * 1e6  # the smallest message: decode all-reduces are latency
    links = {"tp=1": (gloo_latency_us, "gloo", reads["gloo_tp2"]["collective_us"]),
             "tp=2 gloo": (gloo_latency_us, "gloo", reads["gloo_tp2"]["collective_us"]),
             "tp=2 shm": (shm_latency * 1e6, "shared memory", reads["shm_tp2"]["collective_us"])}

    def device_for(name: str) -> DeviceSpec:
        latency, what, in_step = links[name]
        return DeviceSpec(
            name="this machine, 1 thread per rank", memory_gib=16.0, peak_tflops=dev["matmul_tflops"],
            intra_node_gbps=0.0, inter_node_gbps=0.0, matmul_efficiency=1.0, hbm_gbps=dev["hbm_gbps"],
            local_link_gbps=link["bandwidth_gbps"], local_link_latency_us=latency,
            local_link_label=f"{what} loopback, measured", layer_overhead_us=constants["layer_overhead_us"],
            decode_read_gbps=constants["decode_read_gbps"], decode_read_host_gbps=constants["decode_read_host_gbps"],
            decode_collective_us=in_step)
    from transformers import AutoTokenizer

    prompt_tokens = len(AutoTokenizer.from_pretrained(folder)(PROMPT)["input_ids"])
    work = InferenceWorkload(batch=1, prompt_len=prompt_tokens, max_new_tokens=a.tokens, weight_bytes=4, kv_bytes=4)
    rows = []
    for (name, tp), run in measured.items():
        device = device_for(name)
        plan = plan_one(model, tp, ClusterSpec(device, tp, tp), work)
        rows.append({"config": name, "tp": tp, "link_latency_us": device.local_link_latency_us, "measured_ms": run["step_ms"], "predicted_ms": plan.decode * 1e3,
                     "error": plan.decode * 1e3 / run["step_ms"] - 1,
                     "predicted_parts_ms": {"memory": plan.decode_memory * 1e3, "compute": plan.decode_compute * 1e3,
                                            "tp_comm": plan.decode_comm * 1e3, "overhead": plan.decode_overhead * 1e3},
                     "measured_comm_ms_in_run": run["comm_ms_per_token_in_run"],
                     "measured_collectives_per_token": run["collectives_per_token"]})
    meta = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "model": a.model, "new_tokens": a.tokens,
            "prompt": PROMPT, "dtype": "fp32", "date": time.strftime("%Y-%m-%d %H:%M"),
            "load_average_before_after": [round(load0, 1), round(load1, 1)],
            "device": asdict(device_for("tp=1")), "shm_allreduce_us": shm_latency * 1e6,
            "gloo_allreduce_4kib_us": gloo_latency_us, "floor_step_ms": floor["step_ms"], "floor_path": floor["path"],
            "decode_reads": reads,
            "devices_by_config": {name: asdict(device_for(name)) for name in links}}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "plan_inference.json.tmp"
    tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    os.replace(tmp, out / "plan_inference.json")
    loaded = max(load0, load1) > (os.cpu_count() or 1)
    lines = ([f"**Loaded run (load average above the {os.cpu_count()} cores): the measured times are dominated by "
              "waiting for a core and are not a validation of the planner.**", ""] if loaded else []) + [
             f"`tensorpar plan --inference` vs measured `tensorpar generate` (1 thread per rank, greedy, "
             f"{a.tokens} tokens, fp32, {a.model}); {meta['machine']}, {meta['date']}, load average "
             f"{load0:.1f} before, {load1:.1f} after.", "",
             f"Measured device: matmul {dev['matmul_tflops'] * 1e3:.1f} GFLOP/s, copy bandwidth {dev['hbm_gbps']:.1f} GB/s "
             "(not used by decode); one-row matmul reads at the model's shapes (net of "
             f"{reads['alone_tp1']['dispatch_us']:.0f} us/token dispatch): {reads['alone_tp1']['gbps']:.1f} GB/s at "
             f"tp=1 alone (`decode_read_gbps`), {reads['shared_tp2']['gbps']:.1f} GB/s per rank at tp=2 with 2 "
             f"processes = {reads['shared_tp2']['host_gbps']:.1f} GB/s host (`decode_read_host_gbps`); one collective "
             f"inside the decode step (`decode_collective_us`): {reads['gloo_tp2']['collective_us']:.0f} us gloo, "
             f"{reads['shm_tp2']['collective_us']:.0f} us shared memory (idle loopback all-reduce: "
             f"{gloo_latency_us:.0f} us gloo, {shm_latency * 1e6:.0f} us shared memory); framework floor of the lean "
             f"path {floor['step_ms']:.1f} ms/token = {floor['step_ms'] * 1e3 / model.num_layers:.0f} us per layer "
             "(`layer_overhead_us`).", "",
             "| configuration | measured ms/token | predicted ms/token | error | predicted: memory | compute | TP comm | "
             "overhead | measured comm in run | collectives/token |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        q = r["predicted_parts_ms"]
        lines.append(f"| {r['config']} | {r['measured_ms']:.1f} | {r['predicted_ms']:.1f} | {100 * r['error']:+.1f}% | "
                     f"{q['memory']:.1f} | {q['compute']:.1f} | {q['tp_comm']:.1f} | {q['overhead']:.1f} | "
                     f"{r['measured_comm_ms_in_run']:.1f} | {r['measured_collectives_per_token']:.0f} |")
    tmp = out / "plan_inference.md.tmp"
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, out / "plan_inference.md")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
