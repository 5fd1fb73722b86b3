"""Context parallelism (``--cp``): activation memory per rank, step time and the ring's exposed communication at
cp = 1, 2, 4, and the longest sequence that fits an activation budget at cp = 1 and at cp = 4.

    PYTHONPATH=. python bench/bench_cp.py            # writes bench/results/cp.{json,md}

Model: a random Llama (hidden 128, 2 layers, 4 query / 2 KV heads of 32, MLP 256, byte vocabulary 256), fp32,
batch 1, tensorpar's trainer (ring attention unless stated), AdamW; each rank one thread.

Activation memory per rank, two measures, both on the second training step (the first allocated the AdamW state):

* saved: the bytes autograd keeps for backward during the step (every saved tensor's storage once, parameters
  excluded: ``bench_train.SavedBytes`` under ``torch.autograd.graph.saved_tensors_hooks``). Exact and
  independent of load; the planner's activation model (``tensorpar.planner.memory``) predicts this quantity.
* peak: the rise of the process's resident memory during the step: the peak (``VmHWM`` of ``/proc/self/status``,
  reset with ``/proc/self/clear_refs`` just before the step) minus the resident memory just before it (weights,
  AdamW moments, the collectives' buffers and the interpreter are already resident then, so they cancel). It also
  holds what saved misses: attention's working memory (the ring's score blocks), the gradients while they
  exist (0.9 MiB here) and allocator slack. glibc is told to serve every allocation above 64 KiB by mmap
  (``MALLOC_MMAP_THRESHOLD_``), so freed memory leaves the process at once and the resident size follows the live
  tensors. This is the measure the activation budget (``--cap-mib``) is checked against.

Step time: the median of the timed steps (slowest rank). cp = 2 runs 2 ranks on the machine's 2 cores; cp = 4 runs
4 ranks on 2 cores (oversubscribed, so its step time is not a speed result); the load average is recorded at
start and end. The ring's exposed communication: seconds the rank waited for a hop to arrive (the cp group's
counter, ``send``) against the seconds inside the ring attention function (forward and backward, all layers).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, vocab_size=256, tie_word_embeddings=True)
MMAP_THRESHOLD = 65536


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _peak_rise(fn) -> tuple[int, object]:
    """Run ``fn()``; the peak resident bytes during it minus the resident bytes just before."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                       # resets VmHWM to the current resident size
    base = _status("VmRSS")
    out = fn()
    return _status("VmHWM") - base, out


class _RingClock:
    """Wall seconds inside the ring attention's forward and backward (the functions patched for the job)."""

    def __init__(self):
        from tensorpar.layers import ring_attention as ra
        self.ra, self.seconds = ra, 0.0
        self.orig = (ra._RingAttention._forward, ra._RingAttention._backward)

        def timed(f):
            def run(*a):
                t0 = time.perf_counter()
                try:
                    return f(*a)
                finally:
                    self.seconds += time.perf_counter() - t0
            return staticmethod(run)
        ra._RingAttention._forward, ra._RingAttention._backward = timed(self.orig[0]), timed(self.orig[1])

    def close(self):
        self.ra._RingAttention._forward, self.ra._RingAttention._backward = (staticmethod(f) for f in self.orig)


def job(ctx, seq: int, mode: str, timed_steps: int) -> dict:
    import torch
    from transformers import LlamaConfig

    from bench.bench_train import SavedBytes
    from tensorpar import comm
    from tensorpar.train.config import TrainConfig
    from tensorpar.train.data import TrainData
    from tensorpar.train.loop import Trainer
    from tensorpar.train.model import ModelSource, build_model

    cfg = TrainConfig(cp=ctx.cp.size, cp_mode=mode, seq_len=seq, batch_size=1, steps=2 + 2 * timed_steps,
                      warmup_steps=1, dtype="float32")
    g = torch.Generator().manual_seed(0)
    vocab = MODEL["vocab_size"]
    data = TrainData.from_tokens(torch.randint(0, vocab, (max(40 * seq, 100_000),), generator=g), vocab,
                                 val_fraction=0.05, source="random")
    config = LlamaConfig(max_position_embeddings=seq, rms_norm_eps=1e-5, **MODEL)
    model, plan = build_model(cfg, ModelSource(config, None, None), ctx.tp, vocab, cp=ctx.cp)
    tr = Trainer(cfg, ctx, model, plan, data)
    tr.train_step()                                          # AdamW state allocated
    meter = SavedBytes(tr.params)
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda t: t):
        peak, _ = _peak_rise(tr.train_step)
    params = sum(p.numel() * p.element_size() for p in tr.params)
    times, exposed, ring = [], [], []
    clock = _RingClock()
    try:
        for _ in range(timed_steps):
            t0 = time.perf_counter()
            tr.train_step()
            times.append(time.perf_counter() - t0)
        for _ in range(timed_steps if ctx.cp.size > 1 else 0):
            clock.seconds = 0.0
            with comm.counting(ctx.cp) as c:
                tr.train_step()
            exposed.append(c.exposed_seconds())
            ring.append(clock.seconds)
    finally:
        clock.close()
    return dict(rank=ctx.rank, saved=meter.total, peak=peak, params=params, times=times, exposed=exposed,
                ring_s=ring)


