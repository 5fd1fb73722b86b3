"""Per-rank memory of a sharded load: resident growth against the bytes of the shard a rank holds.

What runs: for SmolLM2-135M (``resolve_model("smollm2")``, one fp32 safetensors file of 513 MiB)
at tp = 1, 2, 4, each rank's load runs in a fresh Python process (ranks one after another; loading
needs no collective, so each process gets a one-rank view ``Group(rank=r, size=tp)`` with no
process group). In every process the imports and the config are done first, then the resident set
(``/proc/self/statm``) is read and the peak counter reset (``/proc/self/clear_refs`` = 5), then one
of these builds runs, every parameter is read once (``p.float().sum()``, as a forward pass reads
it), then the resident set is read again (the peak, ``VmHWM``, is read right after the build):

* ``baseline``: plan, meta model, ``parallelize``, header checks -- everything but the weights
  (the fixed cost of a build);
* ``old``: the loader of commit ddaa177 (``safe_open(...).get_slice``: parameters are views into
  the memory-mapped file, kept here as ``_old_load_sharded``);
* ``new``: ``tensorpar.hf.load.build_parallel_model`` (plain reads into contiguous tensors);
* ``new-bf16``: the same with ``dtype=torch.bfloat16`` (fp32 file -> bf16 model: every tensor goes
  through the bounded bounce buffer and is converted chunk by chunk).

Growth is compared with the shard bytes the rank holds (its parameters, tied ones once, plus
buffers): target ``growth <= 1.1 x shard + baseline growth``. Page-cache pages filled by plain
reads are not part of a process's resident set; pages of a file mapping that a process touched are.

Usage::

    PYTHONPATH=. python bench/bench_load.py                 # ~3-4 min on 2 cores
    PYTHONPATH=. python bench/bench_load.py --tp 2          # one tp only

Writes ``bench/results/load.json`` and ``bench/results/load.md`` (``--out`` changes the directory;
``--render`` rewrites the Markdown from the JSON).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

MIB = 1 << 20
BOUNCE_MIB = 8  # tensorpar.hf.load.BOUNCE_BYTES, in MiB
METHODS = ("baseline", "old", "new", "new-bf16")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _old_load_sharded(model, folder, tp, *, device=None, dtype=None):
    """The loader as it was at commit ddaa177: ``get_slice`` views into the mapped file."""
    import torch
    import torch.nn as nn
    from safetensors import safe_open

    from tensorpar.hf.load import _runs, weight_map

    dtype = dtype or torch.float32
    device = torch.device(device or "cpu")
    wmap = weight_map(folder)
    handles, new = {}, {}

    def read_shard(handle, name, param, tp_rank):
        sl = handle.get_slice(name)
        dim = getattr(param, "tp_dim", None)
        if dim is None:
            return sl[:]
        parts = [sl[a:b] if dim == 0 else sl[:, a:b] for a, b in _runs(param.tp_partition.indices(tp_rank))]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim)

    try:
        for name, p in model.named_parameters():
            f = wmap[name]
            if f not in handles:
                handles[f] = safe_open(str(f), framework="pt").__enter__()
            t = read_shard(handles[f], name, p, tp.rank).to(device=device, dtype=dtype)
            q = nn.Parameter(t, requires_grad=p.requires_grad)
            for a in ("tp_dim", "tp_partition", "sequence_parallel"):
                if hasattr(p, a):
                    setattr(q, a, getattr(p, a))
            new[id(p)] = q
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    for m in model.modules():
        for pn, p in list(m._parameters.items()):
            if p is not None and id(p) in new:
                m._parameters[pn] = new[id(p)]
    return model


def child(method: str, tp_size: int, rank: int, folder: str) -> dict:
    """One rank's build in this (fresh) process; returns the measurements."""
    import gc

    import torch
    from transformers import AutoConfig

    from tensorpar.comm import Group
    from tensorpar.hf import load
    from tensorpar.hf.apply import parallelize
    from tensorpar.hf.plan import make_plan

    torch.set_num_threads(1)
    group = Group(pg=None, rank=rank, size=tp_size)
    AutoConfig.from_pretrained(folder)      # warm the config/tokenizer-free import paths
    gc.collect()
    rss0 = _rss()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                         # reset VmHWM to the current RSS
    t0 = time.perf_counter()
    dtype = torch.bfloat16 if method == "new-bf16" else torch.float32
    if method.startswith("new"):
        model, _ = load.build_parallel_model(folder, group, dtype=dtype)
    else:
        config = AutoConfig.from_pretrained(folder)
        plan = make_plan(config, tp_size)
        model = load._meta_model(config, dtype)
        load.check_checkpoint(folder, config)
        parallelize(model, plan, group)
        if method == "old":
            _old_load_sharded(model, folder, group, dtype=dtype)
    seconds = time.perf_counter() - t0
    hwm = _hwm()  # the load's own peak, before the reads below
    with torch.no_grad():  # read every weight once, as a forward pass does (faults in mapped pages)
        for p in model.parameters():
            if p.device.type != "meta":
                p.float().sum()
    gc.collect()
    rss1 = _rss()
    params = list(model.parameters())  # tied parameters once
    shard = sum(p.numel() * p.element_size() for p in params if p.device.type != "meta")
    if method == "baseline":
        shard = 0
    buffers = sum(b.numel() * b.element_size() for b in model.buffers() if b.device.type != "meta")
    contiguous = all(p.is_contiguous() and p.untyped_storage().nbytes() == p.numel() * p.element_size()
                     for p in params if p.device.type != "meta")
    return {"method": method, "tp": tp_size, "rank": rank, "rss_before": rss0, "growth": rss1 - rss0,
            "peak_growth": hwm - rss0, "shard_bytes": shard, "buffer_bytes": buffers, "seconds": seconds,
            "params_own_exact_storage": contiguous}


