"""Nothing lost, nothing silent (issue 14, items 1-3 for `tensorpar train` and export).

Everything runs in this process at tp = 1 (the checks are made in the launching process, before any rank
starts, so no rank is needed to prove them); the tiny preset trains 3 steps in a few seconds.
"""
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from tensorpar.cli import main
from tensorpar.parallel import ParallelContext
from tensorpar.train.checkpoint import CheckpointError, read_state
from tensorpar.train.config import TrainConfig
from tensorpar.train.export import MARKER, export_hf
from tensorpar.train.metrics import MetricsLog, read_metrics


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    lines = [f"{w} {i % 7} the quick brown fox jumps over the lazy dog {i % 3}." for i, w in
             enumerate(["Alas", "Hark", "Prithee", "Forsooth"] * 100)]
    p = tmp_path_factory.mktemp("text") / "corpus.txt"
    p.write_text("\n".join(lines))
    return str(p)


def _cfg(text_file, out, **kw):
    base = dict(model="tiny", data=text_file, seq_len=16, batch_size=2, steps=6, eval_every=3, eval_batches=1,
                save_every=3, warmup_steps=1, out_dir=str(out), keep_checkpoints=3)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, text_file):
    """A finished 6-step run with checkpoints at steps 3 and 6; tests copy it before changing anything."""
    from tensorpar.train.cli import run
    out = tmp_path_factory.mktemp("run") / "run"
    run(_cfg(text_file, out), ParallelContext.single(), progress=False)
    return out


