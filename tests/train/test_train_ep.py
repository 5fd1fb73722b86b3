"""`tensorpar train --ep E`: expert parallelism in the trainer (issue 22, item 3).

The ep ranks are the dp replicas (Megatron-Core / DeepSpeed-MoE): each takes its rows of the batch, the experts are
split whole over them (:func:`tensorpar.hf.modules.expert_parallelize`), the non-expert gradients are averaged over
dp, the experts keep their own. Setup: the tiny random Mixtral of ``tests/families_moe.py`` (4 experts, top-2), a
byte vocabulary, fp32, AdamW with clipping at the global grad norm (so the ep-aware norm matters), 3 steps.

Tolerance 1e-5 (relative, losses and grad norms): the ranks sum the same terms in another order (the all-to-all
moves rows, the dp average adds per-replica means), so fp32 rounding differs at ~1e-7 per step.
"""
import json

import pytest
import torch

from tensorpar.parallel import ParallelConfig, ParallelContext
from tensorpar.testing import WorkerPool
from tensorpar.train.config import TrainConfig
from tests.families_moe import config as moe_config
from tests.train.test_train_3d_cli import run_main


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep")
    lines = [f"{w} {i % 7} the quick brown fox jumps over the lazy dog {i % 3}." for i, w in
             enumerate(["Alas", "Hark", "Prithee", "Forsooth"] * 100)]
    (root / "corpus.txt").write_text("\n".join(lines))
    c = moe_config("mixtral").to_dict()
    c["vocab_size"] = 256                  # the byte tokenizer's ids
    (root / "mixtral.json").write_text(json.dumps(c))
    llama = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 64}
    (root / "llama.json").write_text(json.dumps(llama))
    return root


def _cfg(files, out, **kw):
    return TrainConfig(model=str(files / "mixtral.json"), data=str(files / "corpus.txt"), tokenizer="bytes",
                       seq_len=16, batch_size=4, steps=3, warmup_steps=1, lr=1e-2, eval_every=0, eval_batches=1,
                       out_dir=str(out), **kw)


def job_train(ctx, cfgs, resume_at=None):
    """Train each config; with ``resume_at``, the first one again from its checkpoint at that step (same --out:
    its metrics are cut there) to the end. Returns per run ``([(loss, grad norm) per step], checkpoint, val)``."""
    from tensorpar.train.cli import run
    from tensorpar.train.metrics import read_metrics

    def train(cfg, resume=None):
        s = run(cfg, ctx, progress=False, resume=resume)
        recs = read_metrics(f"{cfg.out_dir}/metrics.jsonl") if ctx.rank == 0 else []
        return [(r["loss"], r["grad_norm"]) for r in recs if r["kind"] == "train"], s["checkpoint"], s["val_loss"]
    out = [train(cfg) for cfg in cfgs]
    if resume_at is not None:
        out.append(train(cfgs[0], f"{cfgs[0].out_dir}/checkpoints/step_{resume_at:06d}"))
    return out