def run(folder: str, tps: list[int]) -> list[dict]:
    rows = []
    for tp in tps:
        for method in METHODS:
            for rank in range(tp):
                cmd = [sys.executable, __file__, "--child", method, str(tp), str(rank), folder]
                out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
                if out.returncode != 0:
                    raise RuntimeError(f"{method} tp={tp} rank={rank} failed:\n{out.stderr[-3000:]}")
                row = json.loads(out.stdout.strip().splitlines()[-1])
                rows.append(row)
                print(f"tp={tp} rank={rank} {method:<9} growth {row['growth'] / MIB:7.1f} MiB  "
                      f"peak {row['peak_growth'] / MIB:7.1f} MiB  shard {row['shard_bytes'] / MIB:7.1f} MiB",
                      flush=True)
    return rows


def table(rows: list[dict]) -> str:
    base = {(r["tp"], r["rank"]): r for r in rows if r["method"] == "baseline"}
    lines = ["| tp | rank | loader | shard MiB | growth MiB | peak growth MiB | growth - baseline MiB | "
             "(growth - baseline) / shard | target <= 1.1 | params own exact storage |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        b = base[(r["tp"], r["rank"])]
        if r["method"] == "baseline":
            lines.append(f"| {r['tp']} | {r['rank']} | baseline (no weights) | 0 | {r['growth'] / MIB:.1f} | "
                         f"{r['peak_growth'] / MIB:.1f} | - | - | - | - |")
            continue
        extra = r["growth"] - b["growth"]
        ratio = extra / r["shard_bytes"]
        lines.append(f"| {r['tp']} | {r['rank']} | {r['method']} | {r['shard_bytes'] / MIB:.1f} | "
                     f"{r['growth'] / MIB:.1f} | {r['peak_growth'] / MIB:.1f} | {extra / MIB:.1f} | {ratio:.2f} | "
                     f"{'yes' if ratio <= 1.1 else 'NO'} | {'yes' if r['params_own_exact_storage'] else 'no'} |")
    return "\n".join(lines)


def render(meta: dict, rows: list[dict]) -> str:
    """The results file's Markdown: how it was measured, the table, and what the columns mean."""
    lb, la = meta["loadavg_before"][0], meta["loadavg_after"][0]
    worst = {m: max(((r["growth"] - b["growth"]) / r["shard_bytes"]
                     for r in rows if r["method"] == m
                     for b in rows if b["method"] == "baseline" and (b["tp"], b["rank"]) == (r["tp"], r["rank"])),
                    default=float("nan")) for m in METHODS[1:]}
    return (f"# Sharded load: per-rank memory growth vs shard bytes\n\n"
            f"`PYTHONPATH=. python bench/bench_load.py` ({meta['date']}, commit {meta['commit']}, {meta['cpus']} CPUs, "
            f"load average {lb:.1f} before / {la:.1f} after: memory, not time, is measured, so load should not "
            f"change the numbers). Model {meta['model']}: one {meta['file_bytes'] / MIB:.0f} MiB fp32 safetensors "
            f"file. Each rank is a fresh process (ranks one after another). growth = resident set after the build "
            f"and one read of every weight - resident set before the build (imports done); peak = VmHWM during "
            f"the build only (the old loader's mapped pages are faulted in by the reads after it, so its peak "
            f"column is low and its growth is not); baseline = the same build without weights (plan, meta model, "
            f"parallelize, header checks). shard = bytes of the parameters the rank holds (tied ones once).\n\n"
            f"Worst (growth - baseline) / shard over all ranks and tp: old {worst['old']:.2f}, new {worst['new']:.2f}, "
            f"new-bf16 (fp32 file -> bf16 model, converted through the {BOUNCE_MIB} MiB bounce buffer) "
            f"{worst['new-bf16']:.2f}; target <= 1.1.\n\n"
            + table(rows) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", nargs=4, metavar=("METHOD", "TP", "RANK", "FOLDER"), help=argparse.SUPPRESS)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tp", type=int, action="append", help="tp degree (repeat; default 1, 2, 4)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--render", action="store_true", help="rewrite load.md from the existing load.json")
    a = ap.parse_args()
    if a.render:
        data = json.loads((Path(a.out) / "load.json").read_text())
        (Path(a.out) / "load.md").write_text(render(data["meta"], data["rows"]))
        return 0
    if a.child:
        method, tp, rank, folder = a.child
        print(json.dumps(child(method, int(tp), int(rank), folder)))
        return 0
    from tensorpar.hub import resolve_model

    folder = str(resolve_model(a.model))
    tps = a.tp or [1, 2, 4]
    load_before = os.getloadavg()
    rows = run(folder, tps)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    meta = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "commit": commit,
            "machine": platform.platform(), "cpus": os.cpu_count(), "model": a.model, "folder": folder,
            "file_bytes": sum(p.stat().st_size for p in Path(folder).glob("*.safetensors")),
            "loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    tmp = out / ".load.json.tmp"
    tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    os.replace(tmp, out / "load.json")
    md = render(meta, rows)
    tmp = out / ".load.md.tmp"
    tmp.write_text(md)
    os.replace(tmp, out / "load.md")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
