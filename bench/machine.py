"""What every results file under bench/results/ records about the machine it ran on: the CPU model (numbers from
two CPU models are never compared) and the load. Shared by the bench scripts (``sys.path`` holds bench/)."""
from __future__ import annotations

import os
import platform
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
