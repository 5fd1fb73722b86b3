"""Measured differences between the unsharded transformers MoE models and tensorpar's sharded ones.

Runs the parity jobs of tests/hf/test_families_moe.py (small random configs of tests/families_moe.py) and writes the
largest |difference| over logits, aux loss, loss, router logits, every gradient and the grad norm (two steps, one
with idle experts), at tp = 1, 3, 4 (experts split inside) and ep = 4 (experts whole over 4 ranks), plus the
expert parameters each rank holds under ep = 4.

    python bench/moe_parity_report.py        # writes bench/results/moe_parity.md
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tensorpar.parallel import ParallelContext  # noqa: E402
from tensorpar.testing import WorkerPool  # noqa: E402
from tests.families_moe import FAMILIES  # noqa: E402
from tests.hf.test_families_moe import job_ep, job_moe  # noqa: E402


def main() -> None:
    rows = []
    for tp in (1, 3, 4):
        pool = WorkerPool(tp) if tp > 1 else None
        for f in FAMILIES:
            diff, n, _ = pool.run(job_moe, f)[0] if pool else job_moe(ParallelContext.single(), f)
            rows.append(f"| {f} | tp={tp} | {diff:.2e} | {n} | |")
        if tp == 4:
            for f in FAMILIES:
                out = pool.run(job_ep, f)
                per = [o[3] for o in out]
                rows.append(f"| {f} | ep=4 | {max(o[0] for o in out):.2e} | {out[0][1]} | {per} of {out[0][4]} |")
        if pool:
            pool.close()
    text = ("| family | split | max abs diff (fp32) | comparisons (rank 0) | expert parameters per rank |\n"
            "|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    out = Path(__file__).resolve().parent / "results" / "moe_parity.md"
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(out)
    print(text)


if __name__ == "__main__":
    main()
