"""DCP checkpoints: every rank writes its own pieces (no gather), a checkpoint saved at one (tp, pp, dp) resumes at
any other with the next-step losses of the uninterrupted run, a save killed between the shard writes and
``latest`` leaves the previous checkpoint in charge, another model's checkpoint is refused naming the tensor and
both shapes, nothing is unpickled, and the previous full-shape format still loads.

Model: the small Llama of tests/train/test_3d.py (5 query heads, 1 KV head: head-aligned splits 3+2 heads at tp2 and
2+2+1 at tp3, the KV head duplicated on every rank), tied embedding (first and last stage), vocab 67.
Reference: the single-process run. Tolerance 1e-5 relative (test_3d's parity policy)."""
from __future__ import annotations

import pickle
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tensorpar.parallel import ParallelConfig, ParallelContext
from tensorpar.testing import WorkerPool
from tests._train_jobs import BASE, synthetic_data, tiny_config

MODEL = dict(num_hidden_layers=4, num_attention_heads=5, num_key_value_heads=1, hidden_size=40, head_dim=8)
STEPS = 4
SAVE_AT = 2
TP2_PP2 = (ParallelConfig(tp=2, pp=2), dict(micro_batches=2, schedule="1f1b"))
TP2_DP2 = (ParallelConfig(tp=2, dp=2), dict(micro_batches=2))


class Killed(BaseException):
    """Stands for the process dying (not an Exception: nothing in the save catches it)."""


def _trainer(ctx, kw, model_kw=None):
    from tensorpar.train.loop import Trainer
    from tensorpar.train.model import ModelSource, build_model
    c = ctx.config
    cfg = replace(BASE, tp=c.tp, pp=c.pp, dp=c.dp, steps=STEPS, **kw)
    data = synthetic_data()
    model, plan = build_model(cfg, ModelSource(tiny_config(**dict(MODEL, **(model_kw or {}))), None, None), ctx.tp,
                              data.vocab_size)
    return Trainer(cfg, ctx, model, plan, data)


