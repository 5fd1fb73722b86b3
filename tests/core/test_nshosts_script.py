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
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()                                              # a pid that is gone
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
        left.kill()
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_sigterm_tears_the_hosts_down_as_ctrl_c_does(tmp_path):
    job = tmp_path / "job.py"
    job.write_text("import time\nprint('rank up', flush=True)\ntime.sleep(600)\n")
    prefix = f"tps{os.getpid()}"
    p = subprocess.Popen([sys.executable, "scripts/nshosts.py", "--prefix", prefix, "--rate", "none", "--", str(job)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    try:
        deadline = time.monotonic() + 120
        seen = ""
        while "rank up" not in seen and time.monotonic() < deadline:   # the ranks' lines come as they are written
            seen += p.stdout.readline()
        assert "rank up" in seen and seen.startswith(f"[{prefix}-h"), seen
        pids = [int(x) for ns in (f"{prefix}-h0", f"{prefix}-h1")
                for x in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()]
        assert pids
        p.send_signal(signal.SIGTERM)
        err = p.communicate(timeout=60)[1]
    finally:
        p.kill()
    assert p.returncode == 130 and "interrupted; the hosts and every process in them are removed" in err, err
    assert "Traceback" not in err, err
    assert not any(ns.startswith(prefix + "-") for ns in netns_names())
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)
    assert not any(n.startswith(prefix) for n in os.listdir(nshosts.OWNERS))


def test_a_failing_rank_shows_its_line_and_one_line_per_host_not_torchruns_report(tmp_path):
    job = tmp_path / "job.py"
    job.write_text("import sys\nprint('tensorpar generate: error: --pp 31 exceeds the model', file=sys.stderr)\n"
                   "sys.exit(2)\n")
    r = script("--rate", "none", "--", str(job), timeout=300)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.splitlines()
    assert sum("tensorpar generate: error: --pp 31" in ln for ln in lines) == 2, r.stderr     # one per host
    assert sum(ln.startswith("nshosts: host ") and "torchrun exit 1 (rank " in ln and "exit code 2" in ln
               for ln in lines) == 2, r.stderr
    assert "ChildFailedError" not in r.stderr and "Traceback" not in r.stderr and "Root Cause" not in r.stderr
    assert len(lines) <= 8, r.stderr
    full = script("--rate", "none", "--verbose", "--", str(job), timeout=300)
    assert "ChildFailedError" in full.stderr and "left out" not in full.stderr
