"""Leftovers of a fresh-user review of the CLI: each flag a user can get wrong ends in one line, in the launching
process, before any rank starts (exit 2), and nothing prints what the user turned off.

Runs in this process at tp = 1 (the tiny preset trains a few steps in seconds) except the two that need a real
launcher: a dp = 2 run (DDP's warning is printed by the ranks) and a torchrun run (its failure summary).
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tensorpar.cli import main
from tests.decode.test_generate_cli import tiny_with_tokenizer  # noqa: F401  (fixture: random llama + tokenizer)
from tests.cli.test_safety import _copy_run, _train, finished_run, text_file  # noqa: F401  (fixtures)

REPO = Path(__file__).resolve().parents[2]


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=str(REPO), TENSORPAR_THREADS="1", **extra)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"):
        env.pop(k, None)
    return env


def _one_error_line(err: str, command: str = "train") -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tensorpar {command}: error: "), err
    return lines[0]


# ---------------------------------------------------------------- 1: a value that starts with '-'

@pytest.mark.parametrize("value", ["-1,1", "-0.5,1", "-1"])
def test_negative_tp_weights_reach_the_check_not_argparse(tmp_path, text_file, capsys, value):  # noqa: F811
    """``--tp-weights -1,1`` (space, not '=') used to end in argparse's usage wall: '-1,1' looked like an option."""
    rc = _train("--tp", "2", "--tp-weights", value, "--out", str(tmp_path / "out"), text_file=text_file)
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and "--tp-weights" in line and value.split(",")[0].lstrip("-") in line
    assert "usage:" not in line and not (tmp_path / "out").exists()
    if value != "-1":
        assert "every weight must be a positive finite number" in line and "smaller positive weight" in line


def test_generate_negative_tp_weights_one_line(tiny_with_tokenizer, capsys):  # noqa: F811
    assert main(["generate", "--model", tiny_with_tokenizer, "--tp", "2", "--tp-weights", "-1,1", "--prompt", "hi"]) == 2
    line = _one_error_line(capsys.readouterr().err, "generate")
    assert "-1,1" in line and "positive" in line, line


def test_dash_values_are_joined_only_for_options_that_take_one_value():
    import argparse

    from tensorpar.cli import _join_dash_values
    p = argparse.ArgumentParser()
    p.add_argument("--tp-weights")
    p.add_argument("--flag", action="store_true")
    p.add_argument("--n", type=int)
    argv = ["--tp-weights", "-1,1", "--flag", "-2", "--n", "-3", "--", "--tp-weights", "-1,1"]
    assert _join_dash_values(p, argv) == ["--tp-weights=-1,1", "--flag", "-2", "--n=-3", "--", "--tp-weights",
                                          "-1,1"]
    assert p.parse_args(_join_dash_values(p, ["--tp-weights", "-1,1"])).tp_weights == "-1,1"
    # what float() reads as minus infinity or nan, any case; not an option that merely starts with those letters
    assert _join_dash_values(p, ["--n", "-inf", "--tp-weights", "-NaN", "--n", "-Infinity", "--n", "-info"]) == [
        "--n=-inf", "--tp-weights=-NaN", "--n=-Infinity", "--n", "-info"]
    # an abbreviation argparse accepts (the prefix of one option) is joined as the option; an ambiguous one is not
    p.add_argument("--nice", type=int)
    assert _join_dash_values(p, ["--tp-w", "-1,1", "--ni", "-2", "--n", "-3"]) == ["--tp-w=-1,1", "--ni=-2", "--n=-3"]
    assert _join_dash_values(p, ["--t", "-1", "--", "--tp-w", "-1"]) == ["--t=-1", "--", "--tp-w", "-1"]
    p.add_argument("--tp-size", type=int)
    assert _join_dash_values(p, ["--tp", "-1"]) == ["--tp", "-1"]


def test_plan_memory_gb_minus_inf_is_refused_by_its_check(capsys):
    """``plan --memory-gb -inf`` (a space, not '='): the flag's own check names it, not argparse's usage error."""
    rc = main(["plan", "--model", "llama3-8b", "--gpus", "8", "--memory-gb", "-inf"])
    err = capsys.readouterr().err
    assert rc != 0 and "--memory-gb" in err and "usage:" not in err, err
    rc = main(["plan", "--model", "llama3-8b", "--gpus", "8", "--mem", "-inf"])      # abbreviated, as argparse allows
    err = capsys.readouterr().err
    assert rc != 0 and "--memory-gb -inf: must be a finite number > 0" in err and "usage:" not in err, err


