"""``--plot FILE.png``: per-device memory breakdown of plans as stacked horizontal bars, with the usable
and total device memory marked."""
from __future__ import annotations

from tensorpar.planner.enumerate import Plan
from tensorpar.planner.memory import GIB

PARTS = (("weights", "#4c72b0"), ("gradients", "#55a868"), ("optimizer", "#c44e52"), ("activations", "#8172b2"))


def plot_memory(plans: list[Plan], path: str, *, capacity_gib: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; never opens a window
    import matplotlib.pyplot as plt

    labels = [p.layout.short().replace(" recompute=", "\nrecompute=") for p in plans]
    fig, ax = plt.subplots(figsize=(10, 0.9 * len(plans) + 1.6))
    left = [0.0] * len(plans)
    for part, color in PARTS:
        sizes = [getattr(p.memory, part) / GIB for p in plans]
        ax.barh(range(len(plans)), sizes, left=left, color=color, label=part)
        left = [a + b for a, b in zip(left, sizes)]
    if plans:
        ax.axvline(plans[0].usable_bytes / GIB, color="black", linestyle="--", label="usable")
    ax.axvline(capacity_gib, color="black", label="device memory")
    ax.set_yticks(range(len(plans)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("GiB per device (busiest pipeline stage)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
