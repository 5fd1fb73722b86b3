"""scripts/nshosts.py and the teardown of :mod:`tensorpar.nshosts` under what a user does to a run: SIGTERM
(``timeout``, ``kill``), a namespace name taken between the check and the make, a killed run's namespaces under a
``--prefix``, a failing rank (its own line shown, torchrun's report of it left out), rates and prefixes tc or the
hostnames cannot take (review of issue 23, each found on a clean clone)."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tensorpar import nshosts
from tensorpar.nshosts import NamespaceHosts, netns_names, rate_bits, sweep_stale, unavailable

WHY_NOT = unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))


def env():
    return dict(os.environ, PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1", TENSORPAR_THREADS="1")


def script(*argv, **kw):
    return subprocess.run([sys.executable, "scripts/nshosts.py", *argv], capture_output=True, text=True, env=env(),
                          **kw)


def test_rates_tc_can_cap_in_any_case_and_the_others_refused_in_one_line():
    assert rate_bits("1Gbit") == 1e9 and rate_bits("500MBIT") == 5e8 and rate_bits("1000gbit") == 1e12
    for bad in ("0.001kbit", "1kbit", "999kbit", "99999999gbit", "1001gbit"):
        with pytest.raises(ValueError, match=r"^link rate .* is outside 1mbit-1000gbit"):
            rate_bits(bad)
    r = script("--rate", "0.001kbit", "--", "-m", "tensorpar", "generate", timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("nshosts: error: link rate '0.001kbit' is outside")
    assert r.stderr.count("\n") == 1, r.stderr


def test_a_prefix_hostnames_cannot_take_is_named_as_the_prefix():
    for bad in ("", "_x", ".x", "-x"):
        with pytest.raises(ValueError, match=r"^namespace prefix must be 1-40 letters"):
            NamespaceHosts(2, None, prefix=bad)
    r = script("--prefix=_x", "--", "-m", "tensorpar", "generate", timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("nshosts: error: namespace prefix must"), r.stderr


def test_a_name_taken_after_the_check_is_refused_in_one_line_and_the_other_runs_namespace_kept():
    hosts = NamespaceHosts(1, None, prefix=f"tpt{os.getpid()}")
    subprocess.run(["ip", "netns", "add", hosts.switch], check=True)      # another run, between check and make
    try:
        with pytest.raises(ValueError, match=rf"^namespace name '{hosts.switch}' is already in use"):
            hosts.up()
        assert hosts.switch in netns_names()                 # not ours: left alone
        assert not any(ns.startswith(hosts.prefix + "-h") for ns in netns_names())
    finally:
        subprocess.run(["ip", "netns", "del", hosts.switch])


def test_a_killed_runs_prefixed_namespaces_and_their_processes_are_swept():
    ns = f"tpk{os.getpid()}-h0"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])  # not waited for: a zombie, as a killed run's script
    while open(f"/proc/{dead.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":    # is until init reaps it
        time.sleep(0.05)
    os.makedirs(nshosts.OWNERS, exist_ok=True)
    with open(os.path.join(nshosts.OWNERS, ns), "w") as f:
        f.write(str(dead.pid))
    left = subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "600"])
    try:
        time.sleep(0.5)
        assert ns in sweep_stale()
        assert ns not in netns_names() and not os.path.exists(os.path.join(nshosts.OWNERS, ns))
        assert left.wait(timeout=10) == -signal.SIGKILL      # the process it still held is gone too
    finally:
        dead.wait()
        left.kill()
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if os.path.exists(os.path.join(nshosts.OWNERS, ns)):
            os.unlink(os.path.join(nshosts.OWNERS, ns))


def _start(tmp_path, job_text: str, prefix: str, *args, **kw) -> subprocess.Popen:
    job = tmp_path / "job.py"
    job.write_text(job_text)
    return subprocess.Popen([sys.executable, "scripts/nshosts.py", "--prefix", prefix, "--rate", "none", *args, "--",
                             str(job)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), **kw)


def _wait_up(p: subprocess.Popen, prefix: str) -> list[int]:
    """Wait for both hosts' ranks' "rank up" line (shown as it comes, after its host's name: a rank that has not
    printed it may not have its signal handler yet); the pids in the hosts."""
    deadline, seen = time.monotonic() + 120, ""
    up = [f"[{prefix}-h{k}] rank up" for k in (0, 1)]
    while not all(u in seen for u in up) and time.monotonic() < deadline:
        seen += p.stdout.readline()
    assert all(u in seen for u in up), seen
    pids = [int(x) for ns in (f"{prefix}-h0", f"{prefix}-h1")
            for x in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()]
    assert pids
    return pids


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (a killed process whose parent died first may stay a zombie until init reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone(prefix: str, pids: list[int]) -> None:
    assert not any(ns.startswith(prefix + "-") for ns in netns_names())
    assert not any(_running(pid) for pid in pids)
    assert not any(n.startswith(prefix) for n in os.listdir(nshosts.OWNERS))


#: a rank that says it got SIGTERM on stderr and goes on sleeping (it ignores it)
STUBBORN = ("import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *a: print('rank got SIGTERM', file=sys.stderr, flush=True))\n"
            "print('rank up', flush=True)\ntime.sleep(600)\n")


def test_sigterm_tears_the_hosts_down_as_ctrl_c_does(tmp_path):
    """SIGTERM (timeout, kill): the ranks get SIGTERM through their agents and their own lines still show (review:
    hidden with torchrun's report), a second SIGTERM during the 10 s grace is ignored (review: a traceback), then
    everything in the hosts is killed and the hosts are deleted."""
    prefix = f"tps{os.getpid()}"
    p = _start(tmp_path, STUBBORN, prefix)
    try:
        pids = _wait_up(p, prefix)
        p.send_signal(signal.SIGTERM)
        time.sleep(1)
        p.send_signal(signal.SIGTERM)
        err = p.communicate(timeout=90)[1]
    finally:
        p.kill()
    assert p.returncode == 130 and "interrupted; the hosts and every process in them are removed" in err, err
    assert f"[{prefix}-h0] rank got SIGTERM" in err and f"[{prefix}-h1] rank got SIGTERM" in err, err
    assert "Traceback" not in err and "left out (--verbose shows them)" in err, err
    _gone(prefix, pids)


def test_sigint_stops_a_run_started_in_the_background_of_a_script(tmp_path):
    """A shell script's ``cmd &`` starts it with SIGINT ignored (review: kill -INT did nothing, a server ran on to
    --timeout): the script takes SIGINT back."""
    prefix = f"tpi{os.getpid()}"
    p = _start(tmp_path, "import time\nprint('rank up', flush=True)\ntime.sleep(600)\n", prefix,
               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        pids = _wait_up(p, prefix)
        p.send_signal(signal.SIGINT)
        err = p.communicate(timeout=90)[1]
    finally:
        p.kill()
    assert p.returncode == 130, err
    _gone(prefix, pids)


def test_timeout_kills_the_ranks_not_only_their_agents(tmp_path):
    """torchrun runs each rank in a session of its own: killing the agents' process groups left them running to the
    end, the hosts' pipes open (review: --timeout 8 ended after 123 s)."""
    job = tmp_path / "job.py"
    job.write_text("import time\nprint('rank up', flush=True)\ntime.sleep(120)\nprint('done', flush=True)\n")
    t0 = time.monotonic()
    r = script("--rate", "none", "--timeout", "8", "--", str(job), timeout=120)
    assert time.monotonic() - t0 < 60 and "done" not in r.stdout, r.stdout
    assert r.returncode == 1 and "torchrun exit -9 (killed at the timeout (8 s))" in r.stderr, r.stderr


