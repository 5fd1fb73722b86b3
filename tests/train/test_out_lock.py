"""One run per ``--out`` (issue 27, item 8): a second ``tensorpar train`` into a folder another run is using is
refused in one line, before any rank starts; the lock goes with the run (also when it is killed); a run resumed
into the same folder after the first ended still works."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tensorpar.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    lines = [f"{w} {i % 7} the quick brown fox jumps over the lazy dog {i % 3}." for i, w in
             enumerate(["Alas", "Hark", "Prithee", "Forsooth"] * 100)]
    p = tmp_path_factory.mktemp("text") / "corpus.txt"
    p.write_text("\n".join(lines))
    return str(p)


def _args(text_file, out, *more):
    return ["train", "--tp", "1", "--model", "tiny", "--data", text_file, "--seq-len", "16", "--batch-size", "2",
            "--eval-batches", "1", "--warmup-steps", "1", "--no-progress", "--out", str(out), *more]


def _env():
    env = dict(os.environ, PYTHONPATH=str(REPO), TENSORPAR_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    return env


def _hold(path: Path) -> subprocess.Popen:
    """A process that holds ``flock`` on ``path`` (what a running ``tensorpar train`` holds on ``<out>/.lock``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    p = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                          f"fd = os.open({str(path)!r}, os.O_RDWR | os.O_CREAT)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
                          "os.write(fd, str(os.getpid()).encode())\nprint('held', flush=True)\ntime.sleep(120)\n"],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "held\n"
    return p


def test_run_into_a_locked_out_is_refused_then_runs_and_resumes(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    holder = _hold(out / ".lock")                 # another run, started a moment earlier, has written nothing yet
    try:
        for more in ((), ("--resume",)):          # resuming into a folder in use mixes runs just the same
            assert main(_args(text_file, out, "--steps", "2", *more)) == 2
            err = capsys.readouterr().err
            lines = err.splitlines()
            assert len(lines) == 1 and lines[0].startswith(
                f"tensorpar train: error: --out {str(out)!r} is in use by another run; wait for it to end, or choose "
                f"another --out folder (held by process {holder.pid} ("), err
            assert lines[0].endswith(f"lock {out / '.lock'})"), err
        assert sorted(p.name for p in out.iterdir()) == [".lock"]  # nothing of the refused run
    finally:
        holder.kill()                              # killed, not ended: the kernel drops its lock
        holder.wait()
    assert main(_args(text_file, out, "--steps", "2", "--save-every", "2")) == 0
    assert main(_args(text_file, out, "--steps", "3", "--save-every", "1", "--resume")) == 0  # same --out, after
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == [1, 2, 3], steps


def test_refused_before_anything_is_made(tmp_path, text_file, capsys):
    # bad input after the lock was taken: the folder the lock made is removed again
    out = tmp_path / "new"
    assert main(_args(text_file, out, "--steps", "2", "--resume")) == 2
    assert not out.exists(), list(out.iterdir())
    # and the missing parents it made (review: --out /nonexistent/x left /nonexistent behind)
    deep = tmp_path / "a" / "b" / "out"
    assert main(_args(text_file, deep, "--steps", "2", "--resume")) == 2
    assert not (tmp_path / "a").exists(), list((tmp_path / "a").rglob("*"))


@pytest.mark.slow
def test_two_trains_started_together_into_one_out(tmp_path, text_file):
    """The report's case: two ``tensorpar train`` at the same moment into the same new ``--out``; before the lock
    both passed the empty-folder check and both exited 0 with their metrics interleaved."""
    out = tmp_path / "same"
    procs = [subprocess.Popen([sys.executable, "-m", "tensorpar", *_args(text_file, out, "--steps", "3",
                                                                         "--seed", str(seed))],
                              cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for seed in (1, 2)]
    res = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    codes = sorted(rc for rc, _ in res)
    assert codes == [0, 2], res
    err = next(e for rc, e in res if rc == 2)
    assert len(err.strip().splitlines()) == 1 and "is in use by another run" in err, err
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == [1, 2, 3], steps              # one run's lines, not two interleaved


@pytest.mark.slow
def test_lock_released_when_the_run_is_killed(tmp_path, text_file):
    """The lock goes with the launching process, however it ends: after SIGKILL the folder can be resumed."""
    out = tmp_path / "killed"
    p = subprocess.Popen([sys.executable, "-m", "tensorpar", *_args(text_file, out, "--steps", "400")], cwd=REPO,
                         env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        import time
        deadline = time.monotonic() + 240
        while not (out / "metrics.jsonl").exists():   # the ranks run: the launcher holds the lock
            assert p.poll() is None and time.monotonic() < deadline, p.stderr.read() if p.poll() is not None else ""
            time.sleep(0.2)
        assert (out / ".lock").read_text().strip() == str(p.pid)
    finally:
        os.killpg(p.pid, signal.SIGKILL)            # the launcher and its ranks (their own session)
        p.wait()
    from tensorpar.launch import locked_folder
    with locked_folder(str(out)):                     # free again at once
        pass


def test_out_with_files_but_no_checkpoint_does_not_suggest_resume(tmp_path):
    """A run killed before its first checkpoint leaves metrics.jsonl (and its .lock): the fresh-run refusal used to
    suggest --resume, which then found no checkpoint (review finding). Now it says there is nothing to resume."""
    from tensorpar.train.config import check_out_dir
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / ".lock").write_text("123")
    with pytest.raises(ValueError, match=r"already holds files but no checkpoint .* nothing to resume") as e:
        check_out_dir(str(out), resume=None)
    assert "--resume" not in str(e.value)
    (out / "checkpoints" / "step_000001").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"continue it with --resume"):
        check_out_dir(str(out), resume=None)


def test_second_run_into_an_export_in_use_is_refused_then_exports(tmp_path, text_file, capsys):
    """Old code: a second run sharing --export (another --out) trained to the end and then failed with rc 1
    (review finding). Now the export folder is locked like --out: refused in one line before training; once free,
    a run exports there and leaves no .lock behind."""
    export = tmp_path / "export"
    holder = _hold(export / ".lock")            # a run exporting there, still training
    try:
        assert main(_args(text_file, tmp_path / "b", "--steps", "2", "--export", str(export))) == 2
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and f"--export {str(export)!r} is in use by another run" in lines[0], lines
        assert not (tmp_path / "b").exists()
    finally:
        holder.kill()
        holder.wait()
    (export / ".lock").unlink()
    export.rmdir()
    assert main(_args(text_file, tmp_path / "c", "--steps", "2", "--export", str(export))) == 0
    names = {p.name for p in export.iterdir()}
    assert "config.json" in names and ".lock" not in names, names
