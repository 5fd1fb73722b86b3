"""The link-rate table (issue 23.5): tp across two hosts against pp across them, at 1 and 10 Gbit/s, with and without
``--tp-comm int8``, measured on namespace hosts (:mod:`tensorpar.nshosts`, needs root) next to the planner's
prediction.

    sudo .venv/bin/python bench/bench_link_rates.py     # writes bench/results/link_rates.json and link_rates.md

For each link rate (2 namespace hosts, one rank each, ``tc tbf`` on both ends of the link):

1. the link as the planner sees it (``bench/link_job.py``): ``latency + bytes / bandwidth`` (the inter-node link of
   the planner's cluster: ``inter_node_*``), the bandwidth of back-to-back gloo all-reduces of ``4 h`` B .. 4 MB,
   the latency what one ``[1, h]`` all-reduce adds to a step that alternates it with a one-thread matmul of a tp = 2
   rank's weights per decode collective (:func:`step_shape`); measured again before each round of decode rows (the
   small all-reduce's cost moves with the load; docs/planner.md, "What a small gloo all-reduce costs");
2. decode ms/token of ``tensorpar generate`` (SmolLM2, fp32, greedy) at ``--tp 2`` across the hosts, ``--pp 2``
   across them, and ``--tp 2 --tp-comm int8``; the planner's prediction of each (``plan_one``) on a device whose
   decode read rate is SmolLM2's tp = 1 decode on one rank of this machine (weights / measured seconds per token,
   measured first, alone) and whose link between hosts is the fit of step 1; nothing is taken from the runs it
   predicts;
3. a training step (``tensorpar train --plan FILE``, the ``small`` preset) of tp=2 across the hosts and pp=2 across
   them, each with ``--inter-node-bw`` / ``--inter-node-latency-us`` of step 1: the trainer's own "plan vs measured"
   line (its calibrated device, this link between the hosts).

The namespace hosts share this machine's cores (and other users load it): the CPU model, the core count and the
load average before and after are recorded, and every number moves with the load.
"""
from __future__ import annotations

import argparse
import atexit
import datetime as _dt
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from machine import cpu_model  # noqa: E402

from tensorpar.nshosts import NamespaceHosts, rate_bits  # noqa: E402

RATES = ("1gbit", "10gbit")
#: (name, generate flags, tp, pp, --tp-comm) of the decode rows, one rank per host; tp None: measured only (the
#: gloo row: every collective through gloo, as before the leaders' TCP mesh; the planner prices the job's path)
DECODE_ROWS = (("tp=2 across", ["--tp", "2"], 2, 1, "fp32"), ("pp=2 across", ["--pp", "2"], 1, 2, "fp32"),
               ("tp=2 across, --tp-comm int8", ["--tp", "2", "--tp-comm", "int8"], 2, 1, "int8"),
               ("tp=2 across, gloo only (--fast-collectives off)", ["--tp", "2", "--fast-collectives", "off"],
                None, 1, "fp32"))
HOSTNAMES = ["linkbench-h0", "linkbench-h1"]
PROMPT = "The capital of France is"


def env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TENSORPAR_THREADS="1")


def _ms_per_token(text: str) -> tuple[float, str]:
    line = next(line for line in text.splitlines() if "time to first token" in line)
    m = re.search(r"decode ([\d.]+) tokens/s", line)
    return 1e3 / float(m.group(1)), line.strip()


def _check(res, what: str):
    if any(rc for rc, _, _ in res):
        raise RuntimeError(f"{what} failed: " + " | ".join(err[-1500:] for _, _, err in res))


def step_shape(folder: str) -> tuple[int, int]:
    """``(hidden, cols)`` of the link job's in-step matmul: a tp = 2 rank's weights per decode collective of the
    model (``weight_params_per_rank(model, 2) / (2 x layers + 3)``), as ``[hidden, cols]``."""
    from tensorpar.planner.inference import decode_collectives, weight_params_per_rank
    from tensorpar.planner.model_spec import from_hf_config

    model = from_hf_config(Path(folder) / "config.json")
    per = weight_params_per_rank(model, 2) / decode_collectives(model, 2)
    return model.hidden_size, max(1, round(per / model.hidden_size))


