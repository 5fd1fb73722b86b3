"""`tensorpar generate --plan auto`'s time to first token (and decode) predicted against measured (issue 23.5):
SmolLM2 fp32 at tp = 1 and 2 on this host, prompts of about 16 and 512 tokens.

Each run is the command itself (``--plan auto --nproc N``: the planner's device from this machine's cached
calibration and decode/prefill constants, measured on first use) and its own ``plan vs measured`` line; the rows
are run ``--repeats`` times interleaved (load drift hits every row) and the median and the spread are shown, with
the 1-minute load average after each run. For reference the same plan's first token under the previous model (no
prefill constants: FLOPs at ``matmul_efficiency x peak`` or one read of the weights, the decode floor per layer) is
computed from the same device.

    TENSORPAR_THREADS=1 python bench/bench_plan_ttft.py [--repeats 3] [--new-tokens 8] [--out bench/results]

``TENSORPAR_THREADS`` (read by the ranks and by the planner) sets the threads per rank; one thread keeps a loaded
machine's OpenMP barriers out of the timings (two threads per rank on 2 shared cores were 10x slower).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

TEXT = ("The history of the city begins with a small settlement on the river, where traders met to exchange grain, "
        "salt and wool. Over the centuries the market grew into a town with walls, a cathedral and a university, ")
LINE = re.compile(r"decode per token ([\d.]+) ms predicted, ([\d.]+) measured.*first token ([\d.]+) ms predicted, "
                  r"([\d.]+) measured.*\(CPU ([\d.]+) ms")


def prompt_of(tok, n: int) -> tuple[str, int]:
    """A text of about ``n`` tokens and its token count."""
    ids = tok(TEXT * (n // 20 + 2))["input_ids"][:n]
    text = tok.decode(ids)
    return text, len(tok(text)["input_ids"])


def run(folder: str, nproc: int, text: str, new_tokens: int) -> dict:
    cmd = [sys.executable, "-m", "tensorpar", "generate", "--model", folder, "--plan", "auto", "--nproc", str(nproc),
           "--prompt", text, "--max-new-tokens", str(new_tokens)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    out = r.stdout + r.stderr
    m = LINE.search(out)
    if r.returncode or m is None:
        raise RuntimeError(f"generate --nproc {nproc} failed ({r.returncode}): {out[-2000:]}")
    dp, dm, fp, fm, fc = map(float, m.groups())
    return {"decode_predicted_ms": dp, "decode_measured_ms": dm, "ttft_predicted_ms": fp, "ttft_measured_ms": fm,
            "ttft_cpu_ms": fc,
            "load": os.getloadavg()[0]}


def planned(folder: str, nproc: int, prompt: int, new_tokens: int) -> dict:
    """The plan's first-token parts, and the previous model's first token, from the device ``--plan auto`` uses
    (read from the caches its runs filled)."""
    from transformers import AutoConfig

    from tensorpar.decode.floor import floor_job
    from tensorpar.planner.calibrate.decode_device import decode_device
    from tensorpar.planner.cluster import ClusterSpec
    from tensorpar.planner.inference import InferenceWorkload, plan_one
    from tensorpar.inference_plan import inference_device
    from tensorpar.planner.model_spec import from_hf_config

    config = AutoConfig.from_pretrained(folder).to_dict()
    model = from_hf_config(config, name="smollm2")
    device, _ = inference_device(argparse.Namespace(device_file=None, fast_collectives="auto"), nproc, nproc)
    device, _ = decode_device(device, model, config, nproc, "shm", floor_job)
    work = InferenceWorkload(1, prompt, new_tokens, weight_bytes=4, kv_bytes=4, reserve_gib=0)
    new = plan_one(model, nproc, ClusterSpec(device, nproc, nproc), work)
    old = plan_one(model, nproc, ClusterSpec(replace(device, prefill_tflops=0.0), nproc, nproc), work)
    return {"parts_ms": {k: round(v * 1e3, 2) for k, v in new.ttft_parts.items()}, "previous_model_ms": old.ttft * 1e3,
            "device": {k: getattr(device, k) for k in ("peak_tflops", "matmul_efficiency", "threads_per_rank",
                                                       "prefill_read_gbps", "prefill_tflops",
                                                       "prefill_attention_tflops", "prefill_layer_overhead_us",
                                                       "layer_overhead_us", "tp_link_gbps", "tp_link_latency_us")}}


def to_markdown(res: dict) -> str:
    m = res["meta"]
    lines = [f"# generate --plan auto: first token and decode, predicted vs measured — {m['date']}", "",
             f"SmolLM2-135M-Instruct fp32, greedy, {m['new_tokens']} new tokens, one host ({m['cpus']} cores, "
             f"{m['cpu']}), commit {m['commit']}; {m['repeats']} runs of each row, interleaved; load average before "
             f"{m['load_before']}, after {m['load_after']} (other work shared the cores).", "",
             "| tp | prompt tokens | first token measured ms, wall (median; runs) | CPU ms (median; runs) | predicted |"
             " error vs wall | error vs CPU | previous model | predicted parts ms (matmul, attention, overhead, tp comm)"
             " | decode measured ms/token (median) | predicted | error | load (runs) |",
             "|---|---:|---|---|---:|---:|---:|---:|---|---:|---:|---:|---|"]
    for row in res["rows"]:
        runs = row["runs"]
        fm = statistics.median(r["ttft_measured_ms"] for r in runs)
        fp = statistics.median(r["ttft_predicted_ms"] for r in runs)
        fc = statistics.median(r["ttft_cpu_ms"] for r in runs)
        dm = statistics.median(r["decode_measured_ms"] for r in runs)
        dp = statistics.median(r["decode_predicted_ms"] for r in runs)
        p = row["plan"]["parts_ms"]
        lines.append(f"| {row['tp']} | {row['prompt_tokens']} | {fm:.1f} ("
                     + ", ".join(f"{r['ttft_measured_ms']:.0f}" for r in runs) + f") | {fc:.1f} ("
                     + ", ".join(f"{r['ttft_cpu_ms']:.0f}" for r in runs) + f") | {fp:.1f} | "
                     f"{100 * (fp / fm - 1):+.0f}% | {100 * (fp / fc - 1):+.0f}% | "
                     f"{row['plan']['previous_model_ms']:.1f} | "
                     f"{p['matmul']:.1f}, {p['attention']:.1f}, {p['overhead']:.1f}, {p['tp_comm']:.1f} | {dm:.1f} | "
                     f"{dp:.1f} | {100 * (dp / dm - 1):+.0f}% | "
                     + ", ".join(f"{r['load']:.1f}" for r in runs) + " |")
    lines += ["", "Device (one rank, as --plan auto builds it): " + "; ".join(
        f"tp={row['tp']}: " + ", ".join(f"{k} {v:.4g}" for k, v in row["plan"]["device"].items())
        for row in res["rows"] if row["prompt_tokens"] == res["rows"][0]["prompt_tokens"])]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tps", default="1,2")
    ap.add_argument("--prompts", default="16,512")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--name", default="plan_ttft")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from machine import cpu_model
    from tensorpar.hub import resolve_model

    folder = str(resolve_model(args.model))
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = {n: prompt_of(tok, n) for n in map(int, args.prompts.split(","))}
    tps = [int(t) for t in args.tps.split(",")]
    load_before = [round(v, 2) for v in os.getloadavg()]
    runs = {(t, n): [] for t in tps for n in prompts}
    for _ in range(args.repeats):
        for t in tps:
            for n, (text, _) in prompts.items():
                runs[t, n].append(run(folder, t, text, args.new_tokens))
                print(json.dumps({"tp": t, "prompt": n, **runs[t, n][-1]}), file=sys.stderr, flush=True)
    rows = [{"tp": t, "prompt_tokens": prompts[n][1], "runs": r,
             "plan": planned(folder, t, prompts[n][1], args.new_tokens)} for (t, n), r in runs.items()]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    import torch
    res = {"meta": {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "cpu": cpu_model(),
                    "cpus": os.cpu_count(), "torch": torch.__version__, "commit": commit, "repeats": args.repeats,
                    "new_tokens": args.new_tokens, "load_before": load_before,
                    "load_after": [round(v, 2) for v in os.getloadavg()]}, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(res, indent=1) + "\n")
    md = to_markdown(res)
    (args.out / f"{args.name}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