def _count_gathers():
    """Record every gather-type collective (name, dtype, numel) and every tensorpar all-gather; returns
    (log, undo)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from tensorpar import comm
    log, undo = [], []

    def wrap(mod, name, label):
        f = getattr(mod, name)

        def counted(*a, **k):
            ts = [x for x in list(a) + list(k.values()) if isinstance(x, torch.Tensor)]
            ts += [y for x in list(a) + list(k.values()) if isinstance(x, (list, tuple)) for y in x
                   if isinstance(y, torch.Tensor)]
            log.append((label, [(t.dtype, t.numel()) for t in ts]))
            return f(*a, **k)
        setattr(mod, name, counted)
        undo.append((mod, name, f))
    for mod in (c10d, dist):
        for name in ("all_gather", "all_gather_into_tensor", "gather"):
            wrap(mod, name, f"torch.distributed.{name}")
    wrap(comm, "all_gather", "tensorpar.comm.all_gather")

    def restore():
        for mod, name, f in undo:
            setattr(mod, name, f)
    return log, restore


def job_save(ctx, kw, root):
    """Train SAVE_AT steps and save (gathers recorded); then one more step and a save 'killed' after every rank
    wrote its shards but before ``latest``. Returns what the checks need."""
    from tensorpar.train import checkpoint as ck
    from tensorpar.train.checkpoint import save as ck_save   # where save_pieces looks up _agree
    tr = _trainer(ctx, kw)
    losses = [tr.train_step().loss for _ in range(SAVE_AT)]
    log, restore = _count_gathers()
    try:
        saved = tr.save(root)
    finally:
        restore()
    tr.train_step()
    agree, calls = ck_save._agree, []

    def dies_after_shards(ok, pg, device):   # the 2nd agreement: every rank has written its shards
        calls.append(1)
        out = agree(ok, pg, device)
        if len(calls) == 2:
            raise Killed()
        return out
    ck_save._agree = dies_after_shards
    killed = False
    try:
        tr.save(root)
    except Killed:
        killed = True
    finally:
        ck_save._agree = agree
    tmp = Path(root) / f"{ck.TMP_PREFIX}{SAVE_AT + 1:06d}"
    return {"losses": losses, "saved": saved.name, "log": log, "killed": killed,
            "latest": ck.latest_checkpoint(root).name, "listed": [p.name for p in ck.list_checkpoints(root)],
            "partial_shards": sorted(p.name for p in tmp.rglob("*.safetensors")) if tmp.is_dir() else None,
            "files": sorted(p.relative_to(saved).as_posix() for p in saved.rglob("*") if p.is_file())}


def job_resume(ctx, kw, root):
    """Resume from ``root`` and train to STEPS; the losses of the remaining steps."""
    tr = _trainer(ctx, kw)
    tr.resume(root)
    assert tr.step == SAVE_AT
    return [tr.train_step().loss for _ in range(STEPS - tr.step)]


@pytest.fixture(scope="module")
def reference():
    tr = _trainer(ParallelContext.single(), {})
    return [tr.train_step().loss for _ in range(STEPS)]


def _check_save(res, config):
    for r, out in enumerate(res):
        # no rank gathers state: tensorpar's all-gather is never called, and torch's gathers move only DCP's
        # pickled plans (uint8) and their sizes (int64), never a floating-point tensor
        assert not [n for n, _ in out["log"] if n.startswith("tensorpar")], f"rank {r}: {out['log']}"
        moved = [(n, d, k) for n, ts in out["log"] for d, k in ts]
        assert moved and not [m for m in moved if m[1].is_floating_point], f"rank {r}: {moved}"
        assert out["saved"] == f"step_{SAVE_AT:06d}"
        assert out["killed"], f"rank {r}: the simulated kill did not happen"
        assert out["latest"] == out["saved"] and out["listed"] == [out["saved"]], (r, out)
    rank0 = res[0]
    assert rank0["partial_shards"], "the killed save should leave its shard files in the temporary folder"
    writers = {f.split("/")[1].split("-")[1] for f in rank0["files"] if f.startswith("model/")}
    # only dp replica 0 writes: (tp2, dp2) -> global ranks 0, 1 (files shard-00001, -00002); (tp2, pp2) -> all 4
    assert len(writers) == (2 if config.dp == 2 else 4), rank0["files"]
    assert not [f for f in rank0["files"] if f.endswith(".metadata") or f.endswith(".pkl")], rank0["files"]


@pytest.mark.slow  # ~80 s on the 2-core machine: three pools (4, 4 and 3 ranks)
def test_dcp_save_and_resume_at_other_layouts(reference, tmp_path):
    from tensorpar.train.checkpoint import read_state
    root_pp, root_dp = str(tmp_path / "tp2pp2"), str(tmp_path / "tp2dp2")
    tail = pytest.approx(reference[SAVE_AT:], rel=1e-5)
    pool_pp = WorkerPool(4, TP2_PP2[0], collective_timeout_s=60.0)
    pool_dp = WorkerPool(4, TP2_DP2[0], collective_timeout_s=60.0)
    pool_tp3 = WorkerPool(3, ParallelConfig(tp=3), collective_timeout_s=60.0)
    try:
        res = pool_pp.run(job_save, TP2_PP2[1], root_pp)
        _check_save(res, TP2_PP2[0])
        assert res[0]["losses"] == pytest.approx(reference[:SAVE_AT], rel=1e-5)
        res = pool_dp.run(job_save, TP2_DP2[1], root_dp)
        _check_save(res, TP2_DP2[0])
        # across the two grids: (tp2, pp2) -> (tp2, dp2) and back
        for r, got in enumerate(pool_dp.run(job_resume, TP2_DP2[1], root_pp)):
            assert got == tail, f"tp2-pp2 checkpoint at tp2-dp2, rank {r}"
        for r, got in enumerate(pool_pp.run(job_resume, TP2_PP2[1], root_dp)):
            assert got == tail, f"tp2-dp2 checkpoint at tp2-pp2, rank {r}"
        # tp3 (tp only): 5 heads as 2 + 2 + 1, vocab 67 as 23 + 22 + 22
        for root in (root_pp, root_dp):
            for r, got in enumerate(pool_tp3.run(job_resume, {}, root)):
                assert got == tail, f"{root} at tp3, rank {r}"
    finally:
        for p in (pool_pp, pool_dp, pool_tp3):
            p.close()
    # tp = 1 on one process, nothing unpickled
    for root in (root_pp, root_dp):
        assert job_resume(ParallelContext.single(), {}, root) == tail, root
    # --export from the 4-rank checkpoint: the full tensors equal what a tp = 1 resume reads (tied LM head too)
    from transformers import AutoModelForCausalLM

    from tensorpar.train.export import export_hf
    one = _trainer(ParallelContext.single(), {})
    one.resume(root_pp)
    hf = AutoModelForCausalLM.from_pretrained(export_hf(root_pp, tmp_path / "hf")).state_dict()
    for n, p in one.named_params:
        assert torch.equal(hf[n], p.detach()), n
    assert torch.equal(hf["lm_head.weight"], hf["model.embed_tokens.weight"])
    # a missing shard file (tp rank 1's pieces of the (tp2, dp2) checkpoint) is refused, never read as zeros
    (Path(root_dp) / f"step_{SAVE_AT:06d}" / "model" / "shard-00002-00001.safetensors").unlink()
    with pytest.raises(ValueError, match=r"tensor 'model.embed_tokens.weight' is incomplete: its stored pieces hold "
                                         r"1360 of the 2680 elements"):
        job_resume(ParallelContext.single(), {}, root_dp)
    st = read_state(Path(root_pp) / f"step_{SAVE_AT:06d}")
    assert (st["tp_size_at_save"], st["pp_size_at_save"], st["dp_size_at_save"]) == (2, 2, 1)
    assert st["tensors"]["model.layers.0.self_attn.q_proj.weight"] == [40, 40]
    assert "lm_head.weight" not in st["tensors"]          # tied: stored once, as the embedding


def test_loading_never_unpickles_and_exports(reference, tmp_path, monkeypatch):
    from tensorpar.train.export import export_hf
    tr = _trainer(ParallelContext.single(), {})
    for _ in range(SAVE_AT):
        tr.train_step()
    ckpt = tr.save(tmp_path / "ck")

    def refuse(*a, **k):
        raise AssertionError("checkpoint loading unpickled something")
    for mod, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(mod, name, refuse)
    assert job_resume(ParallelContext.single(), {}, str(tmp_path / "ck")) == pytest.approx(reference[SAVE_AT:],
                                                                                            rel=1e-5)
    out = export_hf(ckpt, tmp_path / "hf")
    monkeypatch.undo()
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(out)
    for n, p in tr.named_params:
        assert torch.equal(hf.state_dict()[n], p.detach()), n


def test_other_model_shape_is_refused_naming_the_tensor(tmp_path):
    tr = _trainer(ParallelContext.single(), {})
    tr.train_step()
    tr.save(tmp_path)
    wider = _trainer(ParallelContext.single(), {}, model_kw=dict(intermediate_size=48))
    with pytest.raises(ValueError, match=r"tensor 'model.layers.0.mlp.gate_proj.weight' has shape \(40, 40\) in "
                                         r"the checkpoint but the model expects \(48, 40\)"):
        wider.resume(tmp_path)


def test_fused_rows_round_trip(tmp_path):
    """A fused [q | k | v] selection (several runs per rank, a KV head held by two ranks): the owners' pieces of
    three tp ranks, written by one process, fill exactly every rank's held rows at another layout."""
    from tensorpar.shard import UnitSelection
    from tensorpar.train.checkpoint import Piece, pieces, read_pieces, save_pieces, stored_shapes
    # 4 q heads, 2 KV heads, head rows 2: units [q0..q3 | k0 k1 | v0 v1]; rank 0: q0 q1 + kv0, rank 1: q2 + kv0
    # kv1, rank 2: q3 + kv1
    kv = ((0,), (0, 1), (1,))
    q = ((0, 1), (2,), (3,))
    sel = UnitSelection(8, 2, tuple(tuple(q[r]) + tuple(4 + u for u in kv[r]) + tuple(6 + u for u in kv[r])
                                    for r in range(3)))
    full = torch.arange(16 * 3, dtype=torch.float32).view(16, 3)
    ps = []
    for r in range(3):
        local = full[sel.indices(r)]
        p = torch.nn.Parameter(local.clone())
        p.tp_dim, p.tp_partition = 0, sel
        ps += pieces("w", p.data, p, r, owned=True)
    assert sum(pc.tensor.shape[0] for pc in ps) == 16          # every row once
    assert len(ps) == 3 + 3 + 1                                # rank 0: q0 q1 | k0 | v0, rank 1: q2 | k1 | v1
    save_pieces(tmp_path, ps, step=1, state={}, optimizer_step=0, config_json=None, keep=2)
    folder = tmp_path / "step_000001" / "model"
    assert stored_shapes(folder) == {"w": (16, 3)}
    for r in range(3):
        p = torch.nn.Parameter(torch.zeros(len(sel.indices(r)), 3))
        p.tp_dim, p.tp_partition = 0, sel
        read_pieces(folder, pieces("w", p.data, p, r, owned=False))
        assert torch.equal(p.data, full[sel.indices(r)]), r
    whole = [Piece("w", torch.zeros(16, 3), (0, 0), (16, 3))]
    read_pieces(folder, whole)
    assert torch.equal(whole[0].tensor, full)


