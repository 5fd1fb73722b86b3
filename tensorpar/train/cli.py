"""``tensorpar train``: train or fine-tune a Llama-style decoder with tensor (and sequence) parallelism.

    tensorpar train --tp 2 --sequence-parallel --model small --data shakespeare --steps 500
    tensorpar train --tp 2 --model smollm2 --data shakespeare --lr 3e-4 --steps 200   # fine-tune
    tensorpar train --tp 4 --model small --resume runs/train                          # continue at another tp

Writes into ``--out``: ``metrics.jsonl`` (one line per step and per evaluation), ``loss.png`` (at the
end), ``checkpoints/step_NNNNNN/`` (every ``--save-every`` steps and at the end; tp-independent) and,
with ``--export DIR``, a Hugging Face model folder. Everything is checked before any rank starts.

The ranks' side (:func:`prepare`, :func:`run`) is in :mod:`tensorpar.train.ranks`, the checks of ``--resume`` in
:mod:`tensorpar.train.resume`; this module holds the command line, the other checks the launching process makes,
and :func:`main`.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from tensorpar.cli import ExplicitFlag
from tensorpar.train.config import DP_MODES, TrainConfig
from tensorpar.hf.presets import PRESETS
from tensorpar.planner.cluster import (inter_node_link, launch_hosts_words,  # the one rule of the link flags
                                       note_unused_link, spans_hosts)
from tensorpar.train.ranks import _rank_main, check_fast_collectives, prepare
from tensorpar.train.resume import check_resume, check_resume_data, check_resume_model, resume_after_restart
# also importable from here, as before the split (tests, bench_train)
from tensorpar.train.ranks import enable_tp_fast_collectives, run  # noqa: F401


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tensorpar.cli import add_launch_arguments

    d = TrainConfig()
    add_launch_arguments(p)   # --tp (world size = tp x pp x dp), --dtype, --timeout, ...
    p.add_argument("--pp", type=int, default=d.pp, action=ExplicitFlag, help="pipeline-parallel degree (stages; "
                                                                          "torch.distributed.pipelining)")
    p.add_argument("--dp", type=int, default=d.dp, action=ExplicitFlag, help="data-parallel degree (replicas; rank "
                                                                          "order tp fastest, then pp, then dp)")
    p.add_argument("--cp", type=int, default=d.cp, action=ExplicitFlag,
                   help="context-parallel degree: every sequence split over cp ranks (two chunks each, one early and "
                        "one late; rank order tp fastest, then cp); --seq-len must divide by 2 x cp; with --tp, "
                        "--sequence-parallel, --pp and --dp")
    p.add_argument("--cp-mode", choices=["ring", "all2all"], default=d.cp_mode, action=ExplicitFlag,
                   help="context-parallel attention: ring (key/value blocks passed around the cp ranks) or all2all "
                        "(Ulysses: query heads of each tp rank must divide by --cp)")
    p.add_argument("--ep", type=int, default=d.ep, help="expert-parallel degree: a mixture-of-experts model's experts "
                                                        "split whole over the dp ranks (each rank keeps E/ep "
                                                        "experts, tokens moved by all-to-all); --ep must equal "
                                                        "--dp and divide the number of experts; ddp, no pp")
    p.add_argument("--plan", default=None, metavar="auto|PLAN.json",
                   help="take tp, pp, dp, micro-batches, schedule, sequence parallelism and recomputation from the "
                        "planner: 'auto' (the fastest layout of --nproc ranks on this machine, measured once and "
                        "cached) or a file saved by 'tensorpar plan --json'; prints predicted vs measured at the end")
    p.add_argument("--nproc", type=int, default=None, help="ranks to start with --plan (under torchrun: its "
                                                           "WORLD_SIZE)")
    p.add_argument("--inter-node-bw", type=float, default=None, metavar="GB/s",
                   help="with --plan: the bandwidth of the link between hosts, GB/s per rank (1 Gbit/s = 0.125), "
                        "which prices the groups that span hosts (torchrun's nodes); default: this host's measured "
                        "link (docs/hosts.md)")
    p.add_argument("--inter-node-latency-us", type=float, default=None, metavar="US",
                   help="with --plan and --inter-node-bw: the latency of one small collective or send between hosts, "
                        "microseconds (default 20)")
    p.add_argument("--micro-batches", type=int, default=None, help="micro-batches per replica and step (default: "
                                                                   "pp, so that every stage has work; 1 without pp) "
                                                                              "(gradient accumulation)")
    p.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved-1f1b"], default=d.schedule, action=ExplicitFlag,
                   help="pipeline schedule (pp > 1)")
    p.add_argument("--dp-mode", choices=list(DP_MODES), default=d.dp_mode,
                   help="data parallelism: ddp (whole replicas, gradients all-reduced) or fsdp (FSDP2 fully_shard on "
                        "the dp axis: parameters, gradients and AdamW state sharded 1/dp, the planner's distributed "
                        "optimizer); a no-op at --dp 1")
    p.add_argument("--sequence-parallel", action="store_true", help="split activations along the sequence "
                                                                     "between blocks (seq_len must divide by tp)")
    p.add_argument("--model", default=d.model, help=f"a preset ({', '.join(PRESETS)}), a config.json (from "
                                                     f"scratch), a model folder or smollm2 (fine-tuned)")
    p.add_argument("--init", choices=["auto", "scratch", "pretrained"], default=d.init,
                   help="auto: pretrained weights when --model has them")
    p.add_argument("--data", default=d.data, help="'shakespeare' or a UTF-8 .txt file")
    p.add_argument("--tokenizer", default=d.tokenizer, help="auto (the model's, else bytes), bytes, smollm2, "
                                                            "or a model folder")
    p.add_argument("--val-fraction", type=float, default=d.val_fraction, help="share of the text held out "
                                                                              "for the validation loss, in (0, 0.5)")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per step (all tp ranks "
                                                                        "share one batch)")
    p.add_argument("--steps", type=int, default=d.steps, help="optimiser steps in total (a resumed run "
                                                              "continues up to it)")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (~3e-4 to fine-tune)")
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio, help="final lr / peak lr (cosine)")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="linear warm-up steps")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW decoupled decay (matrices)")
    p.add_argument("--grad-clip", type=float, default=d.grad_clip, help="global gradient-norm clip (0 = off)")
    p.add_argument("--label-smoothing", type=float, default=d.label_smoothing, help="in [0, 1]")
    p.add_argument("--attention-dropout", type=float, default=d.attention_dropout, help="in [0, 1)")
    p.add_argument("--hidden-dropout", type=float, default=d.hidden_dropout, help="in [0, 1)")
    p.add_argument("--bf16", dest="dtype", action="store_const", const="bfloat16",
                   help="the same as --dtype bfloat16 (bf16 autocast; fp32 weights and optimizer)")
    p.add_argument("--recompute", action="store_true", help="recompute each block's activations in backward")
    p.add_argument("--seed", type=int, default=d.seed, help="weights, data order and dropout masks")
    p.add_argument("--out", default=d.out_dir, help="output folder (metrics, plot, checkpoints); a fresh run "
                                                    "needs a new or empty one")
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="validation period in steps (0 = at "
                                                                        "the end only)")
    p.add_argument("--eval-batches", type=int, default=d.eval_batches, help="validation batches per evaluation")
    p.add_argument("--save-every", type=int, default=d.save_every, help="checkpoint period (0 = only at the end)")
    p.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints, help="newest checkpoints kept")
    p.add_argument("--resume", nargs="?", const="auto", default=None,
                   help="continue from a checkpoint (folder, or a checkpoint root); bare --resume: <out>/checkpoints")
    p.add_argument("--export", default=None, help="also write the final model as a Hugging Face folder here "
                                                  "(new or empty, or a previous export with --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="let --export replace a previous tensorpar export")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    g = p.add_argument_group("LoRA (PEFT's settings)")
    g.add_argument("--lora", type=int, default=None, metavar="R",
                   help="train LoRA adapters of rank R instead of every weight (base frozen, adapters sharded with "
                        "their projections; checkpoints hold the adapters, also as PEFT's adapter_model.safetensors)")
    g.add_argument("--lora-alpha", type=float, default=None, help="PEFT's lora_alpha (scaling lora_alpha / R; "
                                                                   "default PEFT's, 8)")
    g.add_argument("--lora-dropout", type=float, default=0.0, help="PEFT's lora_dropout, in [0, 1)")
    g.add_argument("--lora-target-modules", default=None, metavar="NAMES",
                   help="PEFT's target_modules, comma-separated (e.g. q_proj,k_proj,v_proj,o_proj); default PEFT's "
                        "for the family")


def default_micro_batches(pp: int, dp: int, batch_size: int) -> int:
    """Without pp, 1; with pp, the smallest count >= pp that divides each replica's rows (so every pipeline stage
    has a micro-batch in flight), else pp (and the batch-size check names the problem)."""
    if pp <= 1:
        return 1
    rows = batch_size // dp if dp >= 1 and batch_size % dp == 0 else 0
    return next((m for m in range(pp, rows + 1) if rows % m == 0), pp)


def drop_no_ops(args: argparse.Namespace, cfg: TrainConfig) -> tuple[TrainConfig, list[str]]:
    """Flags that do nothing at the degrees given: ``--sequence-parallel`` at tp 1 (nothing to split; it is turned
    off, as Megatron-LM does with a warning) and ``--schedule`` without pp > 1 (nothing to schedule; ignored, as
    torchtitan ignores its pipeline schedule at pp 1), ``--cp-mode`` at cp 1 (no attention crosses ranks; ignored).
    Returns the config to run and one warning line per flag.

    Warnings, not errors: the run computes the same thing either way, and a sweep over ``--tp``/``--pp`` that keeps
    the other flags fixed keeps working. Degrees set by ``--plan`` are the planner's: nothing is reported then.
    """
    notes = []
    if cfg.sequence_parallel and cfg.tp == 1:
        cfg = cfg.replace(sequence_parallel=False)
        notes.append("tensorpar: warning: --sequence-parallel has no effect at --tp 1 (it splits activations over "
                     "the tp ranks); running without it (use --tp 2 or more for sequence parallelism)")
    if "cp_mode" in (getattr(args, "explicit_flags", None) or ()) and cfg.cp == 1:
        notes.append(f"tensorpar: warning: --cp-mode {cfg.cp_mode} has no effect at --cp 1 (it is how attention "
                     f"crosses the cp ranks); ignored (use --cp 2 or more for context parallelism)")
    if "schedule" in (getattr(args, "explicit_flags", None) or ()) and cfg.pp == 1:
        notes.append(f"tensorpar: warning: --schedule {args.schedule} has no effect at --pp 1 (it orders the "
                     f"micro-batches of pipeline stages); ignored (use --pp 2 or more for a pipeline)")
    return cfg, notes


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` the flags describe (raises its ValueErrors, naming the flag)."""
    try:
        return _config_from_args(args)
    except ValueError as e:
        import re

        m = re.match(r"(\w+)=(\S+): (.*)", str(e), re.S)  # TrainConfig's "name=value: why" -> "--flag value: why"
        if m and m.group(1) in TrainConfig.__dataclass_fields__:
            flag = {"out_dir": "--out"}.get(m.group(1), "--" + m.group(1).replace("_", "-"))
            raise ValueError(f"{flag} {m.group(2)}: {m.group(3)}") from None
        if str(e).startswith("tp_weights "):  # tensorpar.capacity.check_tp_weights names the field: name the flag
            raise ValueError(f"--tp-weights {str(e)[len('tp_weights '):]}") from None
        raise


