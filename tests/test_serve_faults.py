"""A rank that dies under `tensorpar serve`: the command exits non-zero, nothing hangs or is left running."""
import json
import os
import signal
import subprocess
import time

import pytest

from tests.test_serve import make_folder, start_server

pytest.importorskip("fastapi")


def _rank_pids(launcher_pid: int) -> list[int]:
    """The launcher's worker processes in start order (the elastic agent starts local rank 0 first)."""
    out = subprocess.run(["pgrep", "-P", str(launcher_pid)], capture_output=True, text=True).stdout.split()
    pids = []
    for pid in map(int, out):
        try:
            if b"spawn_main" in open(f"/proc/{pid}/cmdline", "rb").read():
                pids.append(pid)
        except OSError:
            pass
    return sorted(pids)


@pytest.mark.slow
def test_rank_death_mid_request_exits_nonzero(tmp_path):
    import http.client
    folder = make_folder(tmp_path / "tiny")
    p, url = start_server(folder, "--max-batch", "2", "--max-model-len", "120", "--timeout", "20")
    try:
        host, port = url.split("//")[1].split("/")[0].split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=120)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": [1, 2], "max_tokens": 110, "temperature": 0,
                                                            "stream": True}), {"content-type": "application/json"})
        resp = conn.getresponse()
        assert resp.readline().startswith(b"data: ")       # generating
        ranks = _rank_pids(p.pid)
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGKILL)                    # rank 1 dies mid-request
        try:
            resp.read()              # the stream ends (an error chunk or a cut connection), it does not hang
        except (http.client.IncompleteRead, ConnectionError):
            pass
        rc = p.wait(timeout=120)
        assert rc != 0
        left = ""
        for _ in range(40):
            left = subprocess.run(["pgrep", "-a", "-s", str(p.pid)], capture_output=True, text=True).stdout.strip()
            if not left:
                break
            time.sleep(0.25)
        assert left == ""
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
