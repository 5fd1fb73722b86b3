"""Measured differences from the unsharded transformers model for the vision classifiers (ViT, DINOv2,
DINOv2-SwiGLU, SigLIP vision: 5 heads) and the docs' Granite user plan (10 q / 2 KV heads, vocab 37) at
tp = 2, 3, 4: the largest |difference| over logits, loss, every gradient and the grad norm (fp32).

Runs the jobs of tests/hf/test_vit.py and tests/hf/test_user_plans.py.

    python bench/parity_vision_plans.py      # writes bench/results/parity-vision-plans.md and .json
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tensorpar.testing import WorkerPool  # noqa: E402
from tests.hf.test_user_plans import granite_yaml  # noqa: E402
from tests.hf.test_vit import MODELS, job_classifier  # noqa: E402


def job_granite_diff(ctx, path):
    from tests.hf.test_user_plans import _parity, granite_config
    n, _, diff = _parity(ctx, granite_config(), path, generate=False)
    return diff, n


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "granite.yaml")
        Path(path).write_text(granite_yaml())
        for tp in (2, 3, 4):
            with WorkerPool(tp, collective_timeout_s=120) as pool:
                for name in MODELS:
                    d, n, _ = pool.run(job_classifier, name)[0]
                    rows.append({"case": f"{name} image classifier, 5 heads", "tp": tp, "max_abs_diff": d,
                                 "comparisons": n})
                d, n = pool.run(job_granite_diff, path)[0]
                rows.append({"case": "granite via docs/plans.md user plan, 10q/2kv heads", "tp": tp,
                             "max_abs_diff": d, "comparisons": n})
    out = Path(__file__).resolve().parent / "results"
    for suffix, text in (("json", json.dumps(rows, indent=1)),
                         ("md", "| case | tp | max abs diff (fp32) | tensors compared |\n|---|---|---|---|\n" + "\n".join(
                             f"| {r['case']} | {r['tp']} | {r['max_abs_diff']:.3g} | {r['comparisons']} |"
                             for r in rows) + "\n")):
        tmp = out / f".parity-vision-plans.{suffix}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / f"parity-vision-plans.{suffix}")
    print((out / "parity-vision-plans.md").read_text())


if __name__ == "__main__":
    main()