def test_previous_full_shape_format_still_loads(reference, tmp_path):
    """A tensorpar-train-v1 checkpoint (full-shape model.safetensors + optimizer/state.safetensors by rank 0)."""
    import json

    from safetensors.torch import save_file
    tr = _trainer(ParallelContext.single(), {})
    for _ in range(SAVE_AT):
        tr.train_step()
    ck = tmp_path / f"step_{SAVE_AT:06d}"
    (ck / "optimizer").mkdir(parents=True)
    save_file({n: p.detach().contiguous() for n, p in tr.named_params}, str(ck / "model.safetensors"),
              metadata={"format": "tensorpar-train-v1"})
    save_file({f"{k}/{n}": tr.optimizer.state[p][k] for n, p in tr.named_params for k in ("exp_avg", "exp_avg_sq")},
              str(ck / "optimizer" / "state.safetensors"), metadata={"format": "tensorpar-train-v1"})
    (ck / "trainer_state.json").write_text(json.dumps({
        "format": "tensorpar-train-v1", "step": SAVE_AT, "optimizer_step": SAVE_AT, "config": {},
        "data": tr.batches.state_dict()}))
    assert job_resume(ParallelContext.single(), {}, str(tmp_path)) == pytest.approx(reference[SAVE_AT:], rel=1e-5)
