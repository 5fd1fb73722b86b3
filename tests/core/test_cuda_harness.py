"""The jobs and spawn harness of tests/core/test_cuda.py, run on two CPU gloo ranks, so the expected values
of the CUDA tests are checked on every machine (the CUDA tests themselves skip without a GPU)."""
import torch

from tests.core.test_cuda import job_collectives, job_layers, run_cuda_ranks


def test_collective_checks_hold_on_cpu():
    for rank, checks in enumerate(run_cuda_ranks("gloo-cpu", job_collectives)):
        assert checks and all(checks.values()), f"rank {rank}: {checks}"


def test_layer_parity_job_on_cpu():
    for rank, diffs in enumerate(run_cuda_ranks("gloo-cpu", job_layers)):
        assert len(diffs) == 4 and max(diffs.values()) <= 1e-5, f"rank {rank}: {diffs}"


def test_layer_parity_job_at_tp1_on_cpu():
    from tensorpar.parallel import ParallelContext

    diffs = job_layers(ParallelContext.single("cpu"), torch.device("cpu"))
    assert max(diffs.values()) <= 1e-6, diffs


def _gpu_check(tmp_path, limit_s: int):
    import os
    import subprocess
    import sys

    results = tmp_path / "gpu_check.md"
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_TIMEOUT_S=str(limit_s))
    r = subprocess.run(["bash", "scripts/gpu_check.sh", str(results)], capture_output=True, text=True, env=env,
                       timeout=limit_s + 120)
    return r, results.read_text()


def test_gpu_check_script_writes_results_and_skips_without_a_gpu(tmp_path):
    import pytest

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: run scripts/gpu_check.sh itself")
    r, text = _gpu_check(tmp_path, 300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "result: exit 0" in text and "cuda available False" in text
    assert "test_collectives_on_cuda[nccl-2gpu] SKIPPED" in text and "no CUDA device on this machine" in text


def test_gpu_check_script_reports_its_time_limit(tmp_path):
    r, text = _gpu_check(tmp_path, 1)  # pytest cannot even start in 1 s
    assert r.returncode == 124, r.stdout + r.stderr
    assert "result: TIMED OUT after 1 s (exit 124)" in text


def test_more_ranks_than_gpus_is_refused_before_launch(monkeypatch):
    """The launcher's (and init_parallel's) rule on a CUDA machine: one GPU per rank under NCCL, checked here
    with a pretend CUDA of one GPU."""
    import pytest

    from tensorpar.launch import check_gpu_count

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_gpu_count(1)
    check_gpu_count(4, backend="gloo")          # gloo ranks may share a GPU (or run on the CPU)
    with pytest.raises(ValueError, match=r"^2 ranks on this host but CUDA sees 1 GPU: NCCL needs one GPU per rank; "
                                         r"use at most 1 rank per host .*CUDA_VISIBLE_DEVICES="):
        check_gpu_count(2)