def _config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(model=args.model, init=args.init, data=args.data, tokenizer=args.tokenizer,
                       val_fraction=args.val_fraction, tp=args.tp, pp=args.pp, dp=args.dp, ep=getattr(args, "ep", 1),
                       cp=getattr(args, "cp", 1), cp_mode=getattr(args, "cp_mode", "ring"),
                       micro_batches=(args.micro_batches if args.micro_batches is not None
                                      else default_micro_batches(args.pp, args.dp, args.batch_size)),
                       schedule=args.schedule, dp_mode=args.dp_mode,
                       sequence_parallel=args.sequence_parallel,
                       # under --plan, tp comes from the plan: the weights are checked once it is set (run())
                       tp_weights=None if getattr(args, "plan", None) is not None else getattr(args, "tp_weights", None),
                       seq_len=args.seq_len, batch_size=args.batch_size, steps=args.steps, lr=args.lr,
                       min_lr_ratio=args.min_lr_ratio, warmup_steps=args.warmup_steps,
                       weight_decay=args.weight_decay, grad_clip=args.grad_clip,
                       label_smoothing=args.label_smoothing, attention_dropout=args.attention_dropout,
                       hidden_dropout=args.hidden_dropout, dtype=args.dtype,
                       recompute=args.recompute, seed=args.seed, out_dir=args.out, eval_every=args.eval_every,
                       eval_batches=args.eval_batches, save_every=args.save_every,
                       keep_checkpoints=args.keep_checkpoints,
                       fast_collectives=args.fast_collectives, lora_r=getattr(args, "lora", None),
                       lora_alpha=getattr(args, "lora_alpha", None), lora_dropout=getattr(args, "lora_dropout", 0.0),
                       lora_target_modules=getattr(args, "lora_target_modules", None))


