"""The layout ``tensorpar train`` runs: the planner's fastest runnable one, or the one a plan file names.

:func:`choose_auto` ranks every layout of the ranks given (:func:`planner_inputs`) and keeps the first that the
trainer runs (:func:`unsupported`, :func:`runtime_problem`); :func:`choose_from_file` reads a
``tensorpar plan --json`` file (:func:`read_plan_file`, :func:`check_plan_file`) and checks it against the ranks,
the model and the memory. Both return a :class:`Choice`: the scored plan and the :class:`TrainConfig` that runs it.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path


CPU_RESERVE_GIB = 0.5  # per rank on a CPU host: interpreter, torch and its libraries, process-group buffers


def planner_inputs(cfg, model_config, device, nproc: int, local_nproc: int | None = None):
    """``(ModelSpec, ClusterSpec, Workload, Assumptions)`` of ``cfg`` on ``nproc`` ranks of ``device``."""
    from tensorpar.planner.cluster import ClusterSpec
    from tensorpar.planner.layout import Assumptions, Workload
    from tensorpar.planner.model_spec import from_hf_config

    model = from_hf_config(model_config.to_dict(), name=cfg.model)
    per_node = local_nproc or nproc
    cluster = ClusterSpec(device, nproc, per_node if nproc % per_node == 0 else nproc)
    reserve = CPU_RESERVE_GIB if device.name.startswith("calibrated cpu") else Assumptions.reserve_gib
    assume = Assumptions(activation_bytes=2 if cfg.dtype == "bfloat16" else 4, param_bytes=4, grad_bytes=4,
                         optimizer_bytes=8, attention="sdpa", reserve_gib=reserve,
                         max_micro_batch=cfg.batch_size, virtual_stages=(1, 2))
    return model, cluster, Workload(cfg.batch_size, cfg.seq_len), assume


def layout_config(cfg, layout, global_batch: int):
    """The :class:`TrainConfig` that runs planner ``layout`` (raises the config's ValueError if it cannot). The
    schedule: interleaved 1F1B for ``virtual_stages`` 2, else the run's (1F1B unless ``--schedule gpipe``)."""
    m = layout.num_micro_batches(global_batch)
    if layout.virtual_stages > 1:
        schedule = "interleaved-1f1b"
    else:
        schedule = "1f1b" if cfg.schedule == "interleaved-1f1b" else cfg.schedule
    return cfg.replace(tp=layout.tp, pp=layout.pp, dp=layout.dp, micro_batches=m, schedule=schedule,
                       sequence_parallel=layout.sequence_parallel, recompute=layout.recompute == "full")


def unsupported(layout) -> str | None:
    """Why ``tensorpar train`` cannot run ``layout`` (None when it can)."""
    if layout.distributed_optimizer:
        return "distributed_optimizer=true (the trainer keeps the whole optimizer state on every dp replica)"
    if layout.recompute == "selective":
        return "recompute=selective (the trainer recomputes whole blocks: use recompute=full or none)"
    if layout.ep > 1:
        return f"ep={layout.ep} (expert parallelism is not trained)"
    if layout.virtual_stages > 2:
        return f"virtual_stages={layout.virtual_stages} (the interleaved schedule uses 2 chunks per stage)"
    if layout.cp > 1:
        return (f"cp={layout.cp} (--plan does not set context parallelism yet: give --tp {layout.tp} --pp {layout.pp} "
                f"--dp {layout.dp} --cp {layout.cp} --cp-mode {layout.cp_mode} instead)")
    return None


def runtime_problem(cfg, model_config) -> str | None:
    """The trainer's own checks of a layout (its config, the sharding plan, the pipeline cut), as one line."""
    from tensorpar.hf.plan import make_plan
    from tensorpar.pipeline.stages import check_pipeline

    try:
        cfg = cfg.replace()  # __post_init__: micro-batches, schedule, sequence parallelism
        make_plan(model_config, cfg.tp, sequence_parallel=cfg.sequence_parallel)
        if cfg.pp > 1:
            check_pipeline(model_config, cfg.pp, 2 if cfg.schedule == "interleaved-1f1b" else 1,
                           cfg.micro_batches, cfg.schedule)
    except ValueError as e:
        return " ".join(str(e).split())
    return None


@dataclass(frozen=True)
class Choice:
    """The layout to run: the planner's scored ``plan``, the ``cfg`` that runs it, and where it came from."""

    plan: object  # tensorpar.planner.enumerate.Plan
    cfg: object  # TrainConfig
    device: object  # DeviceSpec
    source: str  # "auto" or the plan file
    note: str = ""

    def summary(self) -> str:
        """One line: the layout and its predicted step time and memory per rank."""
        c, p = self.cfg, self.plan
        sched = f" schedule={c.schedule}" if c.pp > 1 else ""
        return (f"plan ({self.source}): tp={c.tp} pp={c.pp} dp={c.dp} micro-batches={c.micro_batches}{sched} "
                f"sp={'on' if c.sequence_parallel else 'off'} recompute={'on' if c.recompute else 'off'}: "
                f"predicted step {p.cost.step.total * 1e3:.1f} ms, {_mib(p.memory.total)} per rank "
                f"(device: {self.device.name}{'; ' + self.note if self.note else ''})")

    def prediction(self) -> dict:
        return {"step_time_s": self.plan.cost.step.total, "memory_bytes": self.plan.memory.total,
                "layout": self.plan.layout.to_dict()}


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2 ** 20:.1f} MiB"


