"""The machine's side of namespace hosts (:mod:`tensorpar.nshosts`): whether they can be made here, the rates tc
can cap a link at, the namespaces and addresses already in use, and the sweep of what a killed run left."""
from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

PREFIX = "tph"
_RATE = re.compile(r"^(\d+(?:\.\d+)?)([kmg]?)bit$", re.IGNORECASE)
#: the link rates a host's link may be capped at, bits/s: below 1 Mbit/s the token bucket's smallest burst (64 KiB)
#: lets a small job's traffic through uncapped; above 1000 Gbit/s tc's burst (1 ms of traffic) overflows
RATE_RANGE = (1e6, 1e12)
_UNIT = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}


def rate_bits(rate: str) -> float:
    """Bits per second of a tc rate such as ``"1gbit"``, ``"500mbit"`` (units in any case, as tc reads them).

    Raises:
        ValueError: not ``<number>[k|m|g]bit``, or outside :data:`RATE_RANGE` (1mbit-1000gbit).
    """
    m = _RATE.match(rate) if isinstance(rate, str) else None
    if not m:
        raise ValueError(f"link rate must look like '1gbit', '10gbit' or '500mbit', got {rate!r}")
    bits = float(m.group(1)) * _UNIT[m.group(2).lower()]
    if not RATE_RANGE[0] <= bits <= RATE_RANGE[1]:
        raise ValueError(f"link rate {rate!r} is outside 1mbit-1000gbit (below, tc's smallest burst lets a small "
                         f"job's traffic through uncapped; above, its burst overflows); or give none for no cap")
    return bits


def unavailable() -> str | None:
    """Why namespace hosts cannot be made here (one line), or None if they can."""
    if sys.platform != "linux":
        return f"namespace hosts need Linux network namespaces; this is {sys.platform}"
    if os.geteuid() != 0:
        return "namespace hosts need root (creating network, UTS and mount namespaces); this runs as uid " \
               f"{os.geteuid()}"
    missing = [c for c in ("ip", "tc", "unshare", "mount", "hostname") if shutil.which(c) is None]
    if missing:
        return f"namespace hosts need the commands {', '.join(missing)} (iproute2, util-linux)"
    probe = subprocess.run(["unshare", "--net", "--uts", "--mount", "true"], capture_output=True, text=True)
    if probe.returncode:   # root without CAP_SYS_ADMIN, e.g. an unprivileged container
        return f"namespace hosts: this process cannot create namespaces ({probe.stderr.strip()[:200]})"
    return None


def _sh(*argv: str, check: bool = True) -> str:
    r = subprocess.run(argv, capture_output=True, text=True)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed (exit {r.returncode}): {r.stderr.strip()}")
    return r.stdout


def netns_names() -> list[str]:
    """Names of the machine's named network namespaces (``ip netns list``)."""
    return [line.split()[0] for line in _sh("ip", "netns", "list").splitlines() if line.strip()]


def addresses_in_use() -> dict[str, str]:
    """IPv4 addresses on the machine's interfaces and on those of every named namespace: address -> where (this
    machine first: every namespace's loopback also holds 127.0.0.1)."""
    used = {}
    for ns in [None] + netns_names():
        out = _sh("ip", *(["-n", ns] if ns else []), "-o", "-4", "addr", "show", check=False)
        for line in out.splitlines():
            f = line.split()
            if "inet" in f:
                used.setdefault(f[f.index("inet") + 1].split("/")[0], f"namespace {ns}" if ns else "this machine")
    return used


#: where a run records the pid that made each namespace it made (names with a ``--prefix`` carry no pid)
OWNERS = "/run/tensorpar-nshosts"


def _owner(ns: str) -> int | None:
    """The pid of the process that made namespace ``ns``: from its ``tph<pid>-`` name or its owner file; None
    for a namespace this module did not make."""
    m = re.match(rf"^{PREFIX}(\d+)-", ns)
    if m:
        return int(m.group(1))
    try:
        with open(os.path.join(OWNERS, ns)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs: it exists and is no zombie (a killed run's script, orphaned, stays one until
    init reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _kill_inside(ns: str) -> None:
    """SIGKILL every process in namespace ``ns`` (only ours live in the namespaces this module makes)."""
    for pid in _sh("ip", "netns", "pids", ns, check=False).split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def delete_ns(ns: str) -> None:
    """Kill what runs in namespace ``ns`` (:func:`_kill_inside`), delete it and its owner file."""
    _kill_inside(ns)
    _sh("ip", "netns", "del", ns, check=False)
    try:
        os.unlink(os.path.join(OWNERS, ns))
    except OSError:
        pass


def sweep_stale() -> list[str]:
    """Delete the namespaces this module made whose creating process is gone (``tph<pid>-*``, and those of a
    ``prefix`` by their owner file), after killing what still runs in them; return their names."""
    removed = []
    for ns in netns_names():
        pid = _owner(ns)
        if pid is not None and not _alive(pid):
            delete_ns(ns)
            removed.append(ns)
    for prefix in {ns.rsplit("-", 1)[0] for ns in removed}:      # their hosts files (nothing else in the folder)
        for d in glob.glob(os.path.join(tempfile.gettempdir(), glob.escape(prefix) + "-*")):
            if os.path.isdir(d) and all(re.fullmatch(r"hosts\d+", f) for f in os.listdir(d)):
                shutil.rmtree(d, ignore_errors=True)
    return removed


