"""What every rank of ``tensorpar train`` runs: the checks that need the model and data, then the training.

:func:`prepare` resolves the model and the data and runs the checks that need them (also in the launching
process, before any rank starts); :func:`run` trains on the ranks of a parallel context until ``cfg.steps``
(metrics, evaluation, checkpoints, export); :func:`_rank_main` is one rank of :func:`tensorpar.train.cli.main`
(process group, shared-memory collectives on the tp group, :func:`enable_tp_fast_collectives`).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from tensorpar.hf.presets import PRESETS
from tensorpar.train.config import TrainConfig


def enable_tp_fast_collectives(cfg: TrainConfig, ctx, timeout_s: float) -> bool:
    """Install the shared-memory collectives on ``ctx.tp`` as ``cfg.fast_collectives`` says (collective over the tp
    group; every rank calls it right after ``init_parallel``). Returns whether they are on. Only the tp group: its
    all-reduces are on the critical path of every layer; dp and pp keep torch.distributed (DDP/FSDP and the pipeline
    use the process groups directly). Raises ValueError (``"on"`` with tp ranks on several hosts) or CollectiveError
    (``"on"`` and no shared segment)."""
    if ctx.tp.size == 1 or cfg.fast_collectives == "off":
        return False
    from tensorpar.shm import enable_fast_collectives
    return enable_fast_collectives(ctx.tp, cfg.fast_collectives, timeout_s=timeout_s)


def check_fast_collectives(cfg: TrainConfig) -> None:
    """``--fast-collectives on`` needs the shared-memory protocol's x86 store ordering (checked before ranks start;
    whether the tp ranks share a host is checked by the ranks at start-up). Raises ValueError."""
    if cfg.fast_collectives == "on" and cfg.tp > 1:
        from tensorpar.shm.bootstrap import ordering_supported
        if not ordering_supported():
            raise ValueError("--fast-collectives on: the shared-memory collectives rely on x86 store ordering and this "
                             "machine is not x86; use --fast-collectives auto or off")


def prepare(cfg: TrainConfig, *, progress: bool = True, checks: bool = True, source=None, flags: bool = False):
    """Resolve model and data, and run every check that needs them. Returns ``(source, data, plan)``: ``plan`` is the
    sharding plan of ``cfg.tp`` ranks (an even split with ``tp_weights="auto"``, which the ranks measure), made once
    here, or ``None`` with ``checks=False``.

    ``source``: the :class:`~tensorpar.train.model.ModelSource` the launching process resolved (a rank's
    :class:`TrainTask` carries it), so that the model's config is not read again.

    ``checks=False``: the checks that build the sharding plan or cut the pipeline are left out (a rank of a run
    whose launching process made them already and sent the plan in the job).

    Raises ValueError / FileNotFoundError naming the setting (plan, context length, vocabulary, data).
    """
    from tensorpar.train.config import check_against_model, check_data_file, check_model_config, config_error
    from tensorpar.train.data import load_data, tokenizer_spec
    from tensorpar.train.model import resolve_source

    def source_of(vocab=None):
        try:
            return resolve_source(cfg, vocab) if vocab is not None else resolve_source(cfg)
        except (ValueError, OSError, RuntimeError):  # ours, missing files, downloads: already clear
            raise
        except Exception as e:  # transformers rejects the config (its own error types): one line, named
            raise config_error(f"--model {cfg.model}", e) from e

    check_data_file(cfg.data)
    given = source
    folder_source = None if cfg.model in PRESETS or cfg.model.endswith(".json") else (given or source_of())
    if checks and cfg.pp > 1 and folder_source is not None:   # refuse a family stages cannot cut before tokenizing
        from tensorpar.pipeline.stages import check_pipeline
        check_pipeline(folder_source.config, cfg.pp, 2 if cfg.schedule == "interleaved-1f1b" else 1,
                       cfg.micro_batches, cfg.schedule)
    tok = tokenizer_spec(cfg.tokenizer, folder_source.folder if folder_source else None)
    data = load_data(cfg.data, tok, val_fraction=cfg.val_fraction, progress=progress)
    source = folder_source or given or source_of(data.vocab_size)
    check_model_config(source.config, f"--model {cfg.model}")
    check_against_model(cfg, source.config, data.vocab_size, flags=flags)
    if not checks:
        return source, data, None
    if source.weights is not None:  # as the loader does, before the plan: a stored head unlike the embedding
        import torch

        from tensorpar.hf.load import follow_stored_ties
        follow_stored_ties(source.weights, source.config, torch.float32)
    from tensorpar.capacity import plan_for_model
    _, plan = plan_for_model(cfg.tp_weights, cfg.tp, source.config, sequence_parallel=cfg.sequence_parallel,
                             what="tp_weights", tp_name="--tp" if flags else "tp_size")
    if cfg.pp > 1:
        from tensorpar.pipeline.stages import check_pipeline
        check_pipeline(source.config, cfg.pp, 2 if cfg.schedule == "interleaved-1f1b" else 1, cfg.micro_batches,
                       cfg.schedule)
    if cfg.lora_r is not None:   # the target modules match, and the plan shards every adapter
        from tensorpar.train.lora import check_lora_model
        check_lora_model(cfg, source.config, plan)
    data.val_batches(batch_size=cfg.batch_size, seq_len=cfg.seq_len)  # at least one validation batch
    return source, data, plan


def run(cfg: TrainConfig, ctx, *, resume: str | None = None, export: str | None = None, progress: bool = True,
        prepared=None, overwrite: bool = False, check_collectives: bool = False, tensor_peak: bool = False,
        checked: bool = False, source=None, plan=None) -> dict:
    """Train on the ranks of ``ctx`` (any tp, pp, dp) until ``cfg.steps``; every rank calls it. Returns a summary dict.

    ``export``: also write the final checkpoint as a Hugging Face folder there (``overwrite``: it may
    replace a previous tensorpar export; see :func:`tensorpar.train.export.export_hf`).
    ``tensor_peak``: on a CPU, run the second step (the first if there is only one) under
    :func:`tensorpar.planner.calibrate.peak_memory_bytes` and report its peak of live tensors plus this rank's
    parameters and optimizer state as ``summary["tensor_peak_bytes"]`` (slower; the warm-up steps are left out of
    the step times' median anyway). The summary also holds every step's seconds
    (``step_times_s``) and the resident-set growth of this rank (``peak_memory_bytes``, :class:`PeakMemory`).
    ``checked``: the launching process ran :func:`prepare`'s checks for this ``cfg`` (:func:`main` does), so the
    ranks skip them and build the sharding plan once each, in :func:`~tensorpar.train.model.build_model`.
    ``source``, ``plan``: the launching process's :class:`~tensorpar.train.model.ModelSource` and sharding plan
    (:func:`prepare`); without a plan (``tp_weights="auto"``, or a caller of its own) the plan is made here, once.
    Raises FileExistsError when starting afresh (no ``resume``) over an earlier run's metrics.
    """
    from tqdm.auto import tqdm

    from tensorpar.train.loop import Trainer
    from tensorpar.train.metrics import MetricsLog, plot_losses
    from tensorpar.train.model import build_model

    source, data, made = prepared or prepare(cfg, progress=progress and ctx.rank == 0, checks=not checked,
                                             source=source)
    plan = plan or made
    if cfg.tp_weights == "auto":  # measured by init_parallel (ParallelConfig(tp_weights="auto"))
        from tensorpar.capacity import resolve_for_model
        cfg = cfg.replace(tp_weights=resolve_for_model(ctx, source.config) if ctx.tp.size > 1 else None)
        plan = None   # made by build_model, once, with the measured weights
    from tensorpar.train.autoplan import PeakMemory
    peak = PeakMemory(ctx.device)  # this rank's memory from here on (model, optimizer, activations)
    model, plan = build_model(cfg, source, ctx.tp, data.vocab_size, device=ctx.device, pp_rank=ctx.pp.rank,
                              ep=ctx.dp if cfg.ep > 1 else None, cp=ctx.cp, plan=plan)
    trainer = Trainer(cfg, ctx, model, plan, data)
    del model  # a pipeline stage keeps only its chunks; the other layers are freed here
    out = Path(cfg.out_dir)
    ckroot = out / "checkpoints"
    main = ctx.rank == 0
    if resume is not None:
        trainer.resume(ckroot if resume == "auto" else resume)
    metrics = MetricsLog(out / "metrics.jsonl", active=main)
    kept = metrics.start(trainer.step if resume is not None else None)
    if kept is not None and progress:
        print(f"tensorpar: note: {out / 'metrics.jsonl'} went past step {trainer.step}; the earlier file is kept "
              f"as {kept}", file=sys.stderr, flush=True)
    bar = tqdm(total=cfg.steps, initial=trainer.step, disable=not (main and progress), unit="step",
               desc=f"train tp={ctx.tp.size} pp={ctx.pp.size} dp={ctx.dp.size}"
                    f"{f' ep={cfg.ep}' if cfg.ep > 1 else ''}"
                    f"{' sp' if cfg.sequence_parallel else ''}")
    from tensorpar import fingerprint
    fp_on = check_collectives or fingerprint.enable_from_env(ctx.tp) is not None
    if fp_on:
        fingerprint.enable(ctx.tp, model=getattr(trainer, "model", None))  # call sites: the model's modules
    last = val = None
    step_times: list[float] = []
    tensor_peak_bytes = None
    peak_at = 1 if cfg.steps - trainer.step >= 2 else 0  # a step that holds the optimizer state (not the first)
    while trainer.step < cfg.steps:
        if tensor_peak and len(step_times) == peak_at and ctx.device.type == "cpu":
            from tensorpar.train.autoplan import step_with_tensor_peak
            r, tensor_peak_bytes = step_with_tensor_peak(trainer)
        else:
            r = trainer.train_step()
        step_times.append(r.time_s)
        if fp_on:  # the tp ranks issued the same collectives and agree on the loss (step 0, then every 50)
            fingerprint.check(ctx.tp, {"step": r.step, "loss": r.loss})
        last = r
        if r.step % cfg.log_every == 0 or r.step == cfg.steps:
            metrics.write({"kind": "train", "step": r.step, "loss": r.loss, "grad_norm": r.grad_norm, "lr": r.lr,
                           "tokens": r.tokens, "tokens_per_s": r.tokens_per_s, "step_time_s": r.time_s})
        bar.set_postfix(loss=f"{r.loss:.4f}", tok_s=f"{r.tokens_per_s:,.0f}")
        bar.update()
        if (cfg.eval_every and r.step % cfg.eval_every == 0) or r.step == cfg.steps:
            val = trainer.evaluate()
            metrics.write({"kind": "val", "step": r.step, "val_loss": val})
            if main and progress:
                bar.write(f"step {r.step}: val loss {val:.4f}")
        if cfg.save_every and r.step % cfg.save_every == 0 and r.step != cfg.steps:
            trainer.save(ckroot)
    bar.close()
    peak_bytes = peak.peak_bytes()  # before the checkpoint (which assembles full tensors)
    ckpt = trainer.save(ckroot)
    summary = {"step": trainer.step, "checkpoint": str(ckpt), "loss": last.loss if last else None,
               "val_loss": val, "metrics": str(out / "metrics.jsonl"), "step_times_s": step_times,
               "peak_memory_bytes": peak_bytes, "peak_memory_method": peak.method,
               "tensor_peak_bytes": tensor_peak_bytes}
    if main:
        try:
            summary["plot"] = str(plot_losses(out / "metrics.jsonl", out / "loss.png",
                                              title=f"{cfg.model} on {cfg.data}, tp={ctx.tp.size}"))
        except ImportError:  # matplotlib is optional (pip install tensorpar[plot])
            print(f"tensorpar: note: matplotlib is not installed, so no loss.png (pip install 'tensorpar[plot]'); "
                  f"the losses are in {out / 'metrics.jsonl'}", file=sys.stderr, flush=True)
        if export and cfg.lora_r is not None:   # the adapters, as PEFT saves them
            from tensorpar.train.lora import export_adapter
            summary["export"] = str(export_adapter(ckpt, export, overwrite=overwrite))
        elif export:
            from tensorpar.train.export import export_hf
            summary["export"] = str(export_hf(ckpt, export, overwrite=overwrite, progress=progress))
    return summary


@dataclass(frozen=True)
class TrainTask:
    """What every rank of ``tensorpar train`` runs (:attr:`tensorpar.job.Job.task`), resolved once.

    Attributes:
        cfg: the run's :class:`TrainConfig` (layout, model, data, optimizer).
        resume: ``--resume`` (``"auto"``, a checkpoint, or ``None``).
        export: ``--export`` folder, or ``None``.
        progress: show the progress bar (rank 0).
        overwrite: ``--overwrite`` (an export may replace an earlier tensorpar export).
        prediction: with ``--plan``, the planner's prediction to compare with what the run measures.
        source: the model source the launching process resolved (its config read once there).
    """

    cfg: TrainConfig
    resume: str | None = None
    export: str | None = None
    progress: bool = True
    overwrite: bool = False
    prediction: object = None
    source: object = field(default=None, repr=False)


def _rank_main(job) -> int:
    """One rank of ``tensorpar train``: the process group of ``job.parallel`` (none for one rank), shared-memory
    collectives on the tp group as ``cfg.fast_collectives`` says, then :func:`run`."""
    from tensorpar.job import print0, start
    from tensorpar.parallel import ParallelContext, set_rank_threads

    task: TrainTask = job.task
    cfg = task.cfg
    if job.world_size == 1:  # one process: no process group (and no port) needed
        set_rank_threads(1)
        ctx = ParallelContext.single()
    else:   # dp and pp keep torch.distributed: the shared-memory collectives go on the tp group only
        ctx = start(job, fast_collectives="off")
        enable_tp_fast_collectives(cfg, ctx, job.timeout_s)
    try:
        s = run(cfg, ctx, resume=task.resume, export=task.export, progress=task.progress, overwrite=task.overwrite,
                check_collectives=job.check_collectives, tensor_peak=task.prediction is not None, checked=True,
                source=task.source, plan=job.plan)
        val = "n/a" if s["val_loss"] is None else f"{s['val_loss']:.4f}"
        loss = "n/a" if s["loss"] is None else f"{s['loss']:.4f}"
        print0(ctx, f"done: step {s['step']}, train loss {loss}, val loss {val}; "
                    f"checkpoint {s['checkpoint']}" + (f"; exported {s['export']}" if "export" in s else ""))
        if task.prediction is not None:  # --plan: the planner's prediction next to what this run measured
            from tensorpar.train.autoplan import comparison_line, gather_measurements
            medians, counted, peaks = gather_measurements(ctx, s["step_times_s"], s["peak_memory_bytes"],
                                                          s["tensor_peak_bytes"])
            print0(ctx, comparison_line(task.prediction, medians, counted, peaks))
    finally:
        ctx.destroy()
    return 0
