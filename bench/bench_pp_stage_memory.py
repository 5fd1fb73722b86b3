"""Peak resident memory of one pipeline rank while its model is built: the whole model loaded and then cut
(``stage=False``, what every pp rank did before) against the stage cut on the meta device (``stage=True``: the rank
reads, or with ``--init scratch`` initialises, and materialises only its stage's weights,
:func:`tensorpar.pipeline.stages.keep_stage_modules`, :func:`tensorpar.train.model.init_from_seed`).

    PYTHONPATH=. python bench/bench_pp_stage_memory.py [--model smollm2] [--pp 2]   # writes bench/results/pp_stage_memory.md
    PYTHONPATH=. python bench/bench_pp_stage_memory.py --init scratch     # bench/results/pp_stage_memory_scratch.md

Each (mode, pp rank) runs in a fresh process at tp = 1: after the imports it records its resident set, builds the
model with :func:`tensorpar.train.model.build_model` (``--init``: pretrained weights or from the seed, fp32,
``pp_rank``), cuts its stage with
:func:`tensorpar.pipeline.stages.cut_stages` and drops the rest, as the trainer does. Reported: the peak resident
set (``ru_maxrss``) above the post-import baseline, the resident set once only the stage is kept, and the bytes of
the stage's parameters. No process group is needed (a stage's build has no collective at tp = 1).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import gc, json, resource, sys
import torch
from tensorpar.comm import Group
from tensorpar.pipeline.stages import cut_stages
from tensorpar.train.config import TrainConfig
from tensorpar.train.model import build_model, resolve_source
import transformers  # noqa: F401  (imported before the baseline)

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

model_spec, pp, rank, stage, init = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5]
cfg = TrainConfig(model=model_spec, pp=pp, micro_batches=pp, seq_len=64, batch_size=pp, init=init)
src = resolve_source(cfg, progress=False)
gc.collect()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
base_rss = rss()
model, plan = build_model(cfg.replace(pp=pp if stage else 1), src, Group.single("tp"), src.config.vocab_size,
                          pp_rank=rank)
stages = cut_stages(model, rank, pp)
del model
gc.collect()
params = sum(p.numel() * p.element_size() for s in stages for p in s.parameters())
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"peak_above_baseline": peak - max(base, base_rss), "kept_rss_above_baseline": rss() - base_rss,
                  "stage_param_bytes": params, "baseline_rss": base_rss}))
"""


def measure(model: str, pp: int, rank: int, stage: bool, init: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", CHILD, model, str(pp), str(rank), "1" if stage else "0", init],
                         env=env, cwd=REPO, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--init", choices=("pretrained", "scratch"), default="pretrained",
                    help="pretrained: read the stage's weights; scratch: initialise them from the seed")
    ap.add_argument("--out", default=None, help="default bench/results/pp_stage_memory[_scratch].md")
    a = ap.parse_args()
    a.out = a.out or str(REPO / f"bench/results/pp_stage_memory{'_scratch' if a.init == 'scratch' else ''}.md")
    sys.path.insert(0, str(REPO / "bench"))
    from machine import cpu_model
    cpu = cpu_model()
    load_before = os.getloadavg()
    rows = []
    for rank in range(a.pp):
        for stage in (False, True):
            r = measure(a.model, a.pp, rank, stage, a.init)
            rows.append(dict(rank=rank, stage=stage, **r))
            print(rows[-1], flush=True)
    load_after = os.getloadavg()
    mib = 2 ** 20
    how = "pretrained weights" if a.init == "pretrained" else "initialised from the seed, no checkpoint"
    lines = [f"# Peak memory of a pipeline rank while its model is built ({a.model}, {how}, pp = {a.pp}, fp32, "
             f"tp = 1)", "",
             f"`PYTHONPATH=. python bench/bench_pp_stage_memory.py --model {a.model} --pp {a.pp} --init {a.init}` "
             f"(bench/bench_pp_stage_memory.py; one fresh process per row).", "",
             f"CPU: {cpu} ({os.cpu_count()} cores); load average (1, 5, 15 min) {load_before[0]:.1f}, "
             f"{load_before[1]:.1f}, {load_before[2]:.1f} before and {load_after[0]:.1f}, {load_after[1]:.1f}, "
             f"{load_after[2]:.1f} after (the machine was shared).", "",
             "| pp rank | build | peak RSS above baseline (MiB) | RSS kept, stage only (MiB) | stage parameters (MiB) |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rank']} | {'stage cut on meta' if r['stage'] else 'whole model, then cut (before)'} | "
                     f"{r['peak_above_baseline'] / mib:.0f} | {r['kept_rss_above_baseline'] / mib:.0f} | "
                     f"{r['stage_param_bytes'] / mib:.0f} |")
    lines += ["", "Before: the rank builds the whole model (`build_model` at pp = 1) and then cuts its stage, as every "
              "pp rank did before the stage cut on the meta device.",
              "", "Peak: `ru_maxrss` above the larger of the post-import peak and resident set; it includes the "
              "loader's transient buffers. RSS kept: the resident set once only the stage is held (freed pages may "
              "stay with the allocator, so after a whole-model build it can exceed the stage's bytes)."]
    Path(a.out).write_text("\n".join(lines) + "\n")
    (Path(a.out).with_suffix(".json")).write_text(json.dumps(dict(model=a.model, pp=a.pp, init=a.init, cpu=cpu,
                                                                  rows=rows,
                                                                  load_before=load_before, load_after=load_after),
                                                             indent=1))
    print(Path(a.out).read_text())


if __name__ == "__main__":
    main()
