"""What every results file under bench/results/ records about the machine it ran on: the CPU model (numbers from
two CPU models are never compared) and the load; and how a results file is written (atomically, so a reader never
sees half of one). Shared by the bench scripts (``sys.path`` holds bench/)."""
from __future__ import annotations

import json
import os
import platform
import tempfile
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (``lscpu``'s "Model name"), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine() -> dict:
    """CPU model, core count and the 1/5/15-minute load averages now: the header fields of a results file."""
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "loadavg": list(os.getloadavg())}


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` (its folder made) through a temporary file beside it, then rename: a reader sees
    the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def write_results(out: Path, meta: dict, rows: list, lines: list[str]) -> None:
    """A run's results: ``out``.json (``{"meta": meta, "rows": rows}``, indented) and ``out``.md (``lines``, the
    header naming the machine and the table), both written atomically; the markdown printed too."""
    atomic_write(out.with_suffix(".json"), json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    atomic_write(out.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))