def choose_auto(cfg, model_config, device, nproc: int, local_nproc: int | None = None, *, note: str = "") -> Choice:
    """The fastest layout of ``nproc`` ranks that fits and that the trainer runs.

    Raises ValueError (naming ``--plan auto`` and the ranks) when none does, with the first reason.
    """
    from tensorpar.planner.enumerate import search

    model, cluster, work, assume = planner_inputs(cfg, model_config, device, nproc, local_nproc)
    found = search(model, cluster, work, assume)
    reasons = []
    for plan in found.ranked:
        why = unsupported(plan.layout)
        if why is None:
            try:  # the trainer's config checks (e.g. 1F1B needs micro-batches >= pp)
                run_cfg = layout_config(cfg, plan.layout, work.global_batch)
            except ValueError as e:
                why, run_cfg = " ".join(str(e).split()), None
            if why is None:
                why = runtime_problem(run_cfg, model_config)
            if why is None:
                return Choice(plan, run_cfg, device, "auto", note)
        reasons.append(f"{plan.layout.short()}: {why}")
    if found.too_big and not found.ranked:
        best = found.too_big[0]
        raise ValueError(f"--plan auto: no layout of {nproc} ranks fits in {device.memory_gib:.2f} GiB per rank; "
                         f"the smallest ({best.layout.short()}) needs {best.memory.total / 2 ** 30:.2f} GiB; use "
                         f"more ranks, a smaller --batch-size or --seq-len")
    first = reasons[0] if reasons else "; ".join(p.message for r in found.rejected[:1] for p in r.problems)
    raise ValueError(f"--plan auto: no layout of {nproc} ranks is runnable for --model {cfg.model} (first: {first}); "
                     f"try another rank count (--nproc)")


PLAN_KEYS = ("tp", "pp", "dp", "micro_batch", "sequence_parallel", "recompute", "distributed_optimizer",
             "virtual_stages", "ep", "cp", "cp_mode")


