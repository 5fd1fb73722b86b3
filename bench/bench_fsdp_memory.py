"""Per-rank training state under ``--dp-mode ddp`` and ``--dp-mode fsdp``: bytes of parameters, gradients and
AdamW moments that each rank holds, for the 4-rank layouts with dp > 1.

    PYTHONPATH=. python bench/bench_fsdp_memory.py            # writes bench/results/fsdp_memory.{json,md}

The model is the ``small`` preset (4 layers, hidden 256, 8 heads / 4 KV heads, tied embedding) with a 256-token
vocabulary, fp32; one optimiser step on random tokens, then the bytes are counted from the tensors themselves
(each rank's local shards: ``DTensor.to_local()`` under FSDP), not from the allocator, so the numbers are exact and
independent of the machine's load. The gradients are counted inside the step, after they are complete (FSDP:
reduce-scattered; DDP: all-reduced). The planner's "distributed optimizer" predicts moments / dp; FSDP2 also
shards the parameters and gradients (ZeRO-3).
"""
from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = [dict(tp=1, pp=1, dp=4), dict(tp=2, pp=1, dp=2), dict(tp=1, pp=2, dp=2)]


def job(ctx, dp_mode: str) -> dict:
    import torch
    from transformers import LlamaConfig

    from tensorpar.grads import local_tensor
    from tensorpar.train.loop import Trainer
    from tensorpar.train.config import TrainConfig
    from tensorpar.hf.presets import PRESETS
    from tensorpar.train.data import TrainData
    from tensorpar.train.model import ModelSource, build_model

    c = ctx.config
    cfg = TrainConfig(model="small", tp=c.tp, pp=c.pp, dp=c.dp, micro_batches=2 if c.pp > 1 else 1, seq_len=64,
                      batch_size=8, steps=1, dp_mode=dp_mode, schedule="gpipe")
    g = torch.Generator().manual_seed(0)
    data = TrainData.from_tokens(torch.randint(0, 256, (20000,), generator=g), 256, val_fraction=0.1,
                                 source="random")
    model_cfg = LlamaConfig(vocab_size=256, max_position_embeddings=256, rms_norm_eps=1e-5, **PRESETS["small"])
    model, plan = build_model(cfg, ModelSource(model_cfg, None, None), ctx.tp, data.vocab_size)
    tr = Trainer(cfg, ctx, model, plan, data)
    grads = {}

    def count(t):
        grads["bytes"] = sum(local_tensor(p.grad).numel() * p.grad.element_size() for p in t.params
                             if p.grad is not None)
    tr.train_step(inspect=count)
    params = sum(local_tensor(p.detach()).numel() * p.element_size() for p in tr.params)
    return dict(rank=ctx.rank, params=params, grads=grads["bytes"], moments=tr.optimizer_state_bytes())


def main() -> None:
    from tensorpar.parallel import ParallelConfig
    from tensorpar.testing import WorkerPool

    rows = []
    for lay in LAYOUTS:
        pc = ParallelConfig(**lay)
        with WorkerPool(pc.world_size, pc, collective_timeout_s=120.0) as pool:
            for mode in ("ddp", "fsdp"):
                for r in pool.run(job, mode):
                    rows.append(dict(lay, dp_mode=mode, **r))
                    print(rows[-1], flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    out = REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "fsdp_memory.json").write_text(json.dumps({"commit": commit, "rows": rows}, indent=1) + "\n")
    mib = 1 / 2 ** 20
    lines = ["# Per-rank training state, --dp-mode ddp vs fsdp (bench/bench_fsdp_memory.py)", "",
             f"`small` preset, vocab 256, fp32, 4 gloo ranks, commit {commit}. Bytes counted from each rank's "
             "tensors after one step (exact; no allocator noise). Largest rank of each layout shown; the "
             "ratio is fsdp / ddp.", "",
             "| layout | params MiB ddp | fsdp | grads MiB ddp | fsdp | AdamW moments MiB ddp | fsdp | moments ratio | 1/dp |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for lay in LAYOUTS:
        name = " ".join(f"{k}{v}" for k, v in lay.items() if v > 1)
        worst = {m: {k: max(r[k] for r in rows if r["dp_mode"] == m and all(r[a] == lay[a] for a in lay))
                     for k in ("params", "grads", "moments")} for m in ("ddp", "fsdp")}
        d, f = worst["ddp"], worst["fsdp"]
        lines.append(f"| {name} | {d['params'] * mib:.3f} | {f['params'] * mib:.3f} | {d['grads'] * mib:.3f} | "
                     f"{f['grads'] * mib:.3f} | {d['moments'] * mib:.3f} | {f['moments'] * mib:.3f} | "
                     f"{f['moments'] / d['moments']:.3f} | {1 / lay['dp']:.3f} |")
    lines += ["", "Under FSDP the dp ranks' moments add up to DDP's exactly (tests/train/test_fsdp.py checks it); a rank "
              "holds a little more than 1/dp when a tensor's rows do not divide by dp (torch.chunk's rule: "
              "ceil(rows / dp) rows, the last rank fewer).", ""]
    (out / "fsdp_memory.md").write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {out / 'fsdp_memory.md'}")


if __name__ == "__main__":
    os.environ.setdefault("TENSORPAR_THREADS", "1")
    main()
