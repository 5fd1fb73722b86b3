"""HTTP helpers of the serve tests' client processes (standard library only: a client started in a namespace host
imports this, not torch).

Used in the client code strings of the namespace-host tests (tests/decode/test_generate_pp.py,
tests/decode/test_serve_hosts_faults.py), which run ``python -c`` in a host with ``PYTHONPATH`` at the repository::

    from tests._http import wait_healthy
    wait_healthy("http://10.0.0.1:8123", timeout_s=240)
"""
import sys
import time
import urllib.request


def wait_healthy(base_url: str, timeout_s: float, poll_s: float = 0.5) -> float:
    """Wait until ``GET <base_url>/health`` answers 200 (a server's ranks have loaded the model); return the seconds
    waited. A refused or reset connection, or another status, is retried every ``poll_s`` seconds; after
    ``timeout_s`` seconds the process exits with "server not ready" (``SystemExit``, exit code 1)."""
    t0 = time.monotonic()
    while True:
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:     # refused while the ranks load; urllib's HTTPError (a 503) is an OSError too
            pass
        if time.monotonic() - t0 > timeout_s:
            sys.exit(f"server not ready: no 200 from {base_url}/health within {timeout_s:g} s")
        time.sleep(poll_s)
