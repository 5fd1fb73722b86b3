"""Checkpoint robustness in one process: kill -9 during a save, a write that fails for lack of space,
another model's checkpoint, no unpickling, pruning."""
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tensorpar.parallel import ParallelContext
from tensorpar.train.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, read_full, read_state
from tests._train_jobs import BASE, make_trainer

REPO = Path(__file__).resolve().parents[2]


def _check_whole(ckpt: Path) -> int:
    """Load a checkpoint written by tests/_ckpt_writer.py and check every element; return its step."""
    step = read_state(ckpt)["filled_with"]
    w = read_full(ckpt / "model")["weight"]
    assert torch.all(w == step), f"{ckpt}: weight not uniformly {step}"
    return step


def _writer(*args):
    return subprocess.Popen([sys.executable, "-m", "tests._ckpt_writer", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_kill_9_during_save_leaves_previous_loadable(tmp_path):
    root = tmp_path / "ckpt"
    proc = _writer("loop", str(root))
    try:
        assert proc.stdout.readline().strip() == "SAVED", proc.stderr.read()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:   # wait until a save is half-written, then kill
            if any(list((d / "model").glob("*.safetensors")) for d in root.glob(".tmp-*")):
                proc.kill()
                break
            time.sleep(0.001)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -9, "the writer was not killed mid-save"
    assert list(root.glob(".tmp-*")), "expected the half-written folder to be left behind"
    ckpt = latest_checkpoint(root)
    step = _check_whole(ckpt)
    assert ckpt.name == f"step_{step:06d}"
    for c in list_checkpoints(root):
        _check_whole(c)


def test_failed_write_leaves_previous_intact(tmp_path):
    root = tmp_path / "ckpt"
    proc = _writer("limit", str(root), "4")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, out + err
    assert "CHECKPOINT_ERROR" in out and "step_000001 is intact" in out, out
    assert not list(root.glob(".tmp-*")), "the partial folder must be removed"
    assert latest_checkpoint(root).name == "step_000001"
    assert _check_whole(latest_checkpoint(root)) == 1


def test_resume_from_another_model_shape_names_the_tensor(tmp_path):
    ctx = ParallelContext.single()
    cfg = BASE.replace(steps=1)
    tr = make_trainer(ctx, cfg)
    tr.train_step()
    tr.save(tmp_path)
    wider = make_trainer(ctx, cfg, model_kw=dict(hidden_size=36))
    with pytest.raises(ValueError, match=r"tensor 'model.embed_tokens.weight' has shape \(67, 24\) in the "
                                         r"checkpoint but the model expects \(67, 36\)"):
        wider.resume(tmp_path)
    deeper = make_trainer(ctx, cfg, model_kw=dict(num_hidden_layers=3))
    with pytest.raises(ValueError, match=r"tensors missing from it \['model.layers.2"):
        deeper.resume(tmp_path)


def test_loading_never_unpickles(tmp_path, monkeypatch):
    ctx = ParallelContext.single()
    tr = make_trainer(ctx, BASE.replace(steps=2))
    tr.train_step()
    ckpt = tr.save(tmp_path)
    files = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file())
    assert files == ["config.json", "model/shard-00001-00001.safetensors", "optimizer/shard-00001-00001.safetensors",
                     "trainer_state.json"]

    def refuse(*a, **k):
        raise AssertionError("checkpoint loading unpickled something")
    for mod, name in ((pickle, "load"), (pickle, "loads"), (torch, "load")):
        monkeypatch.setattr(mod, name, refuse)
    fresh = make_trainer(ctx, BASE.replace(steps=2))
    fresh.resume(tmp_path)
    for (n, p), (_, q) in zip(tr.named_params, fresh.named_params):
        assert torch.equal(p, q), n
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(tr.optimizer.state[p][k], fresh.optimizer.state[q][k]), (n, k)
    assert fresh.step == 1 and fresh.batches.state_dict() == tr.batches.state_dict()


def test_keeps_the_newest_checkpoints(tmp_path):
    ctx = ParallelContext.single()
    tr = make_trainer(ctx, BASE.replace(steps=4, keep_checkpoints=2))
    for _ in range(4):
        tr.train_step()
        tr.save(tmp_path)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000003", "step_000004"]
    assert latest_checkpoint(tmp_path).name == "step_000004"
    state = load_checkpoint(latest_checkpoint(tmp_path), named_params=tr.named_params, optimizer=None, tp=ctx.tp)
    assert state["step"] == 4 and state["optimizer_step"] == 4 and state["tp_size_at_save"] == 1
    # a run resumed from an older step saves below the newest one: the new checkpoint is never pruned
    tr.step = 2
    tr.save(tmp_path)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000002", "step_000004"]
    assert latest_checkpoint(tmp_path).name == "step_000002"


def test_damaged_latest_is_refused_not_skipped(tmp_path):
    """``latest`` names a published checkpoint that lost its trainer_state.json: resuming from the older one would
    repeat steps without a word, so it is refused naming both; a ``latest`` naming a folder that is gone falls
    back to the newest complete checkpoint (nothing of it is left to resume from)."""
    import json

    from tensorpar.train.checkpoint import CheckpointError
    root = tmp_path / "checkpoints"
    for step in (3, 5):
        (root / f"step_{step:06d}").mkdir(parents=True)
        (root / f"step_{step:06d}" / "trainer_state.json").write_text("{}")
    (root / "latest").write_text(json.dumps({"checkpoint": "step_000005"}))
    assert latest_checkpoint(root) == root / "step_000005"
    (root / "step_000005" / "trainer_state.json").unlink()
    with pytest.raises(CheckpointError, match=r"step_000005.*damaged.*--resume .*step_000003"):
        latest_checkpoint(root)
    with pytest.raises(CheckpointError, match=r"step_000005 has no trainer_state.json"):
        latest_checkpoint(root / "step_000005")
    (root / "step_000005").rmdir()
    assert latest_checkpoint(root) == root / "step_000003"
