"""One job per run: what the launching process resolved, handed frozen to every rank.

``generate``, ``serve``, ``train`` and ``verify`` parse and check their flags in the launching process, read the
model's config once, build the sharding plan once, tokenize once, and put the result in a :class:`Job`;
:func:`tensorpar.launch.run_ranks` pickles it to each rank, whose entry function takes only the job. Rank code
reads neither argparse nor ``WORLD_SIZE`` / ``RANK``: the degrees are ``job.parallel``, the rank's identity is
its :class:`~tensorpar.parallel.ParallelContext` (torch.distributed's rank, after :func:`start`). Under torchrun
every process is a rank; it builds its job in-process, from the same flags, with the same checks.

What a rank still builds itself, and why: with ``--tp-weights auto`` the split depends on a measurement the ranks
make together after they start (:func:`tensorpar.parallel.init_parallel`), so the job carries no plan and each
rank makes its plan once, after measuring (:func:`load_model`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tensorpar.parallel import ParallelConfig


@dataclass(frozen=True)
class Job:
    """Everything a rank of one run needs, resolved by the launching process.

    Attributes:
        parallel: the degrees (tp, pp, dp) and ``tp_weights`` (a tuple, ``"auto"`` or ``None``); its product is the
            number of ranks.
        timeout_s: collective timeout (``--timeout``).
        fast_collectives: ``--fast-collectives`` (auto, on, off).
        tp_comm: ``--tp-comm`` (``"fp32"``, or ``"int8"``: the compressed tp all-reduce, inference only).
        check_collectives: ``--check-collectives``.
        verbose: ``--verbose``.
        dtype: ``--dtype`` (``"float32"`` or ``"bfloat16"``).
        folder: the resolved model folder (``None`` for a preset built from a config).
        model_config: the model's config, read once by the launching process (ties already followed); ranks
            shard and load with a copy of it and never read ``config.json``.
        plan: the :class:`~tensorpar.hf.plan.ShardingPlan` made once by the launching process; ``None`` with
            ``tp_weights="auto"`` (each rank makes it after measuring) or where a command builds no plan up front.
        user_plan: the absolute path of ``--plan-file`` (only read when a rank must make its plan).
        attn_implementation: the attention every rank runs (decided once, :func:`resolve_attn_implementation`).
        task: the command's own frozen settings (:class:`tensorpar.generate.GenerateTask`, ...).
        lora: ``--lora DIR`` of generate / serve: the absolute path of a PEFT LoRA adapter, checked against the
            model by the launching process; each rank merges it into its weight shards at load (:func:`load_model`).
    """

    parallel: ParallelConfig
    timeout_s: float
    fast_collectives: str = "auto"
    tp_comm: str = "fp32"
    check_collectives: bool = False
    verbose: bool = False
    dtype: str = "float32"
    folder: str | None = None
    model_config: Any = field(default=None, repr=False)
    plan: Any = field(default=None, repr=False)
    user_plan: str | None = None
    attn_implementation: str | None = None
    task: Any = None
    lora: str | None = None

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    @property
    def torch_dtype(self):
        import torch
        return getattr(torch, self.dtype)


def lora_from_args(args, model_config) -> str | None:
    """``--lora DIR`` of generate and serve checked against the model (:func:`tensorpar.hf.lora.check_adapter`: one
    line for a missing folder or an adapter of another base); its absolute path, or ``None`` without ``--lora``.
    ``validate`` calls it as soon as the config is read (before the tokenizer, the plan and the checkpoint's
    headers), and hands the result to :func:`job_from_args`."""
    lora = getattr(args, "lora", None)
    if not isinstance(lora, str):      # train's --lora is the adapters' rank (an int), not a folder
        return None
    from tensorpar.hf.lora import check_adapter
    return check_adapter(lora, model_config)


def job_from_args(args, parallel: ParallelConfig, **fields) -> Job:
    """The :class:`Job` of the shared launch flags in ``args`` (launching process only), plus ``fields``; ``--lora
    DIR`` (generate, serve) is ``fields["lora"]`` where the caller checked it already (:func:`lora_from_args`), else
    checked here against ``fields["model_config"]``."""
    if "lora" not in fields and isinstance(getattr(args, "lora", None), str):
        fields = dict(fields, lora=lora_from_args(args, fields["model_config"]))
    return Job(parallel=parallel, timeout_s=float(args.timeout),
               fast_collectives=getattr(args, "fast_collectives", "auto"), tp_comm=getattr(args, "tp_comm", "fp32"),
               check_collectives=bool(getattr(args, "check_collectives", False)),
               verbose=bool(getattr(args, "verbose", False)), dtype=getattr(args, "dtype", "float32"), **fields)


def start(job: Job, *, fast_collectives: str | None = None):
    """This rank's :class:`~tensorpar.parallel.ParallelContext` for ``job``: the process group over
    ``job.world_size`` ranks (the rank number is the launcher's: torchrun's agent or :func:`run_ranks`), the
    (dp, pp, tp) groups, shared-memory collectives as ``job.fast_collectives`` (or ``fast_collectives``) says,
    and the measured ``tp_weights`` with ``"auto"``."""
    from tensorpar.parallel import init_parallel

    return init_parallel(job.parallel, world_size=job.world_size, timeout_s=job.timeout_s,
                         fast_collectives=job.fast_collectives if fast_collectives is None else fast_collectives,
                         tp_comm=job.tp_comm)


def model_config(job: Job):
    """A copy of the job's model config (loading sets fields on it; the job stays as it was sent)."""
    import copy
    return copy.deepcopy(job.model_config)


