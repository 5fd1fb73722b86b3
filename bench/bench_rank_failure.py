"""How long a run takes to end after one of its ranks stops (SIGSTOP), against the collective timeout.

    python bench/bench_rank_failure.py [--timeouts 3 10] [--repeats 3]

Two local ranks through tensorpar.launch.run_ranks (tests/_launch_jobs.py): both all-reduce once, rank 1
writes the time and stops itself, rank 0 enters the next all-reduce. We time from the stop to the exit of
the launching process. Issue 14 item 4 asks for "within the collective timeout plus a few seconds"; before
this change torch's process context waited 30 s more for the stopped rank (SIGTERM is not delivered to a
stopped process). Writes bench/results/rank_failure.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def once(timeout_s: float) -> tuple[float, int, str]:
    with tempfile.TemporaryDirectory() as d:
        stop_file = Path(d) / "stopped_at"
        env = dict(os.environ, PYTHONPATH=str(REPO), TENSORPAR_THREADS="1", TENSORPAR_STOP_FILE=str(stop_file),
                   TENSORPAR_JOB_TIMEOUT=str(timeout_s))
        p = subprocess.run([sys.executable, "-m", "tests._launch_jobs", "stop_rank1_before_all_reduce", "2"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s + 120)
        end = time.time()
        return end - float(stop_file.read_text()), p.returncode, p.stderr.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeouts", type=float, nargs="+", default=[3.0, 10.0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for t in args.timeouts:
        runs = [once(t) for _ in range(args.repeats)]
        secs = [r[0] for r in runs]
        assert all(r[1] == 1 for r in runs), runs
        rows.append((t, min(secs), statistics.median(secs), max(secs), runs[0][2]))
        print(f"timeout {t:g} s: stop -> exit {min(secs):.1f} / {statistics.median(secs):.1f} / {max(secs):.1f} s")
    load = os.getloadavg()[0]
    out = REPO / "bench" / "results" / "rank_failure.md"
    lines = ["# A stopped rank: seconds from SIGSTOP to the end of the run (bench/bench_rank_failure.py)", "",
             f"2 local gloo ranks, {args.repeats} runs per timeout, {os.cpu_count()} cores, load average "
             f"{load:.1f} at the end (other jobs shared the machine).", "",
             "| collective timeout (s) | min (s) | median (s) | max (s) | over the timeout, median (s) |",
             "|---|---|---|---|---|"]
    lines += [f"| {t:g} | {a:.1f} | {m:.1f} | {b:.1f} | {m - t:.1f} |" for t, a, m, b, _ in rows]
    lines += ["", f"The error printed (timeout {rows[0][0]:g} s):", "", "```", rows[0][4], "```", ""]
    out.write_text("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