def _copy_run(finished_run, tmp_path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(finished_run, dst)
    return dst


def _train(*args, text_file):
    return main(["train", "--tp", "1", "--model", "tiny", "--data", text_file, "--seq-len", "16", "--batch-size",
                 "2", "--eval-batches", "1", "--warmup-steps", "1", "--no-progress", *args])


def _tree(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------- item 1: export never deletes what it did not write

def test_export_refuses_a_folder_with_the_users_files(finished_run, tmp_path):
    dest = tmp_path / "mine"
    dest.mkdir()
    (dest / "thesis.tex").write_text("years of work")
    for overwrite in (False, True):
        with pytest.raises(FileExistsError, match="not a tensorpar export"):
            export_hf(finished_run / "checkpoints", dest, overwrite=overwrite)
    assert _tree(dest) == {"thesis.tex": b"years of work"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_export_dot_never_empties_the_working_directory(finished_run, tmp_path, monkeypatch):
    (tmp_path / "notes.txt").write_text("keep me")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileExistsError):
        export_hf(finished_run / "checkpoints", ".", overwrite=True)
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_export_replaces_a_previous_export_only_with_overwrite(finished_run, tmp_path):
    from transformers import AutoModelForCausalLM

    dest = tmp_path / "hf"
    export_hf(finished_run / "checkpoints" / "step_000003", dest)
    marker = json.loads((dest / MARKER).read_text())
    assert "model.safetensors" in marker["files"] and marker["checkpoint"].endswith("step_000003")
    with pytest.raises(FileExistsError, match="--overwrite"):
        export_hf(finished_run / "checkpoints", dest)
    # a file the previous export wrote but the new one does not: removed; the marker said it was ours
    (dest / "old_only.bin").write_bytes(b"x")
    (dest / MARKER).write_text(json.dumps(dict(marker, files=marker["files"] + ["old_only.bin"])))
    export_hf(finished_run / "checkpoints", dest, overwrite=True)
    assert json.loads((dest / MARKER).read_text())["checkpoint"].endswith("step_000006")
    assert not (dest / "old_only.bin").exists()
    AutoModelForCausalLM.from_pretrained(dest)  # a complete folder
    # a file the user added to an export: the export is refused, even with --overwrite
    (dest / "README.md").write_text("my notes")
    with pytest.raises(FileExistsError, match="did not write"):
        export_hf(finished_run / "checkpoints", dest, overwrite=True)
    assert (dest / "README.md").read_text() == "my notes"


def test_export_into_an_empty_folder_follows_the_umask(finished_run, tmp_path):
    dest = tmp_path / "empty"
    dest.mkdir()
    old = os.umask(0o027)
    try:
        export_hf(finished_run / "checkpoints", dest)
        new = tmp_path / "new"
        export_hf(finished_run / "checkpoints", new)
    finally:
        os.umask(old)
    assert (dest / "model.safetensors").is_file() and (dest / MARKER).is_file()
    assert (new / "model.safetensors").stat().st_mode & 0o777 == 0o640
    assert new.stat().st_mode & 0o777 == 0o750


def test_train_refuses_export_folder_before_launch(text_file, tmp_path, capsys):
    dest = tmp_path / "hf"
    dest.mkdir()
    (dest / "x.txt").write_text("mine")
    rc = _train("--steps", "2", "--out", str(tmp_path / "out"), "--export", str(dest), text_file=text_file)
    assert rc == 2 and "--export" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and _tree(dest) == {"x.txt": b"mine"}
    rc = _train("--steps", "2", "--out", str(tmp_path / "out"), "--export", str(tmp_path / "out"), text_file=text_file)
    assert rc == 2 and "is the --out folder" in capsys.readouterr().err


# ---------------------------------------------------------------- item 1: --out

def test_fresh_train_refuses_an_earlier_runs_out(finished_run, tmp_path, text_file, capsys):
    out = _copy_run(finished_run, tmp_path)
    before = _tree(out)
    rc = _train("--steps", "2", "--out", str(out), text_file=text_file)
    err = capsys.readouterr().err
    assert rc == 2 and f"--out {str(out)!r} already holds files" in err and "--resume" in err
    assert _tree(out) == before  # metrics not truncated, no checkpoint pruned


def test_out_that_is_a_file_is_rejected_before_launch(tmp_path, text_file, capsys):
    f = tmp_path / "results"
    f.write_text("data")
    assert _train("--out", str(f), text_file=text_file) == 2
    assert "is a file, not a folder" in capsys.readouterr().err and f.read_text() == "data"


def test_metrics_log_never_truncates_on_a_fresh_start(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"kind": "train", "step": 1, "loss": 1.0}\n')
    with pytest.raises(FileExistsError):
        MetricsLog(p).start(None)
    assert p.read_text() == '{"kind": "train", "step": 1, "loss": 1.0}\n'


# ---------------------------------------------------------------- item 2: resume

@pytest.mark.parametrize("field,value,msg", [
    ("step", -1, "step=-1 is not a non-negative integer"),
    ("step", "3", "step='3' is not a non-negative integer"),
    ("step", 3.5, "step=3.5 is not a non-negative integer"),
    ("step", True, "step=True is not a non-negative integer"),
    ("step", 9, "step=9 but the folder is step_000003"),
    ("optimizer_step", 7, "optimizer_step=7 must be an integer in [0, step=3]"),
])
def test_inconsistent_checkpoint_state_is_refused(finished_run, tmp_path, field, value, msg, text_file, capsys):
    out = _copy_run(finished_run, tmp_path)
    ck = out / "checkpoints" / "step_000003"
    state = json.loads((ck / "trainer_state.json").read_text())
    state[field] = value
    (ck / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        read_state(ck)
    before = _tree(out)
    assert _train("--steps", "8", "--out", str(out), "--resume", str(ck), text_file=text_file) == 2
    assert msg in capsys.readouterr().err
    assert _tree(out) == before


def test_checkpoint_without_its_weights_is_refused(finished_run, tmp_path):
    out = _copy_run(finished_run, tmp_path)
    for f in (out / "checkpoints" / "step_000006" / "model").glob("*.safetensors"):
        f.unlink()
    with pytest.raises(CheckpointError, match=r"model/\*.safetensors is missing"):
        read_state(out / "checkpoints" / "step_000006")


@pytest.mark.parametrize("steps", ["3", "6"])
def test_steps_not_above_the_checkpoint_fails_before_launch(finished_run, tmp_path, text_file, capsys, steps):
    out = _copy_run(finished_run, tmp_path)
    before = _tree(out)
    assert _train("--steps", steps, "--out", str(out), "--resume", text_file=text_file) == 2
    assert f"--steps {steps} is not above the checkpoint's step 6" in capsys.readouterr().err
    assert _tree(out) == before


def test_metrics_that_stop_before_the_checkpoint_are_refused(finished_run, tmp_path, text_file, capsys):
    out = _copy_run(finished_run, tmp_path)
    recs = read_metrics(out / "metrics.jsonl")
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs if r["step"] <= 2))
    assert _train("--steps", "8", "--out", str(out), "--resume", text_file=text_file) == 2
    assert "ends at step 2 but the checkpoint is at step 6" in capsys.readouterr().err


def test_resume_from_an_older_checkpoint_keeps_the_history(finished_run, tmp_path, text_file):
    from tensorpar.train.cli import run
    out = _copy_run(finished_run, tmp_path)
    old = (out / "metrics.jsonl").read_bytes()
    cont = run(_cfg(text_file, out), ParallelContext.single(), progress=False,
               resume=str(out / "checkpoints" / "step_000003"))
    assert cont["step"] == 6
    assert (out / "metrics.jsonl.until-step-6").read_bytes() == old  # the earlier file, byte for byte
    train = lambda recs: [(r["step"], r["loss"]) for r in recs if r["kind"] == "train"]  # noqa: E731
    assert train(read_metrics(out / "metrics.jsonl")) == train(read_metrics(out / "metrics.jsonl.until-step-6"))


# ---------------------------------------------------------------- item 3: checked before launch

@pytest.mark.parametrize("content,msg", [(None, "is a folder"), (b"", "is empty"), (b"  \n\t\n", "is empty"),
                                         (b"caf\xe9 au lait", "is not UTF-8 text (byte 3")])
def test_bad_data_files(tmp_path, capsys, content, msg):
    path = tmp_path / "data.txt"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    assert _train("--out", str(tmp_path / "out"), text_file=str(path)) == 2
    assert msg in capsys.readouterr().err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag,value", [
    ("--lr", "nan"), ("--lr", "inf"), ("--lr", "-1"), ("--min-lr-ratio", "nan"), ("--weight-decay", "nan"),
    ("--weight-decay", "-0.1"), ("--grad-clip", "inf"), ("--grad-clip", "nan"), ("--label-smoothing", "nan"),
    ("--attention-dropout", "inf"), ("--hidden-dropout", "1"), ("--val-fraction", "nan"), ("--timeout", "nan"),
    ("--timeout", "inf"), ("--timeout", "0"), ("--timeout", "-5"), ("--seq-len", "0"), ("--batch-size", "-1"),
    ("--steps", "0"), ("--eval-batches", "0"), ("--eval-every", "-1"), ("--save-every", "-1"),
    ("--keep-checkpoints", "0"), ("--warmup-steps", "-1"), ("--seed", "-1"), ("--tp", "0"), ("--out", ""),
])
def test_every_numeric_flag_rejects_bad_values(tmp_path, text_file, capsys, flag, value):
    out = [] if flag == "--out" else ["--out", str(tmp_path / "out")]
    assert _train(flag, value, *out, text_file=text_file) == 2
    err = capsys.readouterr().err
    assert err.startswith("tensorpar train: error: ") and err.count("\n") == 1, err
    assert flag in err, err


