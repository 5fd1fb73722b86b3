"""Measured differences between tp = 1 (the unsharded model) and tp = 2, 3, 4, and collective counts.

Runs the parity jobs of the test suite (MLP block; a whole 2-layer Llama with 6 query / 2 KV heads,
tied embeddings, vocab 37 - uneven at tp = 2, 3, 4 - with and without sequence parallelism; the
SmolLM2-shaped 9/3 heads at tp = 3) and writes the largest |difference| over logits, loss, every
gradient and the grad norm, plus the collectives counted for one forward + backward.

    python bench/parity_report.py            # writes bench/results/parity.md and parity.json
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tensorpar.testing import WorkerPool  # noqa: E402
from tests.hf.test_hf_parity import job_llama  # noqa: E402
from tests.core.test_layers import job_mlp  # noqa: E402


def _calls(summary: dict) -> str:
    return ", ".join(f"{kind} x{v['calls']}" for kind, v in summary.items())


def main() -> None:
    rows = []
    for tp in (2, 3, 4):
        with WorkerPool(tp, collective_timeout_s=120) as pool:
            d, fwd, bwd = pool.run(job_mlp, 2, 5, 8, 24)[0]
            rows.append({"case": "MLP block (column -> row), b=2 s=5 h=8 f=24", "tp": tp, "max_abs_diff": d,
                         "collectives": {"forward": fwd, "backward": bwd}})
            for sp in ([False, True] if tp in (2, 4) else [False]):
                d, n, counts = pool.run(job_llama, {}, sp, 0.1 if sp else 0.0)[0]
                rows.append({"case": f"Llama 2 layers, 6q/2kv heads, vocab 37{', sequence parallel' if sp else ''}",
                             "tp": tp, "max_abs_diff": d, "comparisons": n, "collectives": counts})
            if tp == 3:
                d, n, counts = pool.run(job_llama, dict(num_attention_heads=9, num_key_value_heads=3, hidden_size=36,
                                                        tie_word_embeddings=False, vocab_size=41), False, 0.1)[0]
                rows.append({"case": "Llama 9q/3kv heads (SmolLM2 shape), vocab 41, untied", "tp": tp,
                             "max_abs_diff": d, "comparisons": n, "collectives": counts})
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    tmp = out / "parity.json.tmp"
    tmp.write_text(json.dumps(rows, indent=2))
    os.replace(tmp, out / "parity.json")
    lines = ["| case | tp | max abs diff (fp32) | collectives in forward + backward (calls) |", "|---|---|---|---|"]
    for r in rows:
        c = r["collectives"]
        if "forward" in c:
            calls = f"fwd {_calls(c['forward'])}; bwd {_calls(c['backward'])}"
        else:
            calls = _calls(c)
        lines.append(f"| {r['case']} | {r['tp']} | {r['max_abs_diff']:.2e} | {calls} |")
    tmp = out / "parity.md.tmp"
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, out / "parity.md")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