def main(args: argparse.Namespace) -> int:
    from tensorpar.launch import locked_folder, run_ranks, under_torchrun
    from tensorpar.train.checkpoint import CheckpointError
    from tensorpar.train.config import check_out_dir
    from tensorpar.train.export import check_export_dir

    if under_torchrun() and args.resume is None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        if resume_after_restart(args):   # a rank died after the final checkpoint: nothing to redo
            return 0
    lock = contextlib.ExitStack()  # the --out lock, once taken
    try:  # every check that the launching process can make, cheapest first, before any rank starts
        if getattr(args, "plan", None) is not None and getattr(args, "ep", 1) > 1:
            raise ValueError(f"--plan {args.plan} and --ep {args.ep}: the planner does not plan expert parallelism; "
                             f"drop --plan and give --dp {args.ep} --ep {args.ep}, or drop --ep")
        cfg = config_from_args(args)
        choice = None
        if getattr(args, "plan", None) is not None:
            cfg, choice = plan_config(args, cfg)
            if getattr(args, "tp_weights", None) is not None:
                cfg = cfg.replace(tp_weights=args.tp_weights)
        elif getattr(args, "nproc", None) is not None:
            raise ValueError(f"--nproc {args.nproc} goes with --plan (auto or a plan file); without --plan the ranks "
                             f"are --tp x --pp x --cp x --dp")
        elif getattr(args, "inter_node_bw", None) is not None or getattr(args, "inter_node_latency_us", None) is not None:
            flag = "--inter-node-bw" if getattr(args, "inter_node_bw", None) is not None else "--inter-node-latency-us"
            raise ValueError(f"{flag} goes with --plan (it prices the planned layout's groups that span hosts); "
                             f"add --plan auto or drop {flag}")
        else:
            from tensorpar.usage import note
            cfg, notes = drop_no_ops(args, cfg)
            for text in notes:
                if int(os.environ.get("RANK", "0")) == 0:   # rank 0's, as the launch's other notes
                    note(args, text)
        if under_torchrun() and cfg.world_size != int(os.environ["WORLD_SIZE"]):
            cp = f" x --cp {cfg.cp}" if cfg.cp > 1 else ""
            raise ValueError(f"--tp {cfg.tp} x --pp {cfg.pp}{cp} x --dp {cfg.dp} = {cfg.world_size}, but "
                             f"torchrun started WORLD_SIZE={os.environ['WORLD_SIZE']} ranks; choose degrees whose "
                             f"product is {os.environ['WORLD_SIZE']}")
        from tensorpar.cli import check_launch_arguments
        check_launch_arguments(args, exact="train needs the exact gradients")
        check_fast_collectives(cfg)
        if not under_torchrun() or os.environ.get("RANK") == "0":  # one lock per run: the launcher / global rank 0
            lock.enter_context(locked_folder(cfg.out_dir, "--out"))  # held to the end: a second run is refused
        check_out_dir(cfg.out_dir, resume=args.resume)
        if args.export is not None:
            if Path(args.export).absolute() == Path(cfg.out_dir).absolute():
                raise ValueError(f"--export {args.export!r} is the --out folder; export into another folder")
            if not under_torchrun() or os.environ.get("RANK") == "0":   # a second run exporting here is refused
                lock.enter_context(locked_folder(args.export, "--export"))
            check_export_dir(args.export, overwrite=getattr(args, "overwrite", False))
        ckpt = check_resume(cfg, args.resume) if args.resume is not None else None
        source, data, plan = prepare(cfg, progress=not args.no_progress, flags=True)  # fills the caches; ranks read them
        if ckpt is not None:
            check_resume_data(cfg, data, ckpt)
            check_resume_model(source.config, ckpt, cfg)
        from tensorpar.job import Job
        from tensorpar.parallel import ParallelConfig
        from tensorpar.train.ranks import TrainTask
        task = TrainTask(cfg, args.resume, args.export, not args.no_progress, getattr(args, "overwrite", False),
                         choice.prediction() if choice is not None else None, source)
        job = Job(ParallelConfig(tp=cfg.tp, pp=cfg.pp, dp=cfg.dp, cp=cfg.cp, tp_weights=cfg.tp_weights),
                  float(args.timeout),
                  fast_collectives=cfg.fast_collectives, verbose=bool(getattr(args, "verbose", False)),
                  check_collectives=bool(getattr(args, "check_collectives", False)),
                  model_config=source.config, plan=None if cfg.tp_weights == "auto" else plan, task=task)
    except (ValueError, FileNotFoundError, OSError, CheckpointError) as e:
        from tensorpar.usage import refuse
        lock.close()
        return refuse("train", e)
    from tensorpar.usage import release_notes
    release_notes(args)   # the notes of accepted input, now that every check passed
    try:
        return run_ranks(_rank_main, job.world_size, job, verbose=job.verbose)
    finally:
        lock.close()


