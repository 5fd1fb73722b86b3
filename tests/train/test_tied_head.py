"""A folder whose config says ``tie_word_embeddings`` but which stores an ``lm_head.weight`` different from the
embedding: transformers 5.24's ``from_pretrained`` keeps the two apart (it ties only when the stored values are
equal, and warns), and so does tensorpar, at every tp and at pp = 2 (where a tie spans the first and the last
stage). A stored head equal to the embedding stays tied.

Right values: transformers' ``from_pretrained`` on the same folder, unsharded. Tolerance: that of
``tensorpar.testing.assert_parity`` (fp32; only the order of the cross-rank sums differs)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from tensorpar import comm
from tensorpar.parallel import ParallelConfig
from tensorpar.testing import WorkerPool, assert_parity
from tests._ranks import run_tp
from tests.families import config as family_config


def saved_folder(path, same_head: bool):
    """The tiny llama of tests/families.py (tied) saved by transformers, then given a stored ``lm_head.weight``:
    a copy of the embedding (``same_head``) or different values."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(family_config("llama")).save_pretrained(path)
    f = path / "model.safetensors"
    sd = load_file(f)
    emb = sd["model.embed_tokens.weight"]
    sd["lm_head.weight"] = emb.clone() if same_head else torch.randn_like(emb)
    save_file(sd, f, metadata={"format": "pt"})
    return path


def reference_logits(folder, ids):
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return ref(ids).logits, ref.lm_head.weight is ref.model.embed_tokens.weight


IDS = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(1))


def job_logits(ctx, folder):
    from tensorpar.hf.load import build_parallel_model
    model, plan = build_parallel_model(folder, ctx.tp)
    with torch.no_grad():
        logits = comm.all_gather(model(IDS).logits, ctx.tp, -1, plan.vocab)
    return logits, model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_stored_head_that_differs_is_not_tied(pools, tmp_path, tp):
    folder = saved_folder(tmp_path, same_head=False)
    want, ref_tied = reference_logits(folder, IDS)
    assert not ref_tied   # transformers' rule: both stored, different values -> kept apart
    for logits, tied in run_tp(pools, tp, job_logits, str(folder)):
        assert not tied
        assert_parity("logits", logits, want)


def test_stored_head_equal_to_the_embedding_stays_tied(pools, tmp_path):
    folder = saved_folder(tmp_path, same_head=True)
    want, ref_tied = reference_logits(folder, IDS)
    assert ref_tied
    for logits, tied in run_tp(pools, 2, job_logits, str(folder)):
        assert tied
        assert_parity("logits", logits, want)


def job_pp(ctx, folder):
    """One pp=2 training step's loss and grad norm on the trainer's first batch (before the optimiser step)."""
    from tensorpar.pipeline.trainer import ParallelTrainer
    from tensorpar.train.model import ModelSource, build_model
    from tests._train_jobs import BASE, synthetic_data
    from transformers import AutoConfig
    cfg = replace(BASE, pp=2, micro_batches=2, steps=1, model=str(folder))
    data = synthetic_data(vocab=37)
    config = AutoConfig.from_pretrained(folder)
    model, plan = build_model(cfg, ModelSource(config, folder, folder), ctx.tp, data.vocab_size)
    tr = ParallelTrainer(cfg, ctx, model, plan, data)
    ids, labels = tr._local_batch()
    loss = tr.forward_backward(ids, labels)
    tr.complete_grads()
    return ids, labels, float(loss), float(tr.global_grad_norm()), plan.tie_word_embeddings


@pytest.mark.slow  # its own pp=2 pool: ~35 s on the loaded 2-core machine
def test_stored_head_that_differs_at_pp2(tmp_path):
    """At pp = 2 the LM head lives on the last stage: it must be the stored head, not a copy of the embedding."""
    from transformers import AutoModelForCausalLM
    folder = saved_folder(tmp_path, same_head=False)
    pool = WorkerPool(2, ParallelConfig(pp=2), collective_timeout_s=60.0)
    try:
        res = pool.run(job_pp, str(folder))
    finally:
        pool.close()
    ids, labels, loss, norm, tied = res[-1]   # the last stage computes the loss
    assert not tied
    ref = AutoModelForCausalLM.from_pretrained(folder)
    want = F.cross_entropy(ref(ids).logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    want.backward()
    want_norm = torch.cat([p.grad.flatten() for p in ref.parameters()]).norm()
    assert_parity("loss", torch.tensor(loss), want.detach())
    assert_parity("grad norm", torch.tensor(norm), want_norm)