# ---------------------------------------------------------------- 2: flags that do nothing at the degrees given

def test_sequence_parallel_at_tp1_warns_and_runs_without_it(tmp_path, text_file, capsys):  # noqa: F811
    out = tmp_path / "out"
    rc = _train("--steps", "2", "--save-every", "0", "--sequence-parallel", "--out", str(out), text_file=text_file)
    err = capsys.readouterr().err
    assert rc == 0, err
    warn = [ln for ln in err.splitlines() if "warning" in ln]
    assert warn == ["tensorpar: warning: --sequence-parallel has no effect at --tp 1 (it splits activations over "
                    "the tp ranks); running without it (use --tp 2 or more for sequence parallelism)"]
    state = json.loads(next((out / "checkpoints").glob("step_*/trainer_state.json")).read_text())
    assert state["config"]["sequence_parallel"] is False


def test_schedule_without_pp_warns(tmp_path, text_file, capsys):  # noqa: F811
    rc = _train("--steps", "1", "--save-every", "0", "--schedule", "gpipe", "--out", str(tmp_path / "o"),
                text_file=text_file)
    err = capsys.readouterr().err
    assert rc == 0, err
    assert [ln for ln in err.splitlines() if "warning" in ln] == [
        "tensorpar: warning: --schedule gpipe has no effect at --pp 1 (it orders the micro-batches of pipeline "
        "stages); ignored (use --pp 2 or more for a pipeline)"]


@pytest.mark.parametrize("argv,warned", [
    (["--tp", "2", "--sequence-parallel"], False),
    (["--tp", "1"], False),
    (["--pp", "2", "--schedule", "gpipe"], False),
    (["--pp", "1"], False),                       # the default schedule is not the user's choice: nothing to say
    (["--tp", "1", "--sequence-parallel"], True),
    (["--pp", "1", "--schedule", "1f1b"], True),  # given explicitly, even if it is the default
])
def test_only_no_op_flags_are_reported(argv, warned):
    import argparse

    from tensorpar.train.cli import add_arguments, config_from_args, drop_no_ops
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(argv)
    cfg, notes = drop_no_ops(args, config_from_args(args))
    assert bool(notes) == warned
    assert cfg.sequence_parallel == (args.sequence_parallel and args.tp > 1)


# ---------------------------------------------------------------- 3: plan takes train's presets

def test_plan_accepts_the_train_presets(capsys):
    from tensorpar.data.tokenizers import ByteTokenizer
    from tensorpar.hf.presets import PRESETS, preset_config
    for name in PRESETS:
        rc = main(["plan", "--model", name, "--gpus", "2", "--gpus-per-node", "2", "--global-batch", "8",
                   "--seq", "64", "--json", "--top", "1"])
        out = capsys.readouterr()
        assert rc == 0, out.err
        plans = json.loads(out.out)
        assert plans and plans[0]["tp"] * plans[0]["pp"] * plans[0]["dp"] == 2
    from tensorpar.planner.cli import _preset
    spec, c = _preset("small", 64), preset_config("small", ByteTokenizer.vocab_size, 64)
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.ffn_hidden_size,
            spec.vocab_size, spec.tied_embeddings) == (c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
                                                       c.num_key_value_heads, c.intermediate_size, 256, True)


