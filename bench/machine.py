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


def cpu_times() -> tuple[int, int] | None:
    """``(steal, total)`` jiffies of all CPUs from /proc/stat's ``cpu`` line (None where it cannot be read): the
    time a hypervisor gave this VM's CPUs to other guests, and all time. :func:`steal_fraction` of two readings
    says how much of a run other tenants took: the load average cannot (it counts the run's own processes, and a
    VM's steal not at all)."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    return (f[7] if len(f) > 7 else 0), sum(f[:8])


def steal_fraction(start: tuple[int, int] | None, end: tuple[int, int] | None) -> float | None:
    """The fraction of CPU time stolen by the hypervisor between two :func:`cpu_times` readings (None if either
    is missing or no time passed)."""
    if start is None or end is None or end[1] <= start[1]:
        return None
    return (end[0] - start[0]) / (end[1] - start[1])


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