def read_plan_file(path: str) -> list:
    """``[(position, Layout)]`` of every plan of a ``tensorpar plan --json`` file, in its order (best ranked first,
    positions from 1), or ``[(0, Layout)]`` for a file holding one plan object. Raises ValueError naming the file
    and the field."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"--plan {path}: cannot read it ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--plan {path}: not JSON ({e}); save one with tensorpar plan ... --json > {path}") from None
    if isinstance(data, list):
        if not data:
            raise ValueError(f"--plan {path}: the list of plans is empty (no layout fitted when it was made)")
        return [(i + 1, _plan_layout(path, d, i + 1)) for i, d in enumerate(data)]
    return [(0, _plan_layout(path, data, 0))]


def _plan_layout(path: str, data, position: int):
    from tensorpar.planner.layout import Layout

    where = f"plan #{position}" if position else "the plan"
    if not isinstance(data, dict):
        raise ValueError(f"--plan {path}: expected a plan object or the list that tensorpar plan --json prints")
    missing = [k for k in ("tp", "pp", "dp", "micro_batch") if k not in data]
    if missing:
        raise ValueError(f"--plan {path}: {where} lacks {', '.join(missing)}; save one with tensorpar plan --json")
    values = {k: data[k] for k in PLAN_KEYS if k in data}
    for k in ("tp", "pp", "dp", "micro_batch", "virtual_stages", "ep", "cp"):
        if k in values and (not isinstance(values[k], int) or isinstance(values[k], bool) or values[k] < 1):
            raise ValueError(f"--plan {path}: {where}: {k}={values[k]!r} must be a positive integer")
    for k in ("sequence_parallel", "distributed_optimizer"):
        if k in values and not isinstance(values[k], bool):
            raise ValueError(f"--plan {path}: {where}: {k}={values[k]!r} must be true or false")
    return Layout(**values)


def check_plan_file(path: str, nproc: int | None, nproc_source: str = "--nproc"):
    """``(layout, position)``: the first plan of ``path`` (:func:`read_plan_file`; position 1-based, 0 for a lone
    object) that the trainer runs (no distributed optimizer, selective recomputation, expert or context parallelism), if
    its degrees multiply to ``nproc`` (when given); else ValueError naming ``--plan``, the setting and the ranks."""
    plans = read_plan_file(path)
    skipped = []
    for position, lay in plans:
        why = unsupported(lay)
        if why is None:
            break
        skipped.append(why)
    else:
        more = f" (nor can it the other {len(plans) - 1} plans of the file)" if len(plans) > 1 else ""
        raise ValueError(f"--plan {path}: tensorpar train cannot run {skipped[0]}{more}")
    if nproc is not None and lay.num_devices != nproc:
        raise ValueError(f"--plan {path}: tp x pp x dp = {lay.tp} x {lay.pp} x {lay.dp} = {lay.num_devices}, but "
                         f"{nproc} ranks were given ({nproc_source}); make a plan for --gpus {nproc}")
    return lay, position


def choose_from_file(path: str, cfg, model_config, device, nproc: int | None, local_nproc: int | None = None,
                     *, nproc_source: str = "--nproc", note: str = "") -> Choice:
    """The layout saved in ``path``, checked against the ranks given (``nproc``; None: the plan's own count),
    the model and this machine's memory. Raises ValueError naming ``--plan`` and the setting."""
    from tensorpar.planner.enumerate import score
    from tensorpar.planner.layout import problems

    lay, position = check_plan_file(path, nproc, nproc_source)
    if position > 1:
        note = (f"plan #{position} of the file: the ones before it need what tensorpar train does not run"
                + (f"; {note}" if note else ""))
    nproc = lay.num_devices
    model, cluster, work, assume = planner_inputs(cfg, model_config, device, nproc,
                                                  local_nproc if local_nproc and nproc % local_nproc == 0 else None)
    broken = [p for p in problems(lay, model, cluster, work, assume) if p.rule != "tp-node"]
    if broken:
        raise ValueError(f"--plan {path}: the layout does not fit --model {cfg.model} with --batch-size "
                         f"{cfg.batch_size} --seq-len {cfg.seq_len}: " + "; ".join(p.message for p in broken))
    plan = score(lay, model, cluster, work, assume)
    if not plan.fits:
        raise ValueError(f"--plan {path}: {lay.short()} needs {plan.memory.total / 2 ** 30:.2f} GiB per rank, more "
                         f"than the {plan.usable_bytes / 2 ** 30:.2f} GiB usable here; use more ranks or a smaller "
                         f"batch")
    run_cfg = layout_config(cfg, lay, work.global_batch)
    why = runtime_problem(run_cfg, model_config)
    if why:
        raise ValueError(f"--plan {path}: {why}")
    return Choice(plan, run_cfg, device, str(path), note)


def env_nproc() -> tuple[int | None, int | None]:
    """(WORLD_SIZE, LOCAL_WORLD_SIZE) under torchrun, else (None, None)."""
    from tensorpar.launch import under_torchrun

    if not under_torchrun():
        return None, None
    world = int(os.environ["WORLD_SIZE"])
    return world, int(os.environ.get("LOCAL_WORLD_SIZE", world))
