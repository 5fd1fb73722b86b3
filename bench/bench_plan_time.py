"""How long `tensorpar plan` takes to rank every layout of GPT-3 175B on 1024 A100s (pure Python, no torch).

    PYTHONPATH=. python bench/bench_plan_time.py [--rounds 5]

Runs the command in-process (``tensorpar.cli.main``, output discarded) ``--rounds`` times and writes
``bench/results/plan_time.{json,md}``: best and median wall seconds, the CPU seconds of the best round
(``time.process_time``, which other users of a shared machine change much less), the number of ranked layouts,
and the load average at the start and the end. The target of the earlier timed test was < 10 s (wall).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tensorpar import cli  # noqa: E402

GPT3 = ["--model", "gpt3-175b", "--gpus", "1024", "--gpus-per-node", "8", "--device", "a100-80gb",
        "--global-batch", "1536", "--seq", "2048"]
TARGET_S = 10.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "plan_time"))
    a = ap.parse_args()
    load_start = os.getloadavg()
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    walls, cpus = [], []
    for _ in range(a.rounds):
        buf = io.StringIO()
        w0, c0 = time.perf_counter(), time.process_time()
        with contextlib.redirect_stdout(buf):
            code = cli.main(["plan", *GPT3])
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
        if code != 0:
            raise SystemExit(f"tensorpar plan exited {code}")
    ranked = buf.getvalue().count("\n#")
    out = {"date": started, "machine": f"{os.cpu_count()} CPUs, {platform.machine()}", "command": ["plan", *GPT3],
           "loadavg_start": [round(x, 2) for x in load_start], "loadavg_end": [round(x, 2) for x in os.getloadavg()],
           "wall_s": walls, "cpu_s": cpus, "best_wall_s": min(walls), "median_wall_s": statistics.median(walls),
           "cpu_s_of_best": cpus[walls.index(min(walls))], "target_s": TARGET_S, "ranked_lines": ranked}
    md = "\n".join([
        "# `tensorpar plan` on GPT-3 175B, 1024 x A100 (bench/bench_plan_time.py)", "",
        f"{out['date']}, {out['machine']}; load average {out['loadavg_start']} at start, {out['loadavg_end']} at "
        f"the end; {a.rounds} rounds in one process.", "",
        f"best {out['best_wall_s']:.2f} s wall ({out['cpu_s_of_best']:.2f} s CPU), median {out['median_wall_s']:.2f} "
        f"s; target < {TARGET_S:.0f} s: {'met' if out['best_wall_s'] < TARGET_S else 'NOT met'}.", ""])
    p = Path(a.out)
    for suffix, text in ((".json", json.dumps(out, indent=2)), (".md", md)):
        tmp = p.with_suffix(suffix + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, p.with_suffix(suffix))
    print(md)


if __name__ == "__main__":
    main()