def test_a_failing_rank_shows_its_line_and_one_line_per_host_not_torchruns_report(tmp_path):
    job = tmp_path / "job.py"
    job.write_text("import sys\nprint('tensorpar generate: error: --pp 31 exceeds the model', file=sys.stderr)\n"
                   "sys.exit(2)\n")
    r = script("--rate", "none", "--", str(job), timeout=300)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.splitlines()
    assert sum("tensorpar generate: error: --pp 31" in ln for ln in lines) == 2, r.stderr     # one per host
    for k in (0, 1):                                     # each host's rank (global rank k), its own exit code
        assert sum(ln.startswith("nshosts: host ") and f"-h{k} " in ln and f"torchrun exit 1 (rank {k}: exit code 2)"
                   in ln for ln in lines) == 1, r.stderr
    assert "ChildFailedError" not in r.stderr and "Traceback" not in r.stderr and "Root Cause" not in r.stderr
    assert len(lines) <= 8, r.stderr
    full = script("--rate", "none", "--verbose", "--", str(job), timeout=300)
    assert "ChildFailedError" in full.stderr and "left out" not in full.stderr


def test_the_failed_host_line_names_the_root_cause_rank_not_the_first_stopped(tmp_path):
    """Two ranks on one host, rank 1 fails while rank 0 sleeps: torchrun lists rank 0 (stopped by SIGTERM) first
    under "Failures" and rank 1 under "Root Cause" (review: the line named rank 0, exit code -15). A genuine
    exception's traceback stays visible; only torchrun's report is left out."""
    job = tmp_path / "job.py"
    job.write_text("import os, time\nif os.environ['RANK'] == '1':\n    raise KeyError('boom')\ntime.sleep(600)\n")
    r = script("--hosts", "1", "--nproc-per-host", "2", "--rate", "none", "--", str(job), timeout=300)
    assert r.returncode == 1, r.stderr
    assert "torchrun exit 1 (rank 1: exit code 1)" in r.stderr, r.stderr
    assert "KeyError: 'boom'" in r.stderr and "ChildFailedError" not in r.stderr, r.stderr
