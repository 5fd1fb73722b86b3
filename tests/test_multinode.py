"""Launched as clusters launch: two torchrun agents (``--nnodes 2 --nproc-per-node 2``, c10d rendezvous on
loopback) train (tp 2 inside a "node", dp 2 across) and equal the one-process run; a rank killed with SIGKILL
makes torchrun restart the group (``--max-restarts 1``), which resumes from the last checkpoint and ends with
the uninterrupted run's final loss."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tensorpar.launch import free_port

TRAIN = ["--data", "shakespeare", "--seq-len", "32", "--batch-size", "4", "--no-progress", "--eval-every", "0",
         "--lr", "1e-2"]


def torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", *args]


def losses(out: Path) -> list[float]:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["loss"] for r in recs if r.get("kind") == "train"]


def env():
    return dict(os.environ, PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")


@pytest.mark.network
def test_two_agents_equal_one_process(tmp_path):
    ref = subprocess.run([sys.executable, "-m", "tensorpar", "train", "--tp", "1", "--steps", "3", "--out",
                          str(tmp_path / "ref")] + TRAIN, capture_output=True, text=True, env=env(), timeout=300)
    assert ref.returncode == 0, ref.stderr[-2000:]
    port = free_port()
    agents = [subprocess.Popen(torchrun("--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(n),
                                        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                                        "--rdzv-id", "t", "-m", "tensorpar", "train", "--tp", "2", "--dp", "2",
                                        "--steps", "3", "--out", str(tmp_path / "two")) + TRAIN,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
              for n in range(2)]
    for a in agents:
        out, err = a.communicate(timeout=600)
        assert a.returncode == 0, err[-3000:]
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "ref"), rel=1e-5)


def _children(pid: int) -> list[int]:
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    except FileNotFoundError:
        return []
    return [int(x) for x in out.split()]


@pytest.mark.slow  # passed 3 of 4 runs here: once the restarted group's gloo mesh could not connect (see the note)
@pytest.mark.network
def test_killed_rank_restarts_and_resumes(tmp_path):
    steps = ["--steps", "40", "--save-every", "2"]
    ref = subprocess.run([sys.executable, "-m", "tensorpar", "train", "--tp", "2", "--out", str(tmp_path / "ref")]
                         + steps + TRAIN, capture_output=True, text=True, env=env(), timeout=400)
    assert ref.returncode == 0, ref.stderr[-2000:]
    out = tmp_path / "killed"
    log = open(tmp_path / "agent.log", "w")
    agent = subprocess.Popen(torchrun("--nproc-per-node", "2", "--max-restarts", "1", "--rdzv-backend", "c10d",
                                      "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "tensorpar", "train",
                                      "--tp", "2", "--timeout", "60", "--out", str(out)) + steps + TRAIN,
                             stdout=log, stderr=subprocess.STDOUT, text=True, env=env())
    deadline = time.monotonic() + 400
    while not (out / "checkpoints" / "step_000002").is_dir():          # first checkpoint written
        assert agent.poll() is None and time.monotonic() < deadline, "no checkpoint before the deadline"
        time.sleep(0.2)
    ranks = [p for p in _children(agent.pid) if "tensorpar" in Path(f"/proc/{p}/cmdline").read_text()]
    assert ranks, "torchrun's rank processes not found"
    os.kill(ranks[-1], signal.SIGKILL)
    agent.wait(timeout=500)
    log.close()
    assert agent.returncode == 0, (tmp_path / "agent.log").read_text()[-3000:]
    assert losses(out)[-1] == pytest.approx(losses(tmp_path / "ref")[-1], rel=1e-5)
