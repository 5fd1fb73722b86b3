"""`tensorpar train --tp --pp --dp`: bad layouts refused in the launching process (one line, exit 2), a launched
(tp 2, pp 2) run on Shakespeare, and its checkpoint resumed by a one-process run."""
import os
import subprocess
import sys

import pytest

from tensorpar.train.cli import add_arguments, main


def run_main(argv, monkeypatch=None):
    import argparse
    p = argparse.ArgumentParser()
    add_arguments(p)
    return main(p.parse_args(argv))


@pytest.mark.parametrize("argv,msg", [
    (["--tp", "2", "--pp", "3"], "exceeds the model's 2 layers; every pipeline stage needs at least one layer: use pp <= 2"),
    (["--pp", "2", "--micro-batches", "3"], "batch_size=8 is not divisible by dp x micro_batches = 1 x 3"),
    (["--pp", "2", "--micro-batches", "1"], "micro_batches=1 is fewer than pp=2, which the 1f1b schedule needs"),
    (["--pp", "2", "--micro-batches", "2", "--schedule", "interleaved-1f1b"],
     "exceeds the model's 2 layers; every pipeline stage needs at least one layer: use a schedule without interleaving"),
    (["--pp", "2", "--model", "gpt2cfg"], None),
])
def test_bad_layouts_fail_before_launch(tmp_path, capsys, argv, msg):
    if msg is None:   # a family the pipeline cannot cut
        cfg = tmp_path / "gpt2.json"
        cfg.write_text('{"model_type": "gpt2", "n_embd": 24, "n_layer": 2, "n_head": 6, "n_positions": 128, '
                       '"vocab_size": 256, "bos_token_id": 0, "eos_token_id": 0}')
        argv = ["--pp", "2", "--model", str(cfg)]
        msg = "pipeline parallelism supports llama, mistral, qwen2, qwen3, not 'gpt2'; use --pp 1"
    rc = run_main(argv + ["--data", "shakespeare", "--out", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and msg in err[0], err


def test_torchrun_world_size_must_match_the_degrees(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    rc = run_main(["--tp", "2", "--pp", "1", "--data", "shakespeare", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert rc == 2 and "--tp 2 x --pp 1 x --dp 1 = 2, but torchrun started WORLD_SIZE=4 ranks" in err


@pytest.mark.slow  # CI keeps test_3d's in-process resume on one process
@pytest.mark.network
def test_tp2_pp2_run_then_resume_on_one_process(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    common = ["--data", "shakespeare", "--seq-len", "32", "--batch-size", "4", "--out", str(out), "--no-progress"]
    r = subprocess.run([sys.executable, "-m", "tensorpar", "train", "--tp", "2", "--pp", "2",   # micro-batches = pp
                        "--steps", "3"] + common, capture_output=True, text=True, env=env, timeout=500)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "done: step 3" in r.stdout
    r = subprocess.run([sys.executable, "-m", "tensorpar", "train", "--tp", "1", "--resume", "--steps", "4"] + common,
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "done: step 4" in r.stdout
