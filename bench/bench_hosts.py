"""tp across hosts at 1 and 10 Gbit/s: SmolLM2 generate --tp 2 over two namespace hosts, and the hierarchical vs
the flat all-reduce over two hosts x two ranks (4 KB .. 16 MB), with :mod:`tensorpar.nshosts` (needs root).

    sudo .venv/bin/python bench/bench_hosts.py          # writes bench/results/hosts.json and hosts.md

Rows of the generate table: one host (tp 2 in one namespace host: shared-memory all-reduce), then two hosts
with one rank each at each link rate (every all-reduce crosses the link). Tokens/s is the decode rate that
``generate`` prints (greedy, fp32, one prompt, ``--max-new-tokens``; the median of ``--repeats`` runs, the
configurations interleaved so that a change of load hits each). The all-reduce table is the median
seconds of one all-reduce (each call timed after a barrier) of ``tests/_hosts_jobs.py``, which also checks
the hierarchical result bit for bit. The results file records the CPU model, the core count and the load
average before and after: on a shared machine the absolute numbers move with the load.
"""
from __future__ import annotations

import argparse
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

from tensorpar.nshosts import NamespaceHosts  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from machine import cpu_model  # noqa: E402

SIZES = (4096, 65536, 1 << 20, 16 << 20)
RATES = ("1gbit", "10gbit")


def env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TENSORPAR_THREADS="1")


def generate_row(folder: str, hosts: int, rate: str | None, new_tokens: int) -> dict:
    cmd = ["-m", "tensorpar", "generate", "--model", folder, "--tp", "2", "--max-new-tokens", str(new_tokens),
           "--prompt", "The capital of France is"]
    with NamespaceHosts(hosts, rate) as h:
        res = h.run_torchrun(cmd, nproc=2 // hosts, timeout_s=600, env=env())
    if any(rc for rc, _, _ in res):
        raise RuntimeError("generate failed: " + " | ".join(err[-1500:] for _, _, err in res))
    line = next(line for _, out, _ in res for line in out.splitlines() if "tokens/s" in line)
    m = re.search(r"time to first token ([\d.]+) ms, decode ([\d.]+) tokens/s", line)
    return {"hosts": hosts, "rate": rate if hosts > 1 else "-", "ttft_ms": float(m.group(1)),
            "tokens_per_s": float(m.group(2)), "line": line.strip()}


def allreduce_rows(rate: str, iters: int) -> dict:
    with tempfile.TemporaryDirectory() as d, NamespaceHosts(2, rate) as h:
        out = os.path.join(d, "r.json")
        res = h.run_torchrun(["-m", "tests._hosts_jobs", "--sizes", ",".join(map(str, SIZES)), "--iters",
                              str(iters), "--out", out], nproc=2, timeout_s=600, env=env())
        if any(rc for rc, _, _ in res):
            raise RuntimeError("all-reduce job failed: " + " | ".join(err[-1500:] for _, _, err in res))
        return json.loads(Path(out).read_text())


def to_markdown(r: dict) -> str:
    m = r["meta"]
    lines = [f"# tp across hosts (namespace hosts, tc tbf links) — {m['date']}", "",
             f"CPU: {m['cpu']} ({m['cpus']} cores), torch {m['torch']}, commit {m['commit']}; load average "
             f"before {m['loadavg_before']}, after {m['loadavg_after']}. The namespace hosts share these cores: "
             "unlike on separate machines, one host's ranks (and the other users of the machine) take CPU time from "
             "the other's, so CPU-bound steps (a 16 MB shared-memory reduce) and small-message latency suffer with "
             "the load; the link rate caps only the bytes in flight.", "",
             f"SmolLM2-135M-Instruct, generate --tp 2, fp32, greedy, {m['new_tokens']} new tokens:", "",
             "| hosts | link | ranks per host | time to first token (ms) | decode tokens/s (median) | all runs |",
             "|---|---|---:|---:|---:|---|"]
    lines += [f"| {g['hosts']} | {g['rate']} | {2 // g['hosts']} | {g['ttft_ms']:.1f} | {g['tokens_per_s']:.1f} | "
              f"{', '.join(f'{v:.1f}' for v in g['all_tokens_per_s'])} |" for g in r["generate"]]
    lines += ["", "All-reduce over 2 hosts x 2 ranks (fp32, median ms per call; hierarchical: shared memory in a "
              "host, one leader per host over the link; flat: gloo ring over all 4 ranks):", "",
              "| link | bytes | flat gloo (ms) | hierarchical (ms) | flat / hierarchical "
              "| bit-identical to ordered sum |",
              "|---|---:|---:|---:|---:|---|"]
    for rate, rec in r["allreduce"].items():
        for size, row in rec["sizes"].items():
            lines.append(f"| {rate} | {int(size):,} | {row['flat_s'] * 1e3:.2f} | {row['hier_s'] * 1e3:.2f} | "
                         f"{row['flat_s'] / row['hier_s']:.2f} | {row['hier_equals_ordered_sum']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each generate row (the median is shown)")
    ap.add_argument("--iters", type=int, default=10, help="timed all-reduces per size and transport")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    import torch

    from tensorpar.hub import resolve_model
    folder = str(resolve_model(args.model))   # fetched here: the namespace hosts have no way out
    load_before = os.getloadavg()
    configs = [(1, None)] + [(2, rate) for rate in RATES]
    runs = [[generate_row(folder, hosts, rate, args.new_tokens) for hosts, rate in configs]   # interleaved, so
            for _ in range(args.repeats)]                                                    # load drift hits all
    gen = []
    for k, (hosts, rate) in enumerate(configs):
        rows = sorted((rep[k] for rep in runs), key=lambda g: g["tokens_per_s"])
        gen.append(dict(rows[len(rows) // 2], all_tokens_per_s=[g["tokens_per_s"] for g in rows]))
    print(json.dumps(gen, indent=1), file=sys.stderr)
    ar = {rate: allreduce_rows(rate, args.iters) for rate in RATES}
    load_after = os.getloadavg()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip() or "unknown"
    result = {"meta": {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "cpu": cpu_model(),
                       "cpus": os.cpu_count(), "torch": torch.__version__, "commit": commit, "model": args.model,
                       "new_tokens": args.new_tokens, "iters": args.iters, "repeats": args.repeats,
                       "loadavg_before": [round(v, 2) for v in load_before],
                       "loadavg_after": [round(v, 2) for v in load_after]},
              "generate": gen, "allreduce": ar}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hosts.json").write_text(json.dumps(result, indent=1) + "\n")
    md = to_markdown(result)
    (args.out / "hosts.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