def plan_config(args: argparse.Namespace, cfg: TrainConfig):
    """``--plan auto | FILE``: the :class:`TrainConfig` of the planner's layout and the
    :class:`~tensorpar.train.autoplan.Choice`; prints the choice in one line (rank 0 under torchrun).

    Raises ValueError naming the setting: --plan together with --tp/--pp/--dp (or the other flags the plan
    sets), a rank count that is missing or differs from torchrun's, a plan that does not fit the ranks or model.
    """
    from dataclasses import replace

    from tensorpar.launch import rank0_print
    from tensorpar.train import autoplan

    explicit = set(getattr(args, "explicit_flags", None) or ())
    set_here = [f"--{k} {getattr(args, k)}" for k in ("tp", "pp", "dp", "cp") if k in explicit]
    if getattr(args, "micro_batches", None) is not None:
        set_here.append(f"--micro-batches {args.micro_batches}")
    set_here += [f"--{k.replace('_', '-')}" for k in ("sequence_parallel", "recompute") if getattr(args, k, False)]
    if set_here:
        raise ValueError(f"--plan {args.plan} and {' '.join(set_here)} both set the layout; drop "
                         f"{' '.join(s.split()[0] for s in set_here)} (the plan sets them) or drop --plan")
    world, local = autoplan.env_nproc()
    nproc, source = args.nproc, "--nproc"
    if nproc is not None and nproc < 1:
        raise ValueError(f"--nproc {nproc}: must be a positive number of ranks")
    if world is not None:
        if nproc is not None and nproc != world:
            raise ValueError(f"--nproc {nproc} differs from torchrun's WORLD_SIZE={world}; drop --nproc under "
                             f"torchrun")
        nproc, source = world, f"torchrun's WORLD_SIZE={world}"
    if args.plan == "auto" and nproc is None:
        raise ValueError("--plan auto needs the number of ranks to plan for: add --nproc N (or launch with torchrun)")
    plan_ranks = nproc if args.plan == "auto" else autoplan.check_plan_file(args.plan, nproc, source)[0].num_devices
    link = inter_node_link(args, crosses_hosts=spans_hosts(plan_ranks, local or plan_ranks))
    note_unused_link(args, plan_ranks, local or plan_ranks, launch_hosts_words(world is None))
    source_cfg, _, _ = prepare(cfg.replace(tp=1, pp=1, dp=1, micro_batches=1, sequence_parallel=False),
                               progress=not args.no_progress)
    cal, path, cached = autoplan.cached_calibration(log=lambda m: rank0_print(f"tensorpar: {m}", file=sys.stderr))
    note = autoplan.describe_device_source(path, cached)
    from tensorpar.launch import machine_ranks
    device = replace(autoplan.rank_device(cal, plan_ranks, local or plan_ranks, load_now=autoplan._loadavg(),
                                          machine_ranks=machine_ranks()), **link)
    if args.plan == "auto":
        choice = autoplan.choose_auto(cfg, source_cfg.config, device, nproc, local, note=note)
    else:
        choice = autoplan.choose_from_file(args.plan, cfg, source_cfg.config, device, nproc, local,
                                           nproc_source=source, note=note)
    rank0_print(choice.summary())
    return choice.cfg, choice
