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


def cpu_account() -> dict | None:
    """A reading of who used the CPUs: /proc/stat's busy and stolen jiffies of all CPUs and this process's and its
    waited-for children's CPU time (``os.times``); :func:`other_work` of two readings. None where /proc/stat is
    missing."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    t = os.times()
    tick = os.sysconf("SC_CLK_TCK")
    busy = f[0] + f[1] + f[2] + f[5] + f[6]               # user, nice, system, irq, softirq
    return {"busy_s": busy / tick, "steal_s": (f[7] if len(f) > 7 else 0) / tick, "all_s": sum(f[:8]) / tick,
            "own_s": t.user + t.system + t.children_user + t.children_system}


def other_work(start: dict | None, end: dict | None) -> dict | None:
    """Between two :func:`cpu_account` readings, the fractions of all CPU time that went to other work:
    ``steal`` (the hypervisor ran other guests on this VM's CPUs) and ``others`` (this machine's processes other
    than the run and its waited-for children: busy time minus the run's own, at least 0). Unlike the load average
    these leave out the run's own processes, whose 1-minute average stays high for a minute after each 2-thread
    row. None if a reading is missing."""
    if start is None or end is None or end["all_s"] <= start["all_s"]:
        return None
    total = end["all_s"] - start["all_s"]
    own = end["own_s"] - start["own_s"]
    return {"steal": (end["steal_s"] - start["steal_s"]) / total,
            "others": max(0.0, (end["busy_s"] - start["busy_s"]) - own) / total}


#: the share of all CPU time that other work (:func:`other_work`: stolen, or other processes) may take before a
#: run is marked loaded
OTHER_WORK_LOADED = 0.05


def loaded(work: dict | None) -> bool:
    """Whether a run's :func:`other_work` marks it loaded: stolen or other processes' time above
    :data:`OTHER_WORK_LOADED` of all CPU time (unknown: not marked)."""
    return work is not None and max(work["steal"], work["others"]) > OTHER_WORK_LOADED


def describe(work: dict | None) -> str:
    """One clause for a results file's header: the run's :func:`other_work`."""
    if work is None:
        return "other work during the run unknown (no /proc/stat)"
    return (f"other work during the run (/proc/stat against the run's own CPU time): {100 * work['steal']:.1f} % "
            f"of all CPU time stolen by the hypervisor, {100 * work['others']:.1f} % other processes")


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
