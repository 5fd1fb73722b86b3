"""Training metrics as JSON lines, and the loss-curve plot made from them.

One JSON object per line: ``{"kind": "train", "step", "loss", "grad_norm", "lr", "tokens", "tokens_per_s",
"step_time_s"}`` after each logged step and ``{"kind": "val", "step", "val_loss"}`` after each evaluation.
Lines are appended and flushed as they come, so a killed run keeps what it logged. A resumed run continues
the file; resuming from a checkpoint older than the file's last record keeps the old file under another
name first (:meth:`MetricsLog.start`), so no record is ever lost.
"""
from __future__ import annotations

import json
import os
from pathlib import Path


class MetricsLog:
    """Appends records to ``path`` (only where ``active``: rank 0)."""

    def __init__(self, path: str | os.PathLike, *, active: bool = True):
        self.path, self.active = Path(path), active

    def start(self, resume_step: int | None) -> Path | None:
        """Begin a fresh file (``resume_step is None``), or continue one after step ``resume_step``.

        A fresh start refuses an existing non-empty file (FileExistsError: the launcher checks ``--out``
        first, this is the last guard). A resume never rewrites history: when the file holds records past
        ``resume_step`` (resuming from an older checkpoint), the whole file is first kept as
        ``metrics.jsonl.until-step-<last>`` (a new name, never overwritten), then ``metrics.jsonl`` is
        rewritten atomically with the records up to ``resume_step``. Returns the kept copy, if one was made.
        """
        if not self.active:
            return None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            if self.path.is_file() and self.path.stat().st_size > 0:
                raise FileExistsError(f"{self.path} already holds metrics of an earlier run; resume it or choose "
                                      f"another output folder")
            self.path.touch()
            return None
        records = read_metrics(self.path)
        kept = [r for r in records if r.get("step", 0) <= resume_step]
        if len(kept) == len(records):
            return None  # nothing past the checkpoint: append to the file as it is
        last = max(r.get("step", 0) for r in records)
        archive = self.path.with_name(f"{self.path.name}.until-step-{last}")
        n = 1
        while archive.exists():
            n += 1
            archive = self.path.with_name(f"{self.path.name}.until-step-{last}-{n}")
        try:
            os.link(self.path, archive)  # the old file stays as it was, under a new name
        except OSError:  # a file system without hard links
            import shutil
            shutil.copy2(self.path, archive)
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        with open(tmp, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        return archive

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


def check_metrics(path: str | os.PathLike, resume_step: int, *, log_every: int = 1) -> None:
    """Before resuming at ``resume_step``: a metrics file that exists must reach that step.

    Raises ValueError when its last train record is more than ``log_every - 1`` steps before the
    checkpoint (records were lost, or the file belongs to another run): resuming would leave a gap.
    """
    recs = [r for r in read_metrics(path) if r.get("kind") == "train"]
    if not recs:
        return
    steps = [r.get("step") for r in recs]
    if any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in steps):
        raise ValueError(f"{path}: a record has a step that is not a positive integer; the file is damaged")
    if max(steps) < resume_step - (log_every - 1):
        raise ValueError(f"{path} ends at step {max(steps)} but the checkpoint is at step {resume_step}: the "
                         f"metrics do not match this checkpoint; resume into another --out folder")


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
