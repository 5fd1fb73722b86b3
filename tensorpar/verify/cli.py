"""The ``tensorpar verify`` command: its arguments, its checks before any rank starts, the ranks, the report.

:func:`validate` checks the settings in the launching process; :func:`main` starts the ranks of each tp degree
(:func:`tensorpar.launch.run_ranks`), each of which builds the reference and the sharded model from the same
weights (:func:`build_pair`) and compares them (:func:`~tensorpar.verify.compare.compare_to_reference`); rank 0
writes its report, and :func:`format_table` prints them all.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from tensorpar.comm import Group
from tensorpar.verify.compare import compare_to_reference


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tensorpar.cli import add_launch_arguments

    p.add_argument("--model", default="smollm2",
                   help="a training preset (tiny, small, bench; random weights, seed 0), a Hugging Face-format "
                        "folder, or 'smollm2'")
    add_launch_arguments(p, tp_list=True, ep=True)  # --tp-weights numbers: applied to the --tp degree with as many
    #                                                  ranks;
    #                                        auto: to every degree above 1
    p.add_argument("--sequence-parallel", action="store_true", help="shard with sequence parallelism")
    p.add_argument("--train", action="store_true", help="also compare loss, every gradient and the grad norm")
    from tensorpar.verify.prove import add_arguments as add_discover_arguments
    add_discover_arguments(p)
    from tensorpar.decode.quantize import add_quantize_argument
    add_quantize_argument(p)  # both the reference (plain PyTorch) and the sharded model store their weights so
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per row (default: the smallest multiple of every tp that is >= 16)")
    p.add_argument("--batch-size", type=int, default=2, help="rows of random token ids")
    p.add_argument("--json", default=None, help="also write the full report to this file")


def _parse_tp(text: str) -> list[int]:
    try:
        tps = [int(t) for t in str(text).split(",") if t.strip()]
    except ValueError:
        tps = []
    if not tps or any(t < 1 for t in tps):
        raise ValueError(f"--tp {text!r}: give comma-separated positive integers, e.g. --tp 2,3,4")
    if len(set(tps)) != len(tps):
        raise ValueError(f"--tp {text!r}: names a tp more than once; give each once, e.g. --tp "
                         f"{','.join(map(str, dict.fromkeys(tps)))}")
    return tps


def check_report_path(path: str) -> None:
    """``--json FILE``: a file the launching process can write once every layout is verified (``FILE.tmp``, then
    renamed), checked before any rank starts. Raises ValueError naming the setting."""
    target = Path(path)
    if not path.strip() or target.is_dir():
        raise ValueError(f"--json {path!r}: not a file name (a folder or empty); give a file, e.g. --json report.json")
    folder = target.parent
    if not folder.is_dir():
        raise ValueError(f"--json {path!r}: the folder {str(folder)!r} does not exist; create it or write elsewhere")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"--json {path!r}: the folder {str(folder)!r} is not writable here; write elsewhere")


def _model_config(spec: str, seq_len: int):
    """``(config, folder or None)`` of ``--model``."""
    from tensorpar.hf.presets import PRESETS, preset_config

    if spec in PRESETS:
        return preset_config(spec, PRESET_VOCAB, seq_len), None
    from transformers import AutoConfig

    from tensorpar.hub import resolve_model
    try:
        folder = str(resolve_model(spec))
    except FileNotFoundError as e:       # the hub names its aliases; verify also takes the synthetic presets
        raise FileNotFoundError(f"{e} verify also takes the presets {', '.join(PRESETS)}.") from None
    return AutoConfig.from_pretrained(folder), folder


PRESET_VOCAB = 997  # prime: every tp > 1 splits it unevenly


@dataclass(frozen=True)
class VerifyTask:
    """What every rank of one ``tensorpar verify`` layout runs (:attr:`tensorpar.job.Job.task`).

    Attributes:
        spec: ``--model`` as given (a preset name, or the folder's spec; the report names it).
        seq_len, batch_size: the random token ids compared (``[batch_size, seq_len]``, seed 1234).
        train: also compare loss, gradients and the grad norm.
        sequence_parallel: shard with sequence parallelism.
        quantize: ``--quantize`` (both models quantized).
        out_path: where rank 0 writes its report (JSON).
    """

    spec: str
    seq_len: int
    batch_size: int
    train: bool
    sequence_parallel: bool
    quantize: str
    out_path: str


def validate(args: argparse.Namespace, out_dir: str = ""):
    """Checks made once, before any rank starts. Returns one :class:`~tensorpar.job.Job` per ``--tp`` degree, each
    with the config read once and its plan made once (none with ``--tp-weights auto`` above tp 1: its ranks make it
    after measuring); rank 0 of the degree ``t`` writes its report to ``<out_dir>/tp<t>.json``."""
    from tensorpar.capacity import plan_for_model
    from tensorpar.hf.families import is_causal_lm
    from tensorpar.job import job_from_args
    from tensorpar.parallel import ParallelConfig

    tps = _parse_tp(args.tp)
    if getattr(args, "json", None) is not None:
        check_report_path(args.json)
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    lcm = math.lcm(*tps)
    seq = args.seq_len if args.seq_len is not None else lcm * math.ceil(16 / lcm)
    if seq < 2:
        raise ValueError(f"--seq-len must be >= 2 (the loss needs a next token), got {seq}")
    if args.sequence_parallel and seq % lcm:
        raise ValueError(f"--seq-len {seq} is not divisible by every tp in {tps} (sequence parallelism needs it); "
                         f"use a multiple of {lcm}")
    from tensorpar.cli import check_launch_arguments
    check_launch_arguments(args, exact="verify proves a layout against the exact bound (int8's quality cost is "
                                       "measured by bench/bench_tp_comm.py, docs/collectives.md)")
    if getattr(args, "ep", 1) > 1 and getattr(args, "train", False):
        raise ValueError(f"--ep {args.ep} with --train: verify compares expert-parallel models in the forward pass "
                         f"only; drop --train (tensorpar train --ep checks training against one process) or --ep")
    quantize = getattr(args, "quantize", "none")
    if quantize != "none" and getattr(args, "train", False):
        raise ValueError(f"--quantize {args.quantize} cannot run with --train (a quantized model has no trainable "
                         f"weights: it is for inference); drop --train or use --quantize none")
    config, folder = _model_config(args.model, seq)
    if not is_causal_lm(getattr(config, "model_type", None)):
        raise ValueError(f"{args.model}: model_type={config.model_type!r} is not a causal language model; verify "
                         f"runs decoders")
    from tensorpar.hf.load import follow_stored_ties, resolve_attn_implementation
    attn = resolve_attn_implementation(config)  # decided here; every rank runs this one
    if folder is not None:  # as the loader does, before the plans (a stored, untied head)
        follow_stored_ties(folder, config, getattr(torch, args.dtype))
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and seq > limit:
        raise ValueError(f"--seq-len {seq} exceeds the model's max_position_embeddings={limit}")
    from tensorpar.cli import check_ep_for_model
    check_ep_for_model(args, config)
    from tensorpar.verify.prove import resolve_flags
    resolve_flags(args, config, train=args.train)   # --discover-plan: proven, then the ranks' plan file
    user_plan = os.path.abspath(args.plan_file) if getattr(args, "plan_file", None) is not None else None
    w = getattr(args, "tp_weights", None)
    if w is not None and str(w).strip().lower() != "auto":
        n = len(str(w).split(","))
        if n not in tps:
            raise ValueError(f"--tp-weights {w} has {n} entries but no --tp degree in {tps} has {n} ranks; give one "
                             f"weight per rank of one of the degrees (or 'auto')")
    jobs = []
    for t in tps:
        weights = _weights_for(w, t)
        weights, plan = plan_for_model(weights, t, config, sequence_parallel=args.sequence_parallel,  # ValueError
                                       user_plan=user_plan, tp_name="--tp")
        from tensorpar.decode.quantize import check_quantize
        check_quantize(quantize, config, plan, args.dtype)
        task = VerifyTask(args.model, seq, args.batch_size, bool(args.train), bool(args.sequence_parallel), quantize,
                          os.path.join(out_dir, f"tp{t}.json"))
        jobs.append(job_from_args(args, ParallelConfig(tp=t, dp=getattr(args, "ep", 1), tp_weights=weights), folder=folder, model_config=config,
                                  plan=None if weights == "auto" else plan, user_plan=user_plan,
                                  attn_implementation=attn, task=task))
    return jobs


def _weights_for(w, tp_size: int):
    """The ``tp_weights`` a verify run at ``tp_size`` shards with, of ``--tp-weights`` ``w``: ``"auto"`` above tp 1;
    numbers at the degree with as many ranks; else ``None`` (even)."""
    if w is None or tp_size == 1:
        return None
    if str(w).strip().lower() == "auto":
        return "auto"
    return w if len(str(w).split(",")) == tp_size else None


def _rank_main(job) -> int:
    """One rank of one verify layout: build the reference and this rank's shard from the same weights, compare them,
    and write the report (rank 0)."""
    from tensorpar.job import rank_weights, start

    task: VerifyTask = job.task
    ctx = start(job)
    try:
        weights = rank_weights(job, ctx) if job.plan is None else job.parallel.tp_weights
        ref, par = build_pair(task.spec, job.folder, ctx.tp, dtype=job.torch_dtype, device=ctx.device,
                              seq_len=task.seq_len, sequence_parallel=task.sequence_parallel, tp_weights=weights,
                              attn_implementation=job.attn_implementation, config=job.model_config, plan=job.plan,
                              user_plan=job.user_plan)
        if job.parallel.dp > 1:   # --ep: the ep replicas of the tp ranks (dp axis), each with the same input
            from tensorpar.hf.modules import expert_parallelize
            expert_parallelize(par, ctx.dp)
            par.to(ctx.device)   # the experts' owner table is made on the CPU
        if task.quantize != "none":     # the reference: quantized by compare_to_reference, after its fp run
            from tensorpar.decode.quantize import apply_quantize
            apply_quantize(par, ctx.tp, task.quantize)
        g = torch.Generator().manual_seed(1234)
        ids = torch.randint(0, ref.config.vocab_size, (task.batch_size, task.seq_len), generator=g).to(ctx.device)
        from tensorpar import fingerprint
        checking = job.check_collectives or fingerprint.enable_from_env(ctx.tp) is not None
        if checking:   # the sharded model's collectives and the inputs compared, once before and once after
            fingerprint.enable(ctx.tp, timeout_s=min(job.timeout_s / 2, 60.0), model=par)  # sites: par's modules
            fingerprint.check(ctx.tp, {"input_ids": ids}, force=True)
        rep = compare_to_reference(ref, par, ctx.tp, ids, train=task.train, quantize=task.quantize)
        if checking:
            fingerprint.check(ctx.tp, force=True)
        if ctx.rank == 0:
            tmp = task.out_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(dict(rep.to_dict(), tp_weights=list(weights) if weights else None), f)
            os.replace(tmp, task.out_path)
    finally:
        ctx.destroy()
    return 0


def build_pair(spec: str, folder: str | None, tp: Group, *, dtype=torch.float32, device=None, seq_len: int = 16,
               sequence_parallel: bool = False, tp_weights=None, attn_implementation: str | None = None,
               user_plan=None, config=None, plan=None):
    """``(reference, sharded)``: the unsharded model and this rank's sharded copy, same weights, eval mode.
    ``tp_weights``: shard by these relative rank speeds (:mod:`tensorpar.capacity`; default even).
    ``attn_implementation``: both models' attention; None: the one transformers picks for the config
    (:func:`~tensorpar.hf.load.resolve_attn_implementation`). ``user_plan``: a plan file (``--discover-plan``'s).

    A folder is loaded twice: whole (transformers) and sharded (:func:`~tensorpar.hf.load.build_parallel_model`,
    the path ``generate`` and ``train`` use, so load bugs show). A preset gets random weights (seed 0, norms
    perturbed too) on every rank. ``config`` / ``plan``: the model's config and the plan for ``tp.size`` ranks as the
    launching process made them (a :class:`~tensorpar.job.Job`'s): neither is read nor made again here."""
    from transformers import AutoModelForCausalLM

    from tensorpar.hf.apply import parallelize
    from tensorpar.hf.plan import make_plan

    if folder is not None:
        from tensorpar.hf.load import build_parallel_model
        given = {} if config is None else {"config": copy.deepcopy(config)}
        ref = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn_implementation,
                                                   **given)
        par, _ = build_parallel_model(folder, tp, sequence_parallel=sequence_parallel, dtype=dtype, device=device,
                                      tp_weights=tp_weights, attn_implementation=attn_implementation,
                                      user_plan=user_plan, config=config, plan=plan)
    else:
        config = _model_config(spec, seq_len)[0] if config is None else copy.deepcopy(config)
        from tensorpar.hf.load import resolve_attn_implementation
        config._attn_implementation = attn_implementation or resolve_attn_implementation(config)
        from tensorpar.testing import random_model
        ref = random_model(config)
        ref = ref.to(dtype)
        if plan is None:
            plan = make_plan(config, tp.size, sequence_parallel=sequence_parallel, tp_weights=tp_weights,
                             user_plan=user_plan)
        par = parallelize(copy.deepcopy(ref), plan, tp)
    ref = ref.to(device).eval()
    return ref, par.to(device).eval()


def format_table(reports: list[dict]) -> str:
    """One row per compared module kind and tp: the largest difference and its tolerance."""
    lines = [f"{'tp':>3} {'module':<44} {'layer':>5} {'max |diff|':>11} {'tolerance':>11}  ok"]
    for r in reports:
        for d in r["diffs"]:
            if d["kind"] == "grad":
                continue
            layer = "" if d["layer"] is None else str(d["layer"])
            lines.append(f"{r['tp_size']:>3} {d['name'][:44]:<44} {layer:>5} {d['max_abs']:>11.3e} {d['tol']:>11.3e}"
                         f"  {'yes' if d['ok'] else 'NO'}")
        grads = [d for d in r["diffs"] if d["kind"] == "grad"]
        if grads:
            worst = max(grads, key=lambda d: d["max_abs"] / max(d["tol"], 1e-300))
            lines.append(f"{r['tp_size']:>3} {'gradients: ' + str(len(grads)) + ' params, worst ' + worst['name'][5:]:<44}"
                         f" {'':>5} {worst['max_abs']:>11.3e} {worst['tol']:>11.3e}  "
                         f"{'yes' if all(d['ok'] for d in grads) else 'NO'}")
            lines.append(f"{r['tp_size']:>3} {'replicated grads bit-identical across ranks':<44} {'':>5} {'':>11} "
                         f"{'':>11}  {'NO' if r['replicated_mismatch'] else 'yes'}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    import sys
    import tempfile

    from tensorpar.launch import run_ranks

    reports = []
    with tempfile.TemporaryDirectory(prefix="tensorpar-verify-") as tmp:
        try:
            jobs = validate(args, tmp)
        except (ValueError, FileNotFoundError, OSError) as e:
            from tensorpar.usage import refuse
            return refuse("verify", e)
        for job in jobs:
            rc = run_ranks(_rank_main, job.world_size, job, verbose=job.verbose)
            if rc:
                return rc
            with open(job.task.out_path) as f:
                reports.append(json.load(f))
    tps, seq = [job.parallel.tp for job in jobs], jobs[0].task.seq_len
    if args.json:
        tmpf = args.json + ".tmp"
        with open(tmpf, "w") as f:
            json.dump({"model": args.model, "dtype": args.dtype, "quantize": getattr(args, "quantize", "none"),
                       "seq_len": seq, "batch_size": args.batch_size, "train": args.train, "sequence_parallel": args.sequence_parallel, "layouts": reports}, f,
                      indent=1)
        os.replace(tmpf, args.json)
    for r in reports:
        first = next((d for d in r["diffs"] if not d["ok"]), None)
        if first is not None:
            where = "" if first["layer"] is None else f", layer {first['layer']}"
            print(f"tensorpar verify: FAILED at tp={r['tp_size']}: {first['name']} ({first['kind']}{where}): "
                  f"max |diff| {first['max_abs']:.3e} > tolerance {first['tol']:.3e}", file=sys.stderr)
            return 1
        if r["replicated_mismatch"]:
            print(f"tensorpar verify: FAILED at tp={r['tp_size']}: gradients of tp-replicated parameters differ "
                  f"between ranks: {', '.join(r['replicated_mismatch'][:8])}", file=sys.stderr)
            return 1
    print(format_table(reports))
    wts = "".join(f", tp={r['tp_size']} weights {','.join(f'{v:g}' for v in r['tp_weights'])}" for r in reports
                  if r.get("tp_weights"))
    q = getattr(args, "quantize", "none")
    q8 = f", {q} weights (both models stored so)" if q != "none" else ""
    ep = f", experts split over ep={args.ep}" if getattr(args, "ep", 1) > 1 else ""
    print(f"tensorpar verify: OK: {args.model} at tp {','.join(map(str, tps))} ({args.dtype}{q8}{wts}{ep}"
          f"{', sequence parallel' if args.sequence_parallel else ''}{', train' if args.train else ''}) matches the "
          f"unsharded model within tolerance")
    return 0