def link_fit(h: NamespaceHosts, iters: int, shape: tuple[int, int]) -> dict:
    """The link job (``bench/link_job.py``) across the hosts: back-to-back all-reduce and send medians, the in-step
    all-reduce and all-gather of the decode's ``[1, hidden]`` fp32 (``4 x hidden`` bytes) between matmuls of
    ``shape``, and the fit the planner gets."""
    hidden, cols = shape
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "link.json")
        res = h.run_torchrun([str(ROOT / "bench" / "link_job.py"), "--calls", str(iters), "--out", out,
                              "--sizes", f"{4 * hidden},65536,1048576,4194304", "--hidden", str(hidden),
                              "--cols", str(cols)], nproc=1, timeout_s=600, env=env())
        _check(res, "link job")
        return json.loads(Path(out).read_text())


def generate(h: NamespaceHosts | None, folder: str, new_tokens: int, extra: list[str]) -> dict:
    cmd = ["-m", "tensorpar", "generate", "--model", folder, "--max-new-tokens", str(new_tokens), "--prompt", PROMPT,
           *extra]
    if h is None:   # one rank on this machine, outside the namespace hosts
        r = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, env=env(), timeout=600)
        res = [(r.returncode, r.stdout, r.stderr)]
    else:
        res = h.run_torchrun(cmd, nproc=1, timeout_s=600, env=env())
    _check(res, "generate " + " ".join(extra))
    ms, line = _ms_per_token("\n".join(out + err for _, out, err in res))
    return {"ms_per_token": ms, "line": line}


def _no_paths(line: str) -> str:
    """``line`` without this machine's paths: the plan file by its name, the cache as ``<cache>``."""
    return re.sub(r"/\S+/\.cache/tensorpar/", "<cache>/", re.sub(r"/\S*/(plan-[\w.-]+\.json)", r"\1", line))


def train(h: NamespaceHosts, layout: dict, link: dict, data: str, steps: int, workdir: str) -> dict:
    plan = Path(tempfile.mkdtemp(dir=workdir)) / f"plan-tp{layout['tp']}-pp{layout['pp']}.json"
    plan.write_text(json.dumps(layout))
    cmd = ["-m", "tensorpar", "train", "--model", "small", "--data", data, "--seq-len", "128", "--batch-size", "8",
           "--steps", str(steps), "--plan", str(plan), "--out", str(plan.parent / "run"),
           "--no-progress", "--eval-every", "0", "--save-every", "0",
           "--inter-node-bw", f"{link['bandwidth_gbps']:.6g}", "--inter-node-latency-us", f"{link['latency_us']:.6g}"]
    res = h.run_torchrun(cmd, nproc=1, timeout_s=900, env=env())
    _check(res, f"train tp={layout['tp']} pp={layout['pp']}")
    text = "\n".join(out + err for _, out, err in res)
    line = next(line for line in text.splitlines() if "plan vs measured" in line)
    m = re.search(r"step time predicted ([\d.]+) ms, measured ([\d.]+) ms", line)
    chosen = _no_paths(next((line.strip() for line in text.splitlines() if line.startswith("plan (")), ""))
    return {"predicted_s": float(m.group(1)) / 1e3, "measured_s": float(m.group(2)) / 1e3, "line": line.strip(),
            "plan_line": chosen}


def seed_calibration(hostnames: list[str]) -> list[Path]:
    """The trainer's calibration of this machine, filed under each namespace host's hostname (its cache key): the
    hosts are this machine's cores, and a calibration inside a namespace host would compete with the other's."""
    from unittest import mock

    from tensorpar.train.autoplan.calibration import calibration_path
    src = calibration_path()
    out = []
    for name in hostnames:
        with mock.patch("platform.node", return_value=name):
            dst = calibration_path()
        dst.write_text(src.read_text())
        out.append(dst)
    atexit.register(lambda: [path.unlink(missing_ok=True) for path in out])   # also when the run fails
    return out


