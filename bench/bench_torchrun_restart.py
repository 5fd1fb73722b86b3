"""How often a torchrun group restarted after a SIGKILLed rank (``--max-restarts 1``) finishes the run.

    python bench/bench_torchrun_restart.py [--runs 10] [--steps 40]

One ``torchrun --nproc-per-node 2 --max-restarts 1 --rdzv-backend c10d`` agent runs ``tensorpar train --tp 2``
(Shakespeare, seq 32, batch 4, checkpoint every 2 steps); once ``step_000002`` exists, one rank gets SIGKILL.
Counts the runs that exit 0 and the runs whose log shows gloo's ``Connection refused`` (the restarted group
reading the previous attempt's addresses from torchrun's shared store, pytorch/pytorch#135712), and records
each run's final loss and whether the log shows the restarted group resuming from a checkpoint. Appends a section to bench/results/torchrun_restart.md.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
TRAIN = ["--data", "shakespeare", "--seq-len", "32", "--batch-size", "4", "--no-progress", "--eval-every", "0",
         "--lr", "1e-2"]


def once(d: Path, steps: int) -> tuple[int, bool, bool, float | None, float]:
    from tensorpar.launch import free_port

    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    out, t0 = d / "killed", time.monotonic()
    with open(d / "agent.log", "w") as log:
        a = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts",
                              "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m",
                              "tensorpar", "train", "--tp", "2", "--timeout", "60", "--out", str(out), "--steps",
                              str(steps), "--save-every", "2"] + TRAIN, stdout=log, stderr=subprocess.STDOUT, env=env)
        while not (out / "checkpoints" / "step_000002").is_dir() and a.poll() is None:
            time.sleep(0.2)
        kids = subprocess.run(["pgrep", "-P", str(a.pid)], capture_output=True, text=True).stdout.split()
        ranks = [int(p) for p in kids if "tensorpar" in Path(f"/proc/{p}/cmdline").read_text()]
        if ranks:
            os.kill(ranks[-1], signal.SIGKILL)
        a.wait(timeout=600)
    text = (d / "agent.log").read_text()
    try:
        recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
        last = [r["loss"] for r in recs if r.get("kind") == "train"][-1]
    except (OSError, ValueError, IndexError):
        last = None
    restarted = "torchrun restart 1: resuming from" in text
    return a.returncode, "connection refused" in text.lower(), restarted, last, time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    rows = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as d:
            rows.append(once(Path(d), args.steps))
        rc, refused, restarted, last, wall = rows[-1]
        print(f"run {i}: exit {rc}, connection refused {refused}, resumed {restarted}, final loss {last}, "
              f"{wall:.1f} s", flush=True)
    ok = sum(r[0] == 0 for r in rows)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    lines = [f"## {time.strftime('%Y-%m-%d %H:%M')} UTC, commit {commit}: {ok} of {len(rows)} runs exit 0", "",
             f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end.", "",
             "| run | exit | connection refused | restarted and resumed | final loss | wall (s) |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {i} | {rc} | {ref} | {res} | {last} | {wall:.1f} |" for i, (rc, ref, res, last, wall) in
              enumerate(rows)]
    out = REPO / "bench" / "results" / "torchrun_restart.md"
    head = "" if out.exists() else ("# torchrun restart after a SIGKILLed rank (bench/bench_torchrun_restart.py)\n\n")
    with open(out, "a") as f:
        f.write(head + "\n".join(lines) + "\n\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