def test_config_that_transformers_rejects_fails_before_launch(tmp_path, text_file, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 30, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "intermediate_size": 64, "num_hidden_layers": 1,
                               "vocab_size": 300, "max_position_embeddings": 256}))
    assert _train("--model", str(cfg), "--out", str(tmp_path / "out"), text_file=text_file) == 2
    err = capsys.readouterr().err
    assert "is invalid: The hidden size (30) is not a multiple of the number of attention heads (4)" in err


# ---------------------------------------------------------------- item 7: optional matplotlib

def test_missing_matplotlib_is_a_note_not_a_crash(tmp_path, text_file, monkeypatch, capsys):
    from tensorpar.train.cli import run
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # "import matplotlib" now raises ImportError
    s = run(_cfg(text_file, tmp_path / "run", steps=2, save_every=0), ParallelContext.single(), progress=False)
    assert s["step"] == 2 and "plot" not in s and not (tmp_path / "run" / "loss.png").exists()
    err = capsys.readouterr().err
    assert "matplotlib is not installed" in err and err.count("\n") == 1


# ---------------------------------------------------------------- item 9: waiting for another process

def test_waiting_for_a_lock_names_the_holder_and_gives_up(tmp_path, capsys):
    import subprocess

    from tensorpar.cache import file_lock
    lock = tmp_path / "locks" / "smollm2.lock"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom tensorpar.cache import file_lock\n"
                               f"with file_lock({str(lock)!r}):\n    print('held', flush=True)\n    time.sleep(120)\n"],
                              stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(TimeoutError, match=f"process {holder.pid} .*has held .*smollm2.lock for more than 1 s"):
            with file_lock(lock, what="smollm2", timeout_s=1.0):
                pass
        err = capsys.readouterr().err
        assert err.startswith(f"tensorpar: waiting for process {holder.pid} (") and "preparing smollm2" in err
    finally:
        holder.kill()
        holder.wait()
    with file_lock(lock, timeout_s=30):  # the holder is gone: the lock is free again
        assert lock.read_text() == str(os.getpid())


def test_data_position_that_is_not_the_step_is_refused(finished_run, tmp_path, text_file, capsys):
    out = _copy_run(finished_run, tmp_path)
    ck = out / "checkpoints" / "step_000006"
    state = json.loads((ck / "trainer_state.json").read_text())
    assert state["data"]["batch_in_epoch"] + state["data"]["epoch"] > 0
    state["data"]["batch_in_epoch"] += 2  # two batches past step 6: a step beyond what was saved
    (ck / "trainer_state.json").write_text(json.dumps(state))
    assert _train("--steps", "8", "--out", str(out), "--resume", text_file=text_file) == 2
    assert "does not match step 6" in capsys.readouterr().err


def test_resume_with_other_data_settings_fails_before_launch(finished_run, tmp_path, text_file, capsys):
    out = _copy_run(finished_run, tmp_path)
    rc = main(["train", "--tp", "1", "--model", "tiny", "--data", text_file, "--seq-len", "8", "--batch-size", "2",
               "--eval-batches", "1", "--warmup-steps", "1", "--no-progress", "--steps", "8", "--out", str(out),
               "--resume"])
    assert rc == 2 and "seq_len: saved 16, now 8" in capsys.readouterr().err


def test_resume_with_another_model_fails_before_launch(finished_run, tmp_path, text_file, capsys):
    out = _copy_run(finished_run, tmp_path)
    rc = main(["train", "--tp", "1", "--model", "small", "--data", text_file, "--seq-len", "16", "--batch-size", "2",
               "--eval-batches", "1", "--warmup-steps", "1", "--no-progress", "--steps", "8", "--out", str(out),
               "--resume"])
    err = capsys.readouterr().err
    assert rc == 2 and "is of another model than --model" in err and len(err.strip().splitlines()) == 1, err