def measure(pools, cp: int, seq: int, mode: str, timed_steps: int) -> dict:
    per_rank = pools(cp).run(job, seq, mode, timed_steps)
    times = [max(ts) for ts in zip(*[r["times"] for r in per_rank])]
    row = dict(cp=cp, mode=mode, seq=seq, saved_mib=max(r["saved"] for r in per_rank) / 2 ** 20,
               peak_mib=max(r["peak"] for r in per_rank) / 2 ** 20,
               params_mib=per_rank[0]["params"] / 2 ** 20,
               step_s_median=statistics.median(times) if times else None, step_s_all=times)
    if cp > 1 and per_rank[0]["exposed"]:
        # per counted step: the rank that waited longest; the ring's time on that rank
        steps = list(zip(*[list(zip(r["exposed"], r["ring_s"])) for r in per_rank]))
        waits = [max(e.get("send", 0.0) + e.get("all_to_all", 0.0) for e, _ in s) for s in steps]
        ring = [max(t for _, t in s) for s in steps]
        grads = [max(e.get("all_reduce", 0.0) for e, _ in s) for s in steps]
        row.update(exposed_attention_comm_s=statistics.median(waits), exposed_grad_allreduce_s=statistics.median(grads))
        if mode == "ring":   # the clock times the ring's function only
            row["attention_s"] = statistics.median(ring)
    print(json.dumps({k: v for k, v in row.items() if k != "step_s_all"}), flush=True)
    return row


def planner_saved_mib(cp: int, seq: int, mode: str) -> float:
    """The planner's activation bytes per rank (fp32, Hugging Face kernels, sdpa at cp = 1) for the bench model."""
    from tensorpar.planner.layout import Assumptions, Layout, Workload
    from tensorpar.planner.memory import memory_per_device
    from tensorpar.planner.model_spec import from_dims

    spec = from_dims(layers=MODEL["num_hidden_layers"], hidden=MODEL["hidden_size"],
                     heads=MODEL["num_attention_heads"], kv_heads=MODEL["num_key_value_heads"],
                     ffn=MODEL["intermediate_size"], vocab=MODEL["vocab_size"], head_dim=MODEL["head_dim"],
                     tied_embeddings=MODEL["tie_word_embeddings"])
    lay = Layout(1, 1, 1, 1, cp=cp, cp_mode=mode)
    m = memory_per_device(spec, lay, Workload(1, seq),
                          Assumptions(activation_bytes=4, param_bytes=4, grad_bytes=4, attention="sdpa"))
    return m.activations / 2 ** 20