def _checkpoint_params(files, ckpt):
    """The checkpoint's model tensors read into an unsharded model (any layout: pieces of every rank)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tensorpar.train.checkpoint import load_checkpoint
    d = json.loads((files / "mixtral.json").read_text())
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(d.pop("model_type"), **d))
    named = list(model.named_parameters())
    load_checkpoint(ckpt, named_params=named, optimizer=None, tp=ParallelContext.single().tp)
    return {n: p.detach().clone() for n, p in named}


def test_train_ep2_equals_dp2_and_one_process(files, tmp_path):
    """``--ep 2 --dp 2``: per-step losses and grad norms within 1e-5 of ``--dp 2`` and of one process over 3 steps;
    its checkpoint (each rank wrote its own experts) holds the weights of the ``--dp 2`` run; resumed at ep 2 from
    its step-2 checkpoint (each rank reads its own experts and their AdamW moments), step 3 is the same bits."""
    single = job_train(ParallelContext.single(), [_cfg(files, tmp_path / "one")])[0]
    with WorkerPool(2, ParallelConfig(dp=2), collective_timeout_s=60.0) as pool:
        out = pool.run(job_train, [_cfg(files, tmp_path / "ep2", dp=2, ep=2, save_every=2),
                                   _cfg(files, tmp_path / "dp2", dp=2)], 2)
    (ep2, ep_ckpt, ep_val), (dp2, dp_ckpt, dp_val), (resumed, _, _) = out[0]
    assert resumed == ep2, (resumed, ep2)      # same operations in the same order after the resume
    assert len(ep2) == len(dp2) == len(single[0]) == 3
    for got, want in ((ep2, dp2), (ep2, single[0])):
        for (loss, norm), (loss_w, norm_w) in zip(got, want):
            assert abs(loss - loss_w) <= 1e-5 * abs(loss_w), (got, want)
            assert abs(norm - norm_w) <= 1e-5 * abs(norm_w), (got, want)
    assert abs(ep_val - dp_val) <= 1e-5 * abs(dp_val), (ep_val, dp_val)
    # the weights after 3 steps: Adam's update divides by sqrt(v), so a gradient's rounding moves a weight by up to
    # ~lr x 1e-3 here; 1e-4 absolute is far below one step (lr = 1e-2), and a lost expert would differ by ~0.02
    ep_w, dp_w = _checkpoint_params(files, ep_ckpt), _checkpoint_params(files, dp_ckpt)
    worst = max((ep_w[n] - dp_w[n]).abs().max().item() for n in dp_w)
    assert worst <= 1e-4, worst


@pytest.mark.slow
def test_train_tp2_ep2_equals_tp2_dp2(files, tmp_path):
    """tp 2 x ep 2 (each expert split over tp, experts whole over dp; 4 ranks): the same losses and grad norms as
    tp 2 x dp 2 within 1e-5, and the same weights in the checkpoint (tp rows and ep experts both placed)."""
    with WorkerPool(4, ParallelConfig(tp=2, dp=2), collective_timeout_s=60.0) as pool:
        out = pool.run(job_train, [_cfg(files, tmp_path / "ep2", tp=2, dp=2, ep=2),
                                   _cfg(files, tmp_path / "dp2", tp=2, dp=2)])
    (ep2, ep_ckpt, _), (dp2, dp_ckpt, _) = out[0]
    assert len(ep2) == len(dp2) == 3
    for (loss, norm), (loss_w, norm_w) in zip(ep2, dp2):
        assert abs(loss - loss_w) <= 1e-5 * abs(loss_w), (ep2, dp2)
        assert abs(norm - norm_w) <= 1e-5 * abs(norm_w), (ep2, dp2)
    ep_w, dp_w = _checkpoint_params(files, ep_ckpt), _checkpoint_params(files, dp_ckpt)
    worst = max((ep_w[n] - dp_w[n]).abs().max().item() for n in dp_w)
    assert worst <= 1e-4, worst      # as in the test above


@pytest.mark.parametrize("argv,msg", [
    (["--dp", "3", "--ep", "2"], "--ep 2: does not divide dp=3 (the expert-parallel ranks are data-parallel ranks); "
                                 "use ep=3 or ep=1"),
    (["--dp", "4", "--ep", "2"], "--ep 2: with dp=4 (ep < dp) is not implemented; use ep=4"),
    (["--dp", "2", "--ep", "2", "--pp", "2"], "--ep 2: does not run with pipeline stages (pp=2); use pp=1 or ep=1"),
    (["--dp", "2", "--ep", "2", "--dp-mode", "fsdp"], "--ep 2: does not run with dp_mode='fsdp'"),
    (["--dp", "3", "--ep", "3"], "ep=3: does not divide the model's 4 experts; use ep in [1, 2, 4]"),
    (["--dp", "2", "--ep", "2", "--model", "llama.json"],
     "ep=2: model_type='llama' has no mixture-of-experts layers; expert parallelism needs one of"),
    (["--plan", "auto", "--nproc", "2", "--ep", "2"], "--plan auto and --ep 2: the planner does not plan expert "
                                                      "parallelism"),
])
def test_bad_ep_fails_before_launch(files, tmp_path, capsys, argv, msg):
    if "--model" not in argv:
        argv = argv + ["--model", "mixtral.json"]
    argv = [str(files / a) if a.endswith(".json") else a for a in argv]
    rc = run_main(argv + ["--data", str(files / "corpus.txt"), "--tokenizer", "bytes", "--seq-len", "16",
                          "--batch-size", "12", "--out", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and msg in err[0], err