def _median_run(runs: list[dict], key: str) -> dict:
    """The run (measured or predicted part) of median ms/token."""
    if any(r[key] is None for r in runs):
        return None
    ordered = sorted((r[key] for r in runs), key=lambda x: x["ms_per_token"])
    return ordered[len(ordered) // 2]


def decode_device(folder: str, tp1_ms: float, link: dict):
    """The planner's device: SmolLM2's tp = 1 decode as its read rate (weights / measured s per token, no separate
    overhead or compute term), the link between hosts as measured, and the ``--tp-comm int8`` all-reduce's own CPU
    time measured here (``measure_int8_reduce``, one thread, a fraction of a second)."""
    from tensorpar.planner.calibrate.decode import measure_int8_reduce
    from tensorpar.planner.cluster import DeviceSpec
    from tensorpar.planner.inference import weight_params_per_rank
    from tensorpar.planner.model_spec import from_hf_config

    model = from_hf_config(Path(folder) / "config.json")
    rate = weight_params_per_rank(model, 1) * 4 / (tp1_ms * 1e-3) / 1e9
    device = DeviceSpec("this machine, one rank (SmolLM2 tp=1 decode)", memory_gib=64.0, peak_tflops=1e3,
                        intra_node_gbps=0.0, inter_node_gbps=link["bandwidth_gbps"],
                        inter_node_latency_us=link["latency_us"], hbm_gbps=rate, decode_read_gbps=rate,
                        local_link_gbps=link["bandwidth_gbps"], local_link_latency_us=link["latency_us"],
                        int8_reduce_cpu_us=measure_int8_reduce(None, model.hidden_size)["int8_reduce_cpu_us"])
    return model, device, rate


def predict_decode(model, device, tp: int, pp: int, tp_comm: str, new_tokens: int, prompt_len: int) -> dict:
    from tensorpar.planner.cluster import ClusterSpec
    from tensorpar.planner.inference import InferenceWorkload, plan_one

    work = InferenceWorkload(1, prompt_len, new_tokens, weight_bytes=4, kv_bytes=4, reserve_gib=0, tp_comm=tp_comm)
    q = plan_one(model, tp, ClusterSpec(device, 2, 1), work, pp=pp)
    return {"ms_per_token": q.decode * 1e3, "reads_ms": q.decode_memory * 1e3, "tp_comm_ms": q.decode_comm * 1e3,
            "pp_comm_ms": q.decode_pp_comm * 1e3}


def to_markdown(r: dict) -> str:
    m = r["meta"]
    lines = [f"# Link rates: tp vs pp across two hosts (namespace hosts, tc tbf) — {m['date']}", "",
             f"CPU: {m['cpu']} ({m['cpus']} cores), torch {m['torch']}, commit {m['commit']}; load average before "
             f"{m['loadavg_before']}, after {m['loadavg_after']} (a shared machine: other sessions' work runs on the "
             "same cores, and the two namespace hosts share them too).", ""]
    decode = any(rec.get("decode") for rec in r["rates"].values())
    lines += [] if not decode else [
             f"Decode: SmolLM2-135M-Instruct, fp32, greedy, one prompt, {m['new_tokens']} new tokens, one rank per "
             f"host; {m.get('repeats', 1)} run(s) of each row, interleaved, the median shown. The planner's device: "
             f"SmolLM2 at tp=1 on one rank here, measured just before each round of rows (median "
             f"{m['tp1_ms']:.1f} ms/token), as the read rate, and the link of each rate as measured (all-reduce fit of "
             "tensorpar's path: the leaders' TCP mesh up to 256 KiB, gloo above; bench/link_job.py). The gloo-only "
             "row is measured, not predicted: the same job with every collective through gloo. Load: the 1-minute load average when each run ended.",
             "", "| link | measured link: latency (us), bandwidth (GB/s) | layout | measured ms/token | predicted "
             "ms/token | error | predicted: reads, tp comm, pp comm (ms) | runs: measured / predicted (load; the link's "
             "latency in that round) |",
             "|---|---|---|---:|---:|---:|---|---|"]
    for rate, rec in r["rates"].items():
        f = rec["link"]["fit"]["allreduce"]
        for row in rec["decode"]:
            p = row["predicted"]
            if p is None:
                lines.append(f"| {rate} | | {row['layout']} | {row['measured']['ms_per_token']:.1f} | | | | "
                             + ", ".join(f"{x['measured']['ms_per_token']:.0f} ({x['measured'].get('load', 0):.0f})"
                                         for x in row.get("runs", [])) + " |")
                continue
            lines.append(f"| {rate} | {f['latency_us']:.0f}, {f['bandwidth_gbps']:.3f} | {row['layout']} | "
                         f"{row['measured']['ms_per_token']:.1f} | {p['ms_per_token']:.1f} | "
                         f"{100 * (p['ms_per_token'] / row['measured']['ms_per_token'] - 1):+.0f}% | "
                         f"{p['reads_ms']:.1f}, {p['tp_comm_ms']:.1f}, {p['pp_comm_ms']:.1f} | "
                         + ", ".join(f"{x['measured']['ms_per_token']:.0f} / {x['predicted']['ms_per_token']:.0f} "
                                     f"({x['measured'].get('load', float('nan')):.0f}"
                                     + (f"; {x['link_latency_us'] / 1e3:.2f} ms" if "link_latency_us" in x else "")
                                     + ")" for x in row.get("runs", []))
                         + " |")
        for t in rec.get("tp1", []):
            lines.append(f"| {rate} | | tp=1, one rank (the device's reference) | {t['ms_per_token']:.1f} | | | | "
                         f"(load {t.get('load', float('nan')):.0f}) |")
    lines += ["", f"Training step: `tensorpar train --plan FILE` (preset `small`, batch 8 x 128 tokens, "
              f"{m['train_steps']} steps, the median after 2 warm-up, slowest rank), with `--inter-node-bw` and "
              "`--inter-node-latency-us` of the measured link; predicted: the trainer's calibrated device:", "",
              "| link | layout | measured s/step | predicted s/step | error | load when planned |",
              "|---|---|---:|---:|---:|---:|"]
    for rate, rec in r["rates"].items():
        for row in rec["train"]:
            load = re.search(r" at load ([\d.]+)", row.get("plan_line", ""))
            lines.append(f"| {rate} | {row['layout']} | {row['measured_s']:.3f} | {row['predicted_s']:.3f} | "
                         f"{100 * (row['predicted_s'] / row['measured_s'] - 1):+.0f}% | "
                         f"{load.group(1) if load else ''} |")
    lines += ["", f"Link (`bench/link_job.py`): the median of {m['iters']} calls back to back per size (fewer above 64 KiB), "
              "and what one all-reduce and one all-gather of the decode's `[1, h]` fp32 add to a step that alternates "
              "them with a one-thread matmul of a tp=2 rank's weights per collective (the median of 5 rounds, mean of "
              "the ranks; the planner's latency is the in-step all-reduce less its bytes at the fitted bandwidth):",
              "", "| link | bytes | all-reduce (ms) | send (ms) |", "|---|---:|---:|---:|"]
    for rate, rec in r["rates"].items():
        for size, t in rec["link"]["allreduce"].items():
            lines.append(f"| {rate} | {int(size):,} | {t * 1e3:.2f} | {rec['link']['send'][size] * 1e3:.2f} |")
    lines += ["", "| link | in-step bytes | matmul [hidden, cols] (us per call) | all-reduce adds (us) | all-gather adds "
              "(us) | back-to-back fit's latency (us) |", "|---|---:|---|---:|---:|---:|"]
    for rate, rec in r["rates"].items():
        for lk in rec.get("link_rounds") or [rec["link"]]:   # one per round of decode rows
            st, f = lk.get("step"), lk["fit"]["allreduce"]
            if st:
                lines.append(f"| {rate} | {st['bytes']:,} | [{st['hidden']}, {st['cols']}] ({st['compute_us']:.0f}) | "
                             f"{st['allreduce_us']:.0f} | {st['allgather_us']:.0f} | "
                             f"{f.get('b2b_latency_us', 0):.0f} |")
    return "\n".join(lines) + "\n"


def write(result: dict, args, load_before, tp1_all: list, read: float, torch_version: str) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip() or "unknown"
    result["meta"] = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "cpu": cpu_model(),
                      "cpus": os.cpu_count(), "torch": torch_version, "commit": commit, "model": args.model,
                      "new_tokens": args.new_tokens, "iters": args.iters, "train_steps": args.train_steps,
                      "tp1_ms": sorted(tp1_all)[len(tp1_all) // 2] if tp1_all else float("nan"),
                      "repeats": args.repeats, "read_gbps": read,
                      "loadavg_before": [round(v, 2) for v in load_before],
                      "loadavg_after": [round(v, 2) for v in os.getloadavg()]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "link_rates.json").write_text(json.dumps(result, indent=1) + "\n")
    md = to_markdown(result)
    (args.out / "link_rates.md").write_text(md)
    return md


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--iters", type=int, default=100, help="timed calls per size of the link job (and per round of "
                                                          "its in-step blocks)")
    ap.add_argument("--train-steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1, help="decode runs of each row (and of the tp=1 reference before "
                                                           "them), interleaved; the median is shown")
    ap.add_argument("--rates", default=",".join(RATES))
    ap.add_argument("--no-train", action="store_true")
    ap.add_argument("--no-decode", action="store_true", help="(testing the bench) training rows only")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    import torch

    from tensorpar.hub import resolve_model
    from tensorpar.train.autoplan import cached_calibration
    rates = args.rates.split(",")
    for rate in rates:
        rate_bits(rate)
    folder = str(resolve_model(args.model))   # fetched here: the namespace hosts have no way out
    cached_calibration()                       # the trainer's calibration, measured here once (cached)
    seed_calibration(HOSTNAMES)
    load_before = os.getloadavg()
    prompt_len = 6
    tp1_all = []
    result, read = {"rates": {}}, float("nan")
    with tempfile.TemporaryDirectory() as work:
        data = Path(work) / "data.txt"
        data.write_text(("the quick brown fox jumps over the lazy dog. " * 400 + "\n") * 4)
        for rate in rates:
            rec = {}
            with NamespaceHosts(2, rate, hostnames=HOSTNAMES) as h:
                rec["link"] = link_fit(h, args.iters, step_shape(folder))
                link = rec["link"]["fit"]["allreduce"]
                rows = {name: [] for name, *_ in DECODE_ROWS}
                rec["tp1"], rec["link_rounds"] = [], []
                for k in range(0 if args.no_decode else args.repeats):   # interleaved: load drift hits every row
                    # the link and this machine's decode speed now (the small all-reduce's cost moves with the load:
                    # 0.8-2.4 ms between rounds of one link job): the link job again after the first round, then
                    # one rank alone at tp 1 (outside the namespace hosts)
                    now = rec["link"] if k == 0 else link_fit(h, args.iters, step_shape(folder))
                    rec["link_rounds"].append({"fit": now["fit"], "step": now["step"]})
                    tp1 = dict(generate(None, folder, args.new_tokens, ["--tp", "1"]), load=os.getloadavg()[0])
                    rec["tp1"].append(tp1)
                    tp1_all.append(tp1["ms_per_token"])
                    model, device, read = decode_device(folder, tp1["ms_per_token"], now["fit"]["allreduce"])
                    for name, extra, tp, pp, comm in DECODE_ROWS:
                        run = {"measured": dict(generate(h, folder, args.new_tokens, extra), load=os.getloadavg()[0]),
                               "predicted": (None if tp is None else
                                             predict_decode(model, device, tp, pp, comm, args.new_tokens, prompt_len)),
                               "link_latency_us": now["fit"]["allreduce"]["latency_us"]}
                        rows[name].append(run)
                        print(json.dumps({"layout": name, **run}), file=sys.stderr, flush=True)
                rec["decode"] = [{"layout": name, "runs": runs, "measured": _median_run(runs, "measured"),
                                  "predicted": _median_run(runs, "predicted")} for name, runs in rows.items() if runs]
                rec["train"] = []
                if not args.no_train:
                    for name, lay in (("tp=2 across", {"tp": 2, "pp": 1, "dp": 1, "micro_batch": 4}),
                                      ("pp=2 across", {"tp": 1, "pp": 2, "dp": 1, "micro_batch": 4})):
                        row = train(h, lay, link, str(data), args.train_steps, work)
                        rec["train"].append({"layout": name, **row})
                        print(json.dumps(rec["train"][-1]), file=sys.stderr, flush=True)
            result["rates"][rate] = rec
            md = write(result, args, load_before, tp1_all, read, torch.__version__)  # after each rate: a later
    print(md)                                                                    # failure keeps what was measured
    return 0


if __name__ == "__main__":
    sys.exit(main())