def _machine() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), "")
    return {"cpu": model or platform.processor(), "cores": os.cpu_count()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=8192, help="sequence of the cp = 1, 2, 4 comparison")
    ap.add_argument("--cap-mib", type=float, default=256.0, help="activation budget per rank (peak rise), MiB")
    ap.add_argument("--ladder", default="4096,8192,12288,16384,24576,32768",
                    help="sequence lengths tried against the budget, ascending")
    ap.add_argument("--timed-steps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cp"))
    ap.add_argument("--report-only", action="store_true",
                    help="rewrite the .md from the .json (measurements kept; the planner's columns computed again)")
    args = ap.parse_args()
    out = Path(args.out)
    if args.report_only:
        result = json.loads(out.with_suffix(".json").read_text())
        _planner_columns(result)
        out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        out.with_suffix(".md").write_text(report(result))
        print(report(result))
        return

    from tensorpar.parallel import ParallelConfig
    from tensorpar.testing import WorkerPool

    load_start = os.getloadavg()
    made: dict = {}

    def pools(n):
        if n not in made:
            made[n] = WorkerPool(n, ParallelConfig(cp=n), collective_timeout_s=600.0, job_timeout_s=3600.0)
        return made[n]
    rows, ladder = [], []
    try:
        for cp, mode in ((1, "ring"), (2, "ring"), (2, "all2all"), (4, "ring")):
            rows.append(measure(pools, cp, args.seq, mode, args.timed_steps))
        for cp in (1, 4):
            for seq in (int(s) for s in args.ladder.split(",")):
                row = measure(pools, cp, seq, "ring", 0)
                row["fits"] = row["peak_mib"] <= args.cap_mib
                ladder.append(row)
                if not row["fits"]:
                    break
    finally:
        for p in made.values():
            p.close()
    load_end = os.getloadavg()
    longest = {cp: max((r["seq"] for r in ladder if r["cp"] == cp and r["fits"]), default=0) for cp in (1, 4)}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    result = dict(commit=commit, date=datetime.now(timezone.utc).isoformat(timespec="seconds"), machine=_machine(),
                  load_start=load_start, load_end=load_end, model=MODEL, seq=args.seq, cap_mib=args.cap_mib,
                  rows=rows, ladder=ladder, longest_within_cap=longest)
    _planner_columns(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(report(result))
    print(report(result))


def _planner_columns(result: dict) -> None:
    """The planner's saved bytes of every row and the ratios to cp = 1 (in place)."""
    for r in result["rows"] + result["ladder"]:
        r["planner_saved_mib"] = planner_saved_mib(r["cp"], r["seq"], r["mode"])
    base = result["rows"][0]
    for r in result["rows"]:
        r["saved_vs_cp1"], r["peak_vs_cp1"] = r["saved_mib"] / base["saved_mib"], r["peak_mib"] / base["peak_mib"]
        r["planner_vs_cp1"] = r["planner_saved_mib"] / base["planner_saved_mib"]


def report(res: dict) -> str:
    m = res["machine"]
    lines = [
        "# Context parallelism: activation memory, step time, longest sequence (bench/bench_cp.py)", "",
        f"Random Llama (hidden 128, 2 layers, 4 query / 2 KV heads of 32, MLP 256, vocab 256), fp32, batch 1, one "
        f"thread per rank; commit {res['commit']}, {res['date']}; {m['cpu']}, {m['cores']} cores; load average "
        f"{res['load_start'][0]:.2f} at start, {res['load_end'][0]:.2f} at end. cp = 4 is 4 processes on "
        f"{m['cores']} cores: its step time is oversubscribed, not a speed result. With a load average above the core "
        f"count the step times measure the machine's other work as much as cp; the memory columns are the result.",
        "", "Saved: bytes autograd keeps for backward (exact; what the planner predicts). Peak: rise of resident "
        "memory during a step over the resident memory before it (weights and AdamW state cancel; includes "
        "attention's working memory and the gradients, 0.9 MiB; it can come out a little below saved when pages freed "
        "by the previous step are reused without growing the process). Both per rank, the largest rank. Exposed "
        "attention comm: seconds a rank waited in the ring's hops (ring) or in the all-to-alls (all2all), against "
        "the seconds inside the ring's attention function (ring s/step); under this load a wait is mostly for the "
        "peer to be scheduled, not for the wire.", "",
        f"## Sequence {res['seq']}", "",
        "| cp | mode | saved MiB | vs cp=1 | planner MiB | planner vs cp=1 | peak MiB | vs cp=1 | step s (median) "
        "| ring s/step | exposed attention comm s/step | cp grad all-reduce s/step |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)
    for r in res["rows"]:
        lines.append(f"| {r['cp']} | {r['mode'] if r['cp'] > 1 else '-'} | {r['saved_mib']:.1f} | "
                     f"{r['saved_vs_cp1']:.3f} | {r['planner_saved_mib']:.1f} | {r['planner_vs_cp1']:.3f} | "
                     f"{r['peak_mib']:.1f} | {r['peak_vs_cp1']:.3f} | {f(r['step_s_median'], '.2f')} | "
                     f"{f(r.get('attention_s'), '.2f')} | {f(r.get('exposed_attention_comm_s'), '.3f')} | "
                     f"{f(r.get('exposed_grad_allreduce_s'), '.3f')} |")
    lines += ["", f"## Longest sequence within an activation budget of {res['cap_mib']:.0f} MiB per rank (peak)", "",
              "| cp | seq | peak MiB | saved MiB | planner saved MiB | fits |", "|---:|---:|---:|---:|---:|---|"]
    for r in res["ladder"]:
        lines.append(f"| {r['cp']} | {r['seq']} | {r['peak_mib']:.1f} | {r['saved_mib']:.1f} | "
                     f"{r['planner_saved_mib']:.1f} | {'yes' if r['fits'] else 'no'} |")
    lo = res["longest_within_cap"]
    lines += ["", f"Longest sequence trained within the budget: {lo['1']} at cp = 1, {lo['4']} at cp = 4." if
              isinstance(next(iter(lo)), str) else
              f"Longest sequence trained within the budget: {lo[1]} at cp = 1, {lo[4]} at cp = 4.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("TENSORPAR_THREADS", "1")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD))   # read by each rank's glibc at start
    main()
