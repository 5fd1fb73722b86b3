"""Terminal table (rich) and JSON for ranked plans."""
from __future__ import annotations

import json

from tensorpar.planner.enumerate import Plan


def console():
    """A rich Console; when output is not a terminal (a pipe, a CI log) it is 150 columns wide rather
    than rich's default of 80, so that the table is not squeezed."""
    from rich.console import Console

    con = Console()
    return con if con.is_terminal else Console(width=150)


def plan_table(plans: list[Plan], title: str, first_rank: int = 1):
    """A rich Table of plans, one row each, ranked from ``first_rank`` (0: no rank column values)."""
    from rich import box
    from rich.table import Table

    table = Table(title=title, title_justify="left", header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False)
    show_ep = any(p.layout.ep > 1 for p in plans)
    show_cp = any(p.layout.cp > 1 for p in plans)
    for name in ("#", "tp", "pp", "dp", *(("ep",) if show_ep else ()), *(("cp",) if show_cp else ()), "mb", "m", "SP",
                 "recompute", "dist-opt"):
        table.add_column(name, justify="right" if name in ("#", "tp", "pp", "dp", "ep", "mb", "m") else "left")
    for name in ("mem GiB", "w+g", "optim", "activ", "step s", "bubble", "TFLOP/s", "MFU"):
        table.add_column(name, justify="right")
    for i, plan in enumerate(plans):
        lay, mem, step = plan.layout, plan.memory.gib(), plan.cost.step
        mem_cell = f"{mem['total']:.1f}" if plan.fits else f"[red]{mem['total']:.1f}[/red]"
        table.add_row(
            str(first_rank + i) if first_rank else "-", str(lay.tp), str(lay.pp), str(lay.dp),
            *((str(lay.ep),) if show_ep else ()),
            *((f"{lay.cp} {lay.cp_mode}" if lay.cp > 1 else "1",) if show_cp else ()), str(lay.micro_batch), str(plan.num_micro_batches), "on" if lay.sequence_parallel else "off",
            lay.recompute + (f" v={lay.virtual_stages}" if lay.virtual_stages > 1 else ""),
            "on" if lay.distributed_optimizer else "off",
            mem_cell, f"{mem['weights'] + mem['gradients']:.1f}", f"{mem['optimizer']:.1f}",
            f"{mem['activations']:.1f}", f"{step.total:.3f}", f"{100 * step.bubble / step.total:.1f}%",
            _tflops(plan.cost.tflops_per_device), f"{100 * plan.cost.mfu:.1f}%",
        )
    return table


def _tflops(value: float) -> str:
    """One decimal for cluster-scale rates, three significant digits for small (calibrated CPU) ones."""
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def plans_json(plans: list[Plan], first_rank: int | None = 1) -> str:
    """The ``--json`` output: a list of plans in the documented schema, with their rank."""
    out = []
    for i, plan in enumerate(plans):
        entry = plan.to_json()
        entry["rank"] = None if first_rank is None else first_rank + i
        out.append(entry)
    return json.dumps(out, indent=2)