def test_plan_unknown_preset_lists_both_kinds(capsys):
    assert main(["plan", "--model", "tinyy", "--gpus", "2", "--global-batch", "8", "--seq", "64"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'tinyy' is not a preset" in err and "gpt3-175b" in err and "tiny, small" in err


# ---------------------------------------------------------------- 4: a truncated checkpoint shard

def _truncate_shard(ckpt: Path) -> Path:
    f = sorted((ckpt / "model").glob("*.safetensors"))[0]
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    return f


def test_truncated_shard_names_an_older_checkpoint(finished_run, tmp_path, text_file, capsys):  # noqa: F811
    out = _copy_run(finished_run, tmp_path)
    bad = _truncate_shard(out / "checkpoints" / "step_000006")
    assert _train("--steps", "8", "--out", str(out), "--resume", text_file=text_file) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert str(bad) in line and "download" not in line
    assert line.endswith(f"the checkpoint {out / 'checkpoints' / 'step_000006'} is damaged; resume from an older "
                         f"one: --resume {out / 'checkpoints' / 'step_000003'}"), line


def test_truncated_shard_of_the_only_checkpoint(finished_run, tmp_path, text_file, capsys):  # noqa: F811
    out = _copy_run(finished_run, tmp_path)
    shutil.rmtree(out / "checkpoints" / "step_000006")
    (out / "checkpoints" / "latest").unlink(missing_ok=True)
    _truncate_shard(out / "checkpoints" / "step_000003")
    assert _train("--steps", "8", "--out", str(out), "--resume", text_file=text_file) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "is damaged and" in line and "holds no older one; start a fresh run (a new --out)" in line


def test_truncated_shard_found_by_a_rank_says_the_same(finished_run, tmp_path):  # noqa: F811
    """A shard damaged after the launch checks (or a direct load) fails in load_checkpoint with the same advice."""
    from tensorpar.train.checkpoint import read_full
    out = _copy_run(finished_run, tmp_path)
    ck = out / "checkpoints" / "step_000006"
    _truncate_shard(ck)
    with pytest.raises(ValueError, match=r"is damaged; resume from an older one: --resume .*step_000003"):
        read_full(ck / "model")


# ---------------------------------------------------------------- 5: DDP's deprecation warning

@pytest.mark.slow  # a launched DDP run (16 s)
def test_ddp_run_prints_no_deprecation_warning(tmp_path, text_file):  # noqa: F811
    p = subprocess.run([sys.executable, "-m", "tensorpar", "train", "--tp", "1", "--dp", "2", "--model", "tiny",
                        "--data", text_file, "--seq-len", "16", "--batch-size", "2", "--steps", "1", "--eval-batches",
                        "1", "--warmup-steps", "1", "--no-progress", "--out", str(tmp_path / "out")],
                       cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "broadcast_buffers" not in p.stderr and "FutureWarning" not in p.stderr, p.stderr[-3000:]


def test_ddp_keyword_turns_off_the_forward_buffer_sync():
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    from tensorpar.train.dp import no_forward_buffer_sync
    kw = no_forward_buffer_sync(DistributedDataParallel)
    assert list(kw.values()) == [False]
    assert list(kw) == (["forward_sync_buffers"] if "forward_sync_buffers" in
                        inspect.signature(DistributedDataParallel.__init__).parameters else ["broadcast_buffers"])


# ---------------------------------------------------------------- 6: --export under --no-progress

def test_export_shows_no_progress_bar_under_no_progress(tmp_path, text_file, capsys):  # noqa: F811
    rc = _train("--steps", "2", "--save-every", "0", "--out", str(tmp_path / "out"), "--export",
                str(tmp_path / "hf"), text_file=text_file)
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert "Writing model shards" not in cap.err and "\r" not in cap.err, cap.err
    from transformers.utils import logging as hf_logging
    assert hf_logging.is_progress_bar_enabled()  # switched back on for the rest of the process


# ---------------------------------------------------------------- 7: torchrun's summary shows our line

def test_error_file_for_torchrun(tmp_path, text_file, capsys, monkeypatch):  # noqa: F811
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    err_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(err_file))
    rc = _train("--lr", "nan", "--out", str(tmp_path / "out"), text_file=text_file)
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2
    failure = ProcessFailure(local_rank=0, pid=os.getpid(), exitcode=rc, error_file=str(err_file))
    assert failure.message["message"] == line
    summary = ChildFailedError("tensorpar", {0: failure}).format_msg()
    assert f"traceback : {line}\n" in summary and "To enable traceback" not in summary


def test_no_error_file_outside_torchrun(tmp_path, text_file, capsys, monkeypatch):  # noqa: F811
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    for k in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert _train("--lr", "nan", "--out", str(tmp_path / "out"), text_file=text_file) == 2
    capsys.readouterr()
    assert not (tmp_path / "error.json").exists()


def test_torchrun_summary_shows_the_one_line(tmp_path, text_file):  # noqa: F811
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--max-restarts",
                        "0", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "-m", "tensorpar", "train",
                        "--tp", "1", "--model", "tiny", "--data", text_file, "--lr", "nan", "--out",
                        str(tmp_path / "out")], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    ours = "tensorpar train: error: --lr nan: must be a finite number"
    first = [ln for ln in p.stderr.splitlines() if ln.startswith("tensorpar train: error:")]
    assert len(first) == 1 and first[0].startswith(ours), p.stderr[-3000:]
    assert f"traceback : {first[0]}" in p.stderr and "To enable traceback" not in p.stderr, p.stderr[-3000:]