def rank_weights(job: Job, ctx):
    """The ``tp_weights`` this rank shards with when the job has no plan (``"auto"``: measured, raised so that every
    rank keeps a head and a column, :func:`tensorpar.capacity.resolve_for_model`), else ``None``."""
    if job.plan is not None:
        return None
    from tensorpar.capacity import resolve_for_model
    return resolve_for_model(ctx, job.model_config)


def load_model(job: Job, ctx, **kwargs):
    """``(model, plan)``: this rank's shard of ``job.folder`` (:func:`tensorpar.hf.load.build_parallel_model`) with the
    job's config, plan, dtype and attention; the plan is made here only when the job carries none
    (:func:`rank_weights`). With ``job.parallel.dp > 1`` (``--ep`` of generate and serve) the experts are split
    whole over the dp axis (:func:`tensorpar.hf.modules.expert_parallelize`). With ``job.lora`` the PEFT adapter is
    merged into this rank's shards (:func:`tensorpar.hf.lora.merge_adapter`: merged at load, not applied unmerged).
    With ``job.parallel.pp > 1``
    (``generate`` and ``serve --pp``) this rank reads and holds only its pipeline stage (training's cut,
    :func:`tensorpar.pipeline.stages.keep_stage_modules`; the other layers are ``nn.Identity``) and the model
    carries ``tensorpar_stage`` (:class:`tensorpar.pipeline.inference.Stage`), which the decode engine reads."""
    from tensorpar.hf.load import build_parallel_model

    stage = None
    if job.parallel.pp > 1:
        from tensorpar.pipeline.inference import stage_of
        from tensorpar.pipeline.stages import keep_stage_modules
        stage = stage_of(job.model_config, ctx.pp.rank, ctx.pp.size)
        kwargs["keep"] = lambda m: keep_stage_modules(m, ctx.pp.rank, ctx.pp.size)
    model, plan = build_parallel_model(job.folder, ctx.tp, config=job.model_config, plan=job.plan,
                                       tp_weights=rank_weights(job, ctx), user_plan=job.user_plan,
                                       dtype=job.torch_dtype, device=ctx.device,
                                       attn_implementation=job.attn_implementation, **kwargs)
    if stage is not None:
        model.tensorpar_stage = stage
    if job.lora is not None:   # W_r += s * B A, this rank's part, before any decode preparation or quantization
        from tensorpar.hf.lora import merge_adapter
        merge_adapter(model, job.lora, ctx.tp.rank)
    if job.parallel.dp > 1:   # inference --ep: the dp axis holds the ep replicas of the tp ranks
        from tensorpar.hf.modules import expert_parallelize
        expert_parallelize(model, ctx.dp)
        model.to(ctx.device)   # the experts' owner table is made on the CPU
    return model, plan


def print0(ctx, *args, **kwargs) -> None:
    """Print on global rank 0 of ``ctx`` only (flushed)."""
    if ctx.rank == 0:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def load_tokenizer(folder, config, model: str):
    """The tokenizer of the model folder ``folder`` (``AutoTokenizer``, with its ``config`` already read), for the
    command that was given ``--model model``.

    Raises:
        ValueError: transformers cannot build one from the folder (no or unreadable tokenizer files): one line
            naming ``--model`` and what the folder needs.
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, config=config)
    except (OSError, ValueError, TypeError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--model {model!r}: no usable tokenizer in {folder} ({first[:160]}); the folder needs "
                         f"tokenizer.json, or tokenizer.model with tokenizer_config.json") from e
