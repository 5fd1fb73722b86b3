"""A run on one host opens nothing reachable from outside it, and tensorpar's own exchanges never pickle
(issue 27, item 10).

The ranks go through the real launcher (tensorpar.launch.run_ranks) with the jobs of tests/_launch_jobs.py; rank 0
lists the listening TCP sockets (``/proc/net/tcp`` and ``tcp6``) of the launcher, which hosts the rendezvous
stores, and of every rank.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _job(*args, timeout=240):
    env = dict(os.environ, PYTHONPATH=str(REPO), TENSORPAR_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "tests._launch_jobs", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _listeners(p) -> list[str]:
    assert p.returncode == 0, p.stderr[-2000:]
    return next(x for x in p.stdout.splitlines() if x.startswith("listening")).split()[1:]


def test_two_rank_run_listens_on_loopback_only_and_never_pickles():
    """Rank 0 lists the sockets after the shared-memory start-up (host identities, segment names) and a fingerprint
    check through the store, both run with pickle's and torch's object-collective (un)picklers replaced by
    functions that raise."""
    p = _job("exchanges_without_pickle", "2")
    assert "no pickle" in p.stdout, p.stderr[-2000:]
    socks = _listeners(p)
    # before: torch's TCPStores (the rendezvous store and the one shared with the ranks) listened on the wildcard
    # address, e.g. ":::43135 :::60801"
    assert socks and all(s.startswith("127.0.0.1:") for s in socks), socks


@pytest.mark.slow
def test_one_rank_run_opens_no_wildcard_port():
    socks = _listeners(_job("report_listeners", "1"))   # before: the process group's TCPStore on "::"
    assert all(s.startswith("127.0.0.1:") for s in socks), socks
