"""Measure DCP checkpoints: how the bytes split over the ranks that write, save and load times, and that no
rank gathers state during a save.

What runs: a Llama-shaped model (vocab 8192, hidden 256, 4 layers, 8 query / 2 KV heads, intermediate 704,
tied embedding; about 3.4 M parameters, 13.5 MB fp32 plus 27 MB of AdamW moments), one optimiser step so
that the moments exist, then ``--repeats`` saves at (tp 2, pp 2) and at (tp 2, dp 2) on 4 gloo ranks of
this host, and a resume of each checkpoint at tp = 1 on this process.

Columns: ``save_s`` = median over repeats of the slowest rank's save time (each save starts after a
barrier); ``bytes by writer`` = the bytes of the files each global rank wrote (model + optimizer);
``largest share`` = the largest of them / all bytes (1 / number of writers when even);
``gathers`` = calls of ``tensorpar.comm.all_gather`` during the saves (0: no rank assembles tensors);
``load_s`` = one resume at tp = 1 (one process reads every piece).

Usage::

    PYTHONPATH=. python bench/bench_checkpoint.py              # ~1-3 min on the 2-core machine
    PYTHONPATH=. python bench/bench_checkpoint.py --repeats 1  # to check it runs

Writes ``bench/results/checkpoint.json`` and ``bench/results/checkpoint.md``. Timings on a shared or loaded
machine are noise; the JSON records the load average before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

MODEL = dict(vocab_size=8192, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=128, tie_word_embeddings=True)


def _trainer(ctx, layout):
    from transformers import LlamaConfig

    from tensorpar.train.config import TrainConfig
    from tensorpar.train.data import TrainData
    from tensorpar.train.loop import Trainer
    from tensorpar.train.model import ModelSource, build_model
    g = torch.Generator().manual_seed(0)
    data = TrainData.from_tokens(torch.randint(0, MODEL["vocab_size"], (50_000,), generator=g),
                                 MODEL["vocab_size"], val_fraction=0.05, source="synthetic")
    c = ctx.config
    cfg = TrainConfig(model="bench", data="synthetic", seq_len=32, batch_size=4, steps=10, warmup_steps=1,
                      tp=c.tp, pp=c.pp, dp=c.dp, micro_batches=layout.get("micro_batches", 1),
                      schedule=layout.get("schedule", "1f1b"), keep_checkpoints=1)
    model, plan = build_model(cfg, ModelSource(LlamaConfig(**MODEL), None, None), ctx.tp, data.vocab_size)
    return Trainer(cfg, ctx, model, plan, data)


def job_save(ctx, layout, root, repeats):
    import torch.distributed as dist

    from tensorpar import comm
    tr = _trainer(ctx, layout)
    tr.train_step()
    calls, orig = [], comm.all_gather
    comm.all_gather = lambda *a, **k: (calls.append(1), orig(*a, **k))[1]
    times = []
    try:
        for i in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            tr.step = i + 1
            tr.save(root)
            times.append(time.perf_counter() - t0)
    finally:
        comm.all_gather = orig
    return {"times": times, "gathers": len(calls)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    from tensorpar.parallel import ParallelConfig, ParallelContext
    from tensorpar.testing import WorkerPool
    from tensorpar.train.checkpoint import latest_checkpoint
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    rows = []
    layouts = [("tp2-pp2", ParallelConfig(tp=2, pp=2), dict(micro_batches=2)),
               ("tp2-dp2", ParallelConfig(tp=2, dp=2), dict(micro_batches=2))]
    with tempfile.TemporaryDirectory() as tmp:
        for name, config, layout in layouts:
            root = Path(tmp) / name
            with WorkerPool(4, config, collective_timeout_s=120.0) as pool:
                res = pool.run(job_save, layout, str(root), args.repeats)
            ckpt = latest_checkpoint(root)
            by_rank: dict[int, int] = {}
            for f in ckpt.rglob("shard-*.safetensors"):
                r = int(f.name.split("-")[1]) - 1
                by_rank[r] = by_rank.get(r, 0) + f.stat().st_size
            total = sum(by_rank.values())
            one = _trainer(ParallelContext.single(), {})
            t0 = time.perf_counter()
            one.resume(root)
            load_s = time.perf_counter() - t0
            slowest = [max(r["times"][i] for r in res) for i in range(args.repeats)]
            rows.append({"layout": name, "save_s": statistics.median(slowest), "save_s_all": slowest,
                         "bytes_by_writer": dict(sorted(by_rank.items())), "total_bytes": total,
                         "largest_share": max(by_rank.values()) / total,
                         "gathers": sum(r["gathers"] for r in res), "load_s": load_s})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rec = {"model": MODEL, "repeats": args.repeats, "rows": rows, "torch": torch.__version__,
           "loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    (out / "checkpoint.json").write_text(json.dumps(rec, indent=1))
    lines = ["| layout | save_s (median of slowest rank) | bytes by writer (global rank: MB) | largest share | "
             "gathers during save | load at tp 1 (s) |", "|---|---|---|---|---|---|"]
    for r in rows:
        mb = ", ".join(f"{k}: {v / 1e6:.2f}" for k, v in r["bytes_by_writer"].items())
        lines.append(f"| {r['layout']} | {r['save_s']:.2f} | {mb} | {r['largest_share']:.2f} | {r['gathers']} | "
                     f"{r['load_s']:.2f} |")
    lines.append("")
    lines.append(f"Load average before/after: {load_before[0]:.1f} / {rec['loadavg_after'][0]:.1f} "
                 f"(shared 2-core machine: timings are noise; the byte split is exact).")
    (out / "checkpoint.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
