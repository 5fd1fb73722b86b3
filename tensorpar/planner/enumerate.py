"""Every valid layout for a model on a cluster, scored and ranked.

For each tp dividing the device count and pp dividing the rest (dp = devices / (tp pp)), each micro-batch
size dividing the per-replica batch (up to ``max_micro_batch``), sequence parallelism on/off (only at
tp > 1), recomputation none/selective/full, distributed optimizer on/off (only at dp > 1), and each
interleaving degree in ``Assumptions.virtual_stages``, and for a mixture of experts each expert-parallel
degree ep dividing both dp and the expert count. Each context-parallel degree cp of ``Assumptions.context_parallel``
that divides the device count is tried too (dp = devices / (tp pp cp)), with the ring and, where the heads of a
tp rank divide by cp, all2all. A combination that breaks a rule of
:func:`tensorpar.planner.layout.problems` is kept as a rejection (with its reasons) for the explanation;
one that is valid is scored, and it fits when its busiest device needs no more than the usable memory.

Ranking: fitting plans by step time, then by memory, then by the layout's fields, so that the order is
the same on every run and machine.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator

from tensorpar.planner.cluster import ClusterSpec
from tensorpar.planner.cost import Cost, step_cost
from tensorpar.planner.layout import RECOMPUTE, Assumptions, Layout, Problem, Workload, cp_problems, problems
from tensorpar.planner.memory import MemoryBreakdown, memory_per_device, usable_bytes
from tensorpar.planner.model_spec import ModelSpec


@dataclass(frozen=True)
class Plan:
    """A valid layout with its per-device memory and step cost."""

    layout: Layout
    memory: MemoryBreakdown
    cost: Cost
    usable_bytes: float
    num_micro_batches: int

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.usable_bytes

    def sort_key(self) -> tuple:
        return (self.cost.step.total, self.memory.total, self.layout)

    def to_json(self) -> dict:
        """The plan in the schema of ``tensorpar plan --json``."""
        lay = self.layout
        return {
            "tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "micro_batch": lay.micro_batch,
            "sequence_parallel": lay.sequence_parallel, "recompute": lay.recompute,
            "distributed_optimizer": lay.distributed_optimizer,
            "cp": lay.cp, "cp_mode": lay.cp_mode,
            "memory_gb": self.memory.gib(),
            "step_time_s": round(self.cost.step.total, 6),
            "tflops_per_device": round(self.cost.tflops_per_device, 3),
            "mfu": round(self.cost.mfu, 5),
            "virtual_stages": lay.virtual_stages,
            "ep": lay.ep,
            "num_micro_batches": self.num_micro_batches,
            "fits": self.fits,
            "memory_stage": self.memory.stage,
            "step_time_breakdown_s": {k: round(v, 6) for k, v in self.cost.step.as_dict().items()},
        }


@dataclass(frozen=True)
class Rejection:
    layout: Layout
    problems: tuple[Problem, ...]


@dataclass(frozen=True)
class PlanSearch:
    """Everything the planner looked at: ``ranked`` fitting plans (best first), valid plans that need
    too much memory (``too_big``, smallest first) and rule-breaking ``rejected`` layouts."""

    ranked: list[Plan]
    too_big: list[Plan]
    rejected: list[Rejection]
    usable_bytes: float


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidate_layouts(model: ModelSpec, cluster: ClusterSpec, work: Workload,
                      assume: Assumptions) -> Iterator[tuple[Layout, list[Problem]]]:
    """Every combination, each with the rules it breaks. A (tp, pp) pair that is invalid on its own
    (too many heads, crossing a node, more stages than layers) yields one representative rejection
    instead of one per micro-batch and switch."""
    n = cluster.num_devices
    for cp in sorted({c for c in assume.context_parallel if n % c == 0}):
        for tp in divisors(n // cp):
            for pp in divisors(n // (cp * tp)):
                yield from _with_degrees(tp, pp, cp, model, cluster, work, assume)


def _with_degrees(tp: int, pp: int, cp: int, model: ModelSpec, cluster: ClusterSpec, work: Workload,
                  assume: Assumptions) -> Iterator[tuple[Layout, list[Problem]]]:
    dp = cluster.num_devices // (tp * pp * cp)
    base = Layout(tp=tp, pp=pp, dp=dp, micro_batch=1, cp=cp)
    shape_problems = [pr for pr in problems(base, model, cluster, work, assume)
                      if pr.rule in ("tp>heads", "split", "tp-node", "pp>layers", "batch", "seq%cp")]
    if shape_problems:
        yield base, shape_problems
        return
    modes = ("ring",) if cp == 1 else ("ring",) + (() if cp_problems(replace(base, cp_mode="all2all"), model, work,
                                                                       assume) else ("all2all",))
    per_replica = work.global_batch // dp
    expert_parallel = [e for e in divisors(dp) if model.num_experts % e == 0] if model.is_moe and cp == 1 else [1]
    for mb in (k for k in divisors(per_replica) if k <= assume.max_micro_batch):
        for sp in ((False, True) if tp > 1 else (False,)):
            for rc in RECOMPUTE:
                if rc == "selective" and (assume.attention == "sdpa" or cp > 1):
                    continue  # identical to "none" with a fused attention kernel (ring and all2all are)
                for do in ((False, True) if dp > 1 else (False,)):
                    for v in (assume.virtual_stages if pp > 1 else (1,)):
                        for ep in expert_parallel:
                            for mode in modes:
                                lay = Layout(tp, pp, dp, mb, sp, rc, do, v, ep, cp, mode)
                                yield lay, problems(lay, model, cluster, work, assume)


def score(layout: Layout, model: ModelSpec, cluster: ClusterSpec, work: Workload, assume: Assumptions) -> Plan:
    """Memory and cost of one valid layout (call :func:`problems` first)."""
    return Plan(layout=layout, memory=memory_per_device(model, layout, work, assume),
                cost=step_cost(model, layout, cluster, work, assume),
                usable_bytes=usable_bytes(cluster.device.memory_gib, assume),
                num_micro_batches=layout.num_micro_batches(work.global_batch))


def search(model: ModelSpec, cluster: ClusterSpec, work: Workload, assume: Assumptions) -> PlanSearch:
    """Score every candidate layout. Raises ValueError when ``work.seq_len`` exceeds the model's positions."""
    model.check_seq_len(work.seq_len)
    ranked, too_big, rejected = [], [], []
    for layout, found in candidate_layouts(model, cluster, work, assume):
        if found:
            rejected.append(Rejection(layout, tuple(found)))
            continue
        plan = score(layout, model, cluster, work, assume)
        (ranked if plan.fits else too_big).append(plan)
    ranked.sort(key=Plan.sort_key)
    too_big.sort(key=lambda p: (p.memory.total, p.layout))
    return PlanSearch(ranked=ranked, too_big=too_big, rejected=rejected,
                      usable_bytes=usable_bytes(cluster.device.memory_gib, assume))
