"""Sentences that say why the top plan wins and what ruled the others out.

For each knob (tp, pp, micro-batch, sequence parallelism, recomputation, distributed optimizer) and each
value the winner does not use, the best fitting plan with that value is compared with the winner and the
step-time component that grew most is named; a value with no fitting plan is explained by its smallest
memory need, or by the rule that every layout with it breaks.
"""
from __future__ import annotations

from collections import Counter

from tensorpar.planner.enumerate import Plan, PlanSearch
from tensorpar.planner.memory import GIB

COMPONENTS = {"compute": "compute", "tp_comm": "TP communication", "ep_comm": "expert all-to-all",
              "cp_comm": "context-parallel attention traffic",
              "pp_comm": "pipeline sends",
              "bubble": "pipeline bubble", "dp_comm": "DP communication", "optimizer": "optimizer step"}
KNOBS = ("tp", "pp", "ep", "cp", "micro_batch", "sequence_parallel", "recompute", "distributed_optimizer")


def _value(knob: str, value) -> str:
    if isinstance(value, bool):
        return f"{knob}={'on' if value else 'off'}"
    return f"{knob}={value}"


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB"


def breakdown(plan: Plan) -> str:
    parts = ", ".join(f"{COMPONENTS[k]} {v:.2f}" for k, v in plan.cost.step.as_dict().items() if v > 0)
    return f"{plan.cost.step.total:.2f} s ({parts})"


def versus(plan: Plan, best: Plan) -> str:
    """How much slower ``plan`` is than ``best``, and the component that grew most."""
    slower = plan.cost.step.total - best.cost.step.total
    pct = 100 * slower / best.cost.step.total
    mine, theirs = plan.cost.step.as_dict(), best.cost.step.as_dict()
    grew = max(COMPONENTS, key=lambda k: (mine.get(k, 0.0) - theirs.get(k, 0.0), k))
    if slower <= 0:
        return "as fast; ranked lower on memory or layout order"
    return f"{pct:.1f}% slower, mostly {COMPONENTS[grew]} (+{mine.get(grew, 0.0) - theirs.get(grew, 0.0):.2f} s)"


def memory_verdict(plan: Plan) -> str:
    return f"needs {_gib(plan.memory.total)} > {_gib(plan.usable_bytes)} usable"


def explain(found: PlanSearch, top: int = 1) -> list[str]:
    lines = []
    if not found.ranked:
        if found.too_big:
            small = found.too_big[0]
            lines.append(f"No layout fits: the smallest, {small.layout.short()}, {memory_verdict(small)} "
                         f"({_memory_parts(small)}). Use more devices, devices with more memory, or a shorter "
                         "sequence or smaller global batch.")
        else:
            lines.append("No valid layout: " + _rule_summary(found))
        return lines
    best = found.ranked[0]
    lines.append(f"#1 {best.layout.short()}: step {breakdown(best)}; {_gib(best.memory.total)} of "
                 f"{_gib(found.usable_bytes)} usable on pipeline stage {best.memory.stage} "
                 f"({_memory_parts(best)}); MFU {100 * best.cost.mfu:.1f}%.")
    if len(found.ranked) > 1:
        lines.append(f"#2 {found.ranked[1].layout.short()}: {versus(found.ranked[1], best)}.")
    for knob in KNOBS:
        lines.extend(_knob_lines(found, best, knob))
    lines.append("Ruled out: " + _rule_summary(found))
    return lines


def _memory_parts(plan: Plan) -> str:
    parts = plan.memory.gib()
    return ", ".join(f"{k} {parts[k]:.1f}" for k in ("weights", "gradients", "optimizer", "activations"))


def _knob_lines(found: PlanSearch, best: Plan, knob: str) -> list[str]:
    """One line per value of ``knob`` that the winner does not use. First the winner's own layout with
    just that value changed (the direct comparison), then the best fitting layout with the value."""
    from dataclasses import replace

    mine = getattr(best.layout, knob)
    by_layout = {p.layout: p for p in (*found.ranked, *found.too_big)}
    values = {getattr(p.layout, knob) for p in by_layout.values()}
    values |= {getattr(r.layout, knob) for r in found.rejected}
    out, invalid = [], {}
    for value in sorted(values - {mine}, key=lambda v: (str(type(v)), v)):
        fitting = next((p for p in found.ranked if getattr(p.layout, knob) == value), None)
        big = next((p for p in found.too_big if getattr(p.layout, knob) == value), None)
        if fitting is None and big is None:
            broken = next(r for r in found.rejected if getattr(r.layout, knob) == value)
            invalid.setdefault(broken.problems[0].rule, []).append((value, broken.problems[0].message))
            continue
        neighbour = by_layout.get(replace(best.layout, **{knob: value}))
        head = f"{_value(knob, value)}: "
        if neighbour is not None and not neighbour.fits:
            head += f"{neighbour.layout.short()} {memory_verdict(neighbour)}; "
        if fitting is not None:
            if fitting is neighbour:
                out.append(f"{head}{fitting.layout.short()} is {versus(fitting, best)}.")
            else:
                out.append(f"{head}best fitting is {fitting.layout.short()}, {versus(fitting, best)}.")
        else:
            out.append(f"{head}no layout fits; the smallest, {big.layout.short()}, {memory_verdict(big)}.")
    for cases in invalid.values():
        listed = ", ".join(str(v) for v, _ in cases)
        out.append(f"{knob}={listed}: invalid (e.g. {cases[0][1]}).")
    return out


def _rule_summary(found: PlanSearch) -> str:
    counts = Counter(pr.rule for r in found.rejected for pr in r.problems[:1])
    example = {}
    for r in found.rejected:
        example.setdefault(r.problems[0].rule, r.problems[0].message)
    parts = [f"{n} x {example[rule]}" for rule, n in counts.most_common()]
    if found.too_big:
        small = found.too_big[0]
        parts.append(f"{len(found.too_big)} valid layouts need more than {_gib(found.usable_bytes)} "
                     f"(the smallest, {small.layout.short()}, needs {_gib(small.memory.total)})")
    return "; ".join(parts) if parts else "nothing."
