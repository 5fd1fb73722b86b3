"""Memory per rank of a LoRA run (``tensorpar train --lora R``) against full fine-tuning, SmolLM2-135M at tp 2.

    PYTHONPATH=. python bench/bench_lora_memory.py          # writes bench/results/lora_memory.{json,md}

Both runs load SmolLM2-135M's weights (fp32) sharded over 2 gloo ranks and take 2 optimiser steps on random tokens
(seq 64, batch 2). Per rank, counted from the tensors themselves (exact, independent of the machine's load): the
parameters held (frozen base included), the gradients after they are complete, the AdamW moments; and the peak of
live tensors during the second step (:func:`tensorpar.train.autoplan.measure.step_with_tensor_peak`: parameters,
optimizer state and every activation until it is freed), plus the resident-set growth of the rank process
(:class:`tensorpar.train.autoplan.PeakMemory`; each run in fresh rank processes). LoRA: r 8, alpha 16, on q_proj, k_proj, v_proj, o_proj (PEFT's names).
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TP = 2
LORA = dict(lora_r=8, lora_alpha=16.0, lora_target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))


def job(ctx, folder: str, lora: bool) -> dict:
    import torch
    from transformers import AutoConfig

    from tensorpar.train.autoplan import PeakMemory
    from tensorpar.train.autoplan.measure import step_with_tensor_peak
    from tensorpar.train.config import TrainConfig
    from tensorpar.train.data import TrainData
    from tensorpar.train.loop import Trainer
    from tensorpar.train.model import ModelSource, build_model

    config = AutoConfig.from_pretrained(folder)
    cfg = TrainConfig(model=folder, tp=ctx.tp.size, seq_len=64, batch_size=2, steps=2, lr=1e-4,
                      **(LORA if lora else {}))
    g = torch.Generator().manual_seed(0)
    data = TrainData.from_tokens(torch.randint(0, config.vocab_size, (4000,), generator=g), config.vocab_size,
                                 val_fraction=0.1, source="random")
    peak = PeakMemory(ctx.device)
    model, plan = build_model(cfg, ModelSource(config, Path(folder), Path(folder)), ctx.tp, data.vocab_size)
    tr = Trainer(cfg, ctx, model, plan, data)
    grads = {}

    def count(t):
        grads["bytes"] = sum(p.grad.numel() * p.grad.element_size() for p in t.params if p.grad is not None)
    tr.train_step(inspect=count)
    _, tensor_peak = step_with_tensor_peak(tr)
    held = {id(p): p for p in tr.model.parameters()}.values()
    return dict(rank=ctx.rank, mode="lora" if lora else "full",
                params=sum(p.numel() * p.element_size() for p in held),
                trainable=sum(p.numel() * p.element_size() for p in tr.params),
                grads=grads["bytes"], moments=tr.optimizer_state_bytes(), tensor_peak=tensor_peak,
                rss_growth=peak.peak_bytes())


def main() -> None:
    from tensorpar.hub import resolve_model
    from tensorpar.testing import WorkerPool

    folder = str(resolve_model("smollm2"))
    rows = []
    for lora in (True, False):   # a fresh pair of rank processes per run: the resident set starts clean
        with WorkerPool(TP, collective_timeout_s=600.0, job_timeout_s=3600.0) as pool:
            for r in pool.run(job, folder, lora):
                rows.append(r)
                print(r, flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    cpu = next((ln.split(":", 1)[1].strip() for ln in subprocess.run(["lscpu"], capture_output=True, text=True)
                .stdout.splitlines() if ln.startswith("Model name")), platform.processor())
    load = os.getloadavg()
    out = REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    meta = {"commit": commit, "cpu": cpu, "cores": os.cpu_count(), "loadavg": load, "tp": TP, "lora": LORA}
    (out / "lora_memory.json").write_text(json.dumps({**meta, "rows": rows}, indent=1, default=list) + "\n")
    mib = 1 / 2 ** 20
    lines = ["# Memory per rank: LoRA vs full fine-tuning (bench/bench_lora_memory.py)", "",
             f"SmolLM2-135M-Instruct, fp32, tp {TP} (gloo, CPU), seq 64 x batch 2, commit {commit}; {cpu}, "
             f"{os.cpu_count()} cores, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (shared machine). "
             f"LoRA r {LORA['lora_r']}, alpha {LORA['lora_alpha']:g}, on {', '.join(LORA['lora_target_modules'])}. "
             "Largest rank shown. Parameters, gradients and AdamW moments are counted from the tensors (exact); "
             "the tensor peak is the live-tensor peak of the second step (weights, gradients, optimizer state, "
             "activations); RSS growth is the rank process's resident set since before the model was built.", "",
             "| per rank, MiB | params held | trainable | grads | AdamW moments | tensor peak (step 2) | RSS growth |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    worst = {}
    for mode in ("full", "lora"):
        w = {k: max(r[k] for r in rows if r["mode"] == mode) for k in
             ("params", "trainable", "grads", "moments", "tensor_peak", "rss_growth")}
        worst[mode] = w
        lines.append(f"| {mode} | " + " | ".join(f"{w[k] * mib:.1f}" for k in
                                                  ("params", "trainable", "grads", "moments", "tensor_peak",
                                                   "rss_growth")) + " |")
    f, lo = worst["full"], worst["lora"]
    lines += ["", f"LoRA / full: tensor peak {lo['tensor_peak'] / f['tensor_peak']:.2f}, gradients "
              f"{lo['grads'] / f['grads']:.4f}, AdamW moments {lo['moments'] / f['moments']:.4f}. The base weights "
              "are held either way (frozen, sharded); what LoRA removes is their gradients and optimizer state.", ""]
    (out / "lora_memory.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    os.environ.setdefault("TENSORPAR_THREADS", "1")
    main()
