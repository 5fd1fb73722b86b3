"""Other users' competition for this machine's cores, as the planner's calibration and device see it.

:class:`CompetitionSampler` samples, in a background thread, the runnable threads of the other processes (and,
under the kernel's autogroup scheduling, :func:`autogroup_enabled`, their scheduling groups) and the busy
core-seconds of the host from Linux ``/proc``; :func:`_loadavg` reads the 1-minute load average.
"""
from __future__ import annotations

import os
import statistics
import time


def autogroup_enabled() -> bool:
    """Whether this Linux kernel shares the CPU among sessions first (``/proc/sys/kernel/sched_autogroup_enabled``)."""
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            return f.read().strip() == "1"
    except OSError:
        return False


class CompetitionSampler:
    """Other users' competition for the cores, sampled every ``interval`` s in a background thread (Linux ``/proc``):
    the runnable threads (state R in ``/proc/<pid>/task/<tid>/stat``) of every process but this one, ``pids()``
    (e.g. the ranks it started) and, under autogroup, the processes of our own scheduling group (session), and the
    distinct scheduling groups they are in (``/proc/<pid>/autogroup``).
    Unlike the 1-minute load average it is not smoothed over a minute, does not count our own threads, and sees
    the groups that the kernel shares the CPU among. A context manager; :meth:`mean_between` averages the samples
    of a time window (``time.time()``). Where ``/proc`` is missing, there are no samples."""

    def __init__(self, pids=lambda: [], interval: float = 0.1):
        import threading

        self.pids, self.interval = pids, interval
        self.samples: list[tuple[float, int, int]] = []  # (time, other runnable threads, their groups)
        self.cpu: list[tuple[float, float, float]] = []  # (time, busy core-seconds of the host, ours), cumulative
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @staticmethod
    def _read(path: str) -> str | None:
        try:
            with open(path) as f:
                return f.read()
        except OSError:
            return None

    def sample(self) -> tuple[int, int] | None:
        """(other runnable threads, distinct groups holding them) now; None without ``/proc``."""
        try:
            procs = [d for d in os.listdir("/proc") if d.isdigit()]
        except OSError:
            return None
        ours = {str(os.getpid()), *(str(p) for p in self.pids())}
        group = self._group("self") if autogroup_enabled() else None
        threads, groups = 0, set()
        for pid in procs:
            if pid in ours:
                continue
            theirs = self._group(pid)
            if group is not None and theirs == group:
                continue  # in our scheduling group (our session: e.g. the ranks we started)
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            running = 0
            for tid in tids:
                stat = self._read(f"/proc/{pid}/task/{tid}/stat")
                if stat and stat.rsplit(")", 1)[-1].split()[:1] == ["R"]:
                    running += 1
            if running:
                threads += running
                groups.add(theirs or pid)
        return threads, len(groups)

    def _group(self, pid: str) -> str | None:
        text = self._read(f"/proc/{pid}/autogroup")
        return text.split(" ")[0] if text else None

    def cpu_seconds(self) -> tuple[float, float] | None:
        """(busy core-seconds of the whole host since boot, of this process and ``pids()``), from ``/proc/stat``
        (user + nice + system + irq + softirq + steal) and ``/proc/<pid>/stat`` (utime + stime); None without /proc."""
        hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        text = self._read("/proc/stat")
        if not text:
            return None
        f = [int(x) for x in text.splitlines()[0].split()[1:]]
        busy = sum(f[:3]) + sum(f[5:8])   # user nice system (idle iowait) irq softirq steal
        ours = 0
        for pid in [os.getpid(), *self.pids()]:
            stat = self._read(f"/proc/{pid}/stat")
            if stat:
                rest = stat.rsplit(")", 1)[-1].split()
                ours += int(rest[11]) + int(rest[12])   # utime, stime (fields 14 and 15)
        return busy / hz, ours / hz

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            now = time.time()
            cpu = self.cpu_seconds()
            if cpu is not None:
                self.cpu.append((now, *cpu))
            got = self.sample()
            if got is not None:
                self.samples.append((now, *got))

    def others_cores_between(self, start: float = 0.0, end: float = float("inf")) -> float | None:
        """Cores the other processes of the host kept busy on average in ``[start, end]`` (busy host time minus ours,
        over the wall time between the first and last sample inside); None with fewer than 2 samples."""
        inside = [c for c in self.cpu if start <= c[0] <= end]
        if len(inside) < 2:
            return None
        (t0, b0, o0), (t1, b1, o1) = inside[0], inside[-1]
        return max(0.0, ((b1 - b0) - (o1 - o0)) / (t1 - t0))

    def mean_between(self, start: float = 0.0, end: float = float("inf")) -> tuple[float, float] | None:
        """Mean (other runnable threads, their groups) of the samples in ``[start, end]``; None if there are none."""
        inside = [(n, g) for t, n, g in self.samples if start <= t <= end]
        if not inside:
            return None
        return statistics.mean(x[0] for x in inside), statistics.mean(x[1] for x in inside)


def _loadavg() -> float:
    """The 1-minute load average (runnable processes), 0 where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return 0.0
