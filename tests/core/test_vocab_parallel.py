"""Functions of vocabulary-sharded logits against plain PyTorch on the gathered logits, at tp = 1..4 with a
vocabulary that tp does not divide (37): cross-entropy misuse is refused, an all-ignored batch gives torch's
value and zero gradients, and log-softmax / logsumexp / per-token log-probs / top-k log-probs equal torch
(values and gradients), float64 staying float64.

Tolerance: "close" (fp32 1e-5, fp64 1e-10 relative): the log-sum-exp is summed across ranks in another order
than torch's single reduction."""
import math

import pytest
import torch
import torch.nn.functional as F

from tensorpar import comm
from tensorpar.layers import (vocab_parallel_cross_entropy, vocab_parallel_log_softmax, vocab_parallel_logprobs,
                              vocab_parallel_logsumexp, vocab_parallel_topk_logprobs)
from tensorpar.shard import Partition
from tensorpar.testing import assert_parity
from tests._ranks import run_tp

V = 37


def job_ce_misuse(ctx):
    tp = ctx.tp
    part = tp.partition(V, what="vocab_size")
    torch.manual_seed(0)
    full = torch.randn(3, V)
    target = torch.randint(0, V, (3,))
    local = comm.split(full, tp, -1, part)
    ref = F.cross_entropy(full, target)
    out = {}
    # the partition may be given as the vocab size, the Partition, or a layer/plan carrying it: same loss
    for spec in (V, part):
        assert_parity(f"loss ({type(spec).__name__})", vocab_parallel_cross_entropy(local, target, tp,
                                                                                      partition=spec), ref)
    # no partition at all is a TypeError (it is a required argument)
    try:
        vocab_parallel_cross_entropy(local, target, tp)
        out["missing"] = None
    except TypeError as e:
        out["missing"] = str(e)
    # gathered logits: refused at tp > 1 (they would give loss + ln(tp)); fine at tp = 1
    try:
        loss = vocab_parallel_cross_entropy(full, target, tp, partition=part)
        out["gathered"] = float(loss - ref)
    except ValueError as e:
        out["gathered"] = str(e)
    # a width that matches nothing
    try:
        vocab_parallel_cross_entropy(full[:, :5], target, tp, partition=part)
        out["bad"] = None
    except ValueError as e:
        out["bad"] = str(e)
    return out


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_cross_entropy_refuses_misuse(pools, tp):
    out = run_tp(pools, tp, job_ce_misuse)
    for r, o in enumerate(out):
        assert "partition" in o["missing"]
        if tp == 1:
            assert o["gathered"] == pytest.approx(0.0, abs=1e-6)
        else:
            assert f"full vocabulary ({V} entries) on tp rank {r}" in o["gathered"]
        assert "have 5 vocabulary entries" in o["bad"] and str(Partition.make(V, tp).sizes[r]) in o["bad"]


def job_all_ignored(ctx, reduction, label_smoothing):
    tp = ctx.tp
    part = tp.partition(V, what="vocab_size")
    torch.manual_seed(1)
    full = torch.randn(2, 4, V, requires_grad=True)
    target = torch.full((2, 4), -100)
    ref = F.cross_entropy(full.view(-1, V), target.view(-1), reduction=reduction, label_smoothing=label_smoothing)
    ref.sum().backward()
    local = comm.split(full.detach(), tp, -1, part).requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, tp, partition=part, reduction=reduction,
                                        label_smoothing=label_smoothing)
    loss.sum().backward()
    return loss.detach().reshape(-1).tolist(), ref.detach().reshape(-1).tolist(), bool(local.grad.isfinite().all()), \
        float(local.grad.abs().max()), float(full.grad.abs().max())


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
@pytest.mark.parametrize("reduction,label_smoothing", [("mean", 0.0), ("mean", 0.1), ("sum", 0.0), ("none", 0.1)])
def test_all_ignored_batch_gives_zero_grads(pools, tp, reduction, label_smoothing):
    loss, ref, finite, gmax, ref_gmax = run_tp(pools, tp, job_all_ignored, reduction, label_smoothing)[0]
    assert ref_gmax == 0.0 and finite and gmax == 0.0                 # torch: zero gradients; so are ours
    for a, b in zip(loss, ref):                                       # torch's value: nan for mean, 0 otherwise
        assert (math.isnan(a) and math.isnan(b)) or a == b


def job_log_softmax(ctx, dtype):
    tp = ctx.tp
    part = tp.partition(V, what="vocab_size")
    torch.manual_seed(2)
    full = (torch.randn(3, 5, V, dtype=dtype) * 4).requires_grad_()
    target = torch.randint(0, V, (3, 5))
    target[0, 1] = -100
    g_ls = torch.randn(3, 5, V, dtype=dtype)
    g_tok = torch.randn(3, 5, dtype=dtype)
    # reference: torch on the whole vocabulary
    ls_ref = F.log_softmax(full, -1)
    lse_ref = torch.logsumexp(full, -1)
    tok_ref = ls_ref.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (target != -100)
    ((ls_ref * g_ls).sum() + (lse_ref ** 2).sum() + (tok_ref * g_tok).sum()).backward()
    local = comm.split(full.detach(), tp, -1, part).requires_grad_()
    ls = vocab_parallel_log_softmax(local, tp, partition=part)
    lse = vocab_parallel_logsumexp(local, tp, partition=part)
    tok = vocab_parallel_logprobs(local, target, tp, partition=part)
    ((ls * comm.split(g_ls, tp, -1, part)).sum() + (lse ** 2).sum() + (tok * g_tok).sum()).backward()
    assert ls.dtype == dtype and lse.dtype == dtype and tok.dtype == dtype and local.grad.dtype == dtype
    d = [assert_parity("log_softmax", comm.all_gather(ls.detach(), tp, -1, part), ls_ref),
         assert_parity("logsumexp", lse, lse_ref), assert_parity("token logprobs", tok, tok_ref),
         assert_parity("logit grad", local.grad, comm.split(full.grad, tp, -1, part))]
    vals, ids = vocab_parallel_topk_logprobs(local.detach(), 5, tp, partition=part)
    rv, ri = ls_ref.detach().topk(5, dim=-1)
    assert torch.equal(ids, ri), (ids, ri)
    d.append(assert_parity("top-k logprobs", vals, rv))
    return max(x.max_abs for x in d)


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_log_softmax_family_equals_torch(pools, tp, dtype):
    run_tp(pools, tp, job_log_softmax, dtype)


def test_topk_rejects_bad_k():
    from tensorpar.comm import Group
    with pytest.raises(ValueError, match=r"k must be in \[1, 37\]"):
        vocab_parallel_topk_logprobs(torch.randn(2, V), 40, Group.single(), partition=V)


@pytest.mark.parametrize("bad", [V, 150, -5])
def test_out_of_range_targets_are_refused(bad):
    from tensorpar.comm import Group
    logits = torch.randn(3, V)
    target = torch.tensor([1, bad, 2])
    with pytest.raises(ValueError, match=rf"target id {bad} is outside the vocabulary \[0, {V}\)"):
        vocab_parallel_cross_entropy(logits, target, Group.single(), partition=V)
    with pytest.raises(ValueError, match=rf"target id {bad} is outside"):
        vocab_parallel_logprobs(logits, target, Group.single(), partition=V)
    with pytest.raises(IndexError):                       # torch refuses them too
        F.cross_entropy(logits, target)
