"""Training metrics as JSON lines, and the loss-curve plot made from them.

One JSON object per line: ``{"kind": "train", "step", "loss", "grad_norm", "lr", "tokens", "tokens_per_s",
"step_time_s"}`` after each logged step and ``{"kind": "val", "step", "val_loss"}`` after each evaluation.
Lines are appended and flushed as they come, so a killed run keeps what it logged; a resumed run first
drops the lines past the step it resumes from (rewriting the file atomically).
"""
from __future__ import annotations

import json
import os
from pathlib import Path


class MetricsLog:
    """Appends records to ``path`` (only where ``active``: rank 0)."""

    def __init__(self, path: str | os.PathLike, *, active: bool = True):
        self.path, self.active = Path(path), active

    def start(self, resume_step: int | None) -> None:
        """A fresh file (``resume_step is None``), or keep only the records up to ``resume_step``."""
        if not self.active:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step] if resume_step else []
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        with open(tmp, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        os.replace(tmp, self.path)

    def write(self, record: dict) -> None:
        if not self.active:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """All records of a metrics file (``[]`` if it does not exist); a torn last line is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def plot_losses(metrics_path: str | os.PathLike, png_path: str | os.PathLike, *, title: str = "") -> Path:
    """Train and validation loss against step, written atomically to ``png_path`` (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    recs = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in recs if r.get("kind") == "train"]
    val = [(r["step"], r["val_loss"]) for r in recs if r.get("kind") == "val"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title or "tensorpar train")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png_path = Path(png_path)
    tmp = png_path.with_name(f".{png_path.stem}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, png_path)
    return png_path
