"""Parity of each parallel layer with its single-device module at tp = 1, 2, 3 and 4.

Every rank builds the reference module from the same seed, shards a copy, runs the same input
and upstream gradient, and compares output, input gradient and every parameter gradient slice
(tolerance policy: tensorpar.testing). Each job returns its measured max differences.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tensorpar import comm
from tensorpar.grads import grad_norm
from tensorpar.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                              vocab_parallel_cross_entropy)
from tensorpar.testing import assert_parity, local_slice
from tests._ranks import run_tp

TPS = [1, 2, 3, 4]


def _maxdiff(diffs):
    return max(d.max_abs for d in diffs)


def job_column(ctx, in_f, out_f, gather_output, weights=None):
    tp = ctx.tp
    torch.manual_seed(0)
    ref = nn.Linear(in_f, out_f)
    layer = ColumnParallelLinear.from_linear(ref, tp, gather_output=gather_output,
                                             split_weights=weights if tp.size > 1 else None)
    x = torch.randn(2, 3, in_f, requires_grad=True)
    gy = torch.randn(2, 3, out_f)
    y_ref = ref(x)
    y_ref.backward(gy)
    gx_ref, x.grad = x.grad.clone(), None
    y = layer(x)
    part = layer.partition
    y.backward(gy if gather_output else comm.split(gy, tp, -1, part))
    d = [assert_parity("output", y, y_ref if gather_output else comm.split(y_ref, tp, -1, part)),
         assert_parity("input grad", x.grad, gx_ref),
         assert_parity("weight grad", layer.weight.grad, local_slice(ref.weight.grad, layer.weight, tp.rank)),
         assert_parity("bias grad", layer.bias.grad, local_slice(ref.bias.grad, layer.bias, tp.rank)),
         assert_parity("grad norm", grad_norm(layer.parameters(), tp),
                       torch.cat([p.grad.flatten() for p in ref.parameters()]).norm())]
    return _maxdiff(d), list(part.sizes)


def job_row(ctx, in_f, out_f, input_is_parallel, weights=None):
    tp = ctx.tp
    torch.manual_seed(0)
    ref = nn.Linear(in_f, out_f)
    layer = RowParallelLinear.from_linear(ref, tp, input_is_parallel=input_is_parallel,
                                          split_weights=weights if tp.size > 1 else None)
    x = torch.randn(2, 3, in_f, requires_grad=True)
    gy = torch.randn(2, 3, out_f)
    y_ref = ref(x)
    y_ref.backward(gy)
    gx_ref = x.grad.clone()
    part = layer.partition
    if input_is_parallel:
        xl = comm.split(x.detach(), tp, -1, part).requires_grad_()
        y = layer(xl)
    else:
        x.grad = None
        y = layer(x)
    y.backward(gy)
    gx = xl.grad if input_is_parallel else x.grad
    d = [assert_parity("output", y, y_ref),
         assert_parity("input grad", gx, comm.split(gx_ref, tp, -1, part) if input_is_parallel else gx_ref),
         assert_parity("weight grad", layer.weight.grad, local_slice(ref.weight.grad, layer.weight, tp.rank)),
         assert_parity("bias grad", layer.bias.grad, ref.bias.grad, kind="exact"),
         assert_parity("grad norm", grad_norm(layer.parameters(), tp),
                       torch.cat([p.grad.flatten() for p in ref.parameters()]).norm())]
    return _maxdiff(d), list(part.sizes)


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("gather_output", [False, True])
def test_column_parallel(pools, tp, gather_output):
    diff, sizes = run_tp(pools, tp, job_column, 16, 12, gather_output)[0]
    assert sum(sizes) == 12


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("input_is_parallel", [True, False])
def test_row_parallel(pools, tp, input_is_parallel):
    run_tp(pools, tp, job_row, 12, 16, input_is_parallel)


def test_uneven_hidden_7_over_2(pools):
    assert run_tp(pools, 2, job_column, 5, 7, True)[0][1] == [4, 3]
    assert run_tp(pools, 2, job_row, 7, 5, True)[0][1] == [4, 3]


def test_weighted_split_2_1(pools):
    _, sizes = run_tp(pools, 2, job_column, 6, 9, True, [2, 1])[0]
    assert sizes == [6, 3]
    _, sizes = run_tp(pools, 2, job_row, 9, 6, False, [2, 1])[0]
    assert sizes == [6, 3]


def job_embedding(ctx, vocab, dim, padding_idx):
    tp = ctx.tp
    torch.manual_seed(0)
    ref = nn.Embedding(vocab, dim, padding_idx=padding_idx)
    emb = VocabParallelEmbedding.from_embedding(ref, tp)
    ids = torch.randint(0, vocab, (3, 7))
    ids[0, 0] = vocab - 1
    gy = torch.randn(3, 7, dim)
    y_ref = ref(ids)
    y_ref.backward(gy)
    y = emb(ids)
    y.backward(gy)
    assert_parity("output", y, y_ref, kind="exact")   # one non-zero term per element: the sum is exact
    assert_parity("weight grad", emb.weight.grad, local_slice(ref.weight.grad, emb.weight, tp.rank), kind="exact")
    assert emb.weight.shape[0] == emb.partition.sizes[tp.rank]
    return list(emb.partition.sizes)


@pytest.mark.parametrize("tp", TPS)
def test_vocab_parallel_embedding_11_over_tp(pools, tp):
    sizes = run_tp(pools, tp, job_embedding, 11, 4, 2)[0]
    assert sum(sizes) == 11 and max(sizes) - min(sizes) <= 1


def job_cross_entropy(ctx, vocab, label_smoothing, ignore, reduction):
    tp = ctx.tp
    torch.manual_seed(0)
    logits = torch.randn(4, 5, vocab) * 3
    target = torch.randint(0, vocab, (4, 5))
    if ignore:
        target[0, :3] = -100
        target[2, 4] = -100
    part = tp.partition(vocab, what="vocab_size")
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full.view(-1, vocab), target.view(-1), label_smoothing=label_smoothing,
                          reduction=reduction)
    g = torch.randn_like(ref)
    ref.backward(g)
    local = comm.split(logits, tp, -1, part).requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, tp, partition=part, label_smoothing=label_smoothing,
                                        reduction=reduction)
    loss.backward(g.view_as(loss))
    d1 = assert_parity("loss", loss.reshape(-1), ref.reshape(-1))
    d2 = assert_parity("logit grad", local.grad, comm.split(full.grad, tp, -1, part))
    return max(d1.max_abs, d2.max_abs)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("label_smoothing,ignore", [(0.0, False), (0.1, False), (0.0, True), (0.1, True)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_vocab_parallel_cross_entropy(pools, tp, label_smoothing, ignore, reduction):
    run_tp(pools, tp, job_cross_entropy, 11, label_smoothing, ignore, reduction)


class MLP(nn.Module):
    def __init__(self, h, f):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(h, f), nn.Linear(f, h)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class ParallelMLP(nn.Module):
    """Column then row: one all-reduce in forward (fc2), one in backward (fc1's input)."""

    def __init__(self, ref: MLP, tp):
        super().__init__()
        self.fc1 = ColumnParallelLinear.from_linear(ref.fc1, tp)
        self.fc2 = RowParallelLinear.from_linear(ref.fc2, tp, partition=self.fc1.partition)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def job_mlp(ctx, b, s, h, f):
    tp = ctx.tp
    torch.manual_seed(0)
    ref = MLP(h, f)
    par = ParallelMLP(ref, tp)
    x = torch.randn(b, s, h, requires_grad=True)
    gy = torch.randn(b, s, h)
    y_ref = ref(x)
    y_ref.backward(gy)
    gx_ref, x.grad = x.grad.clone(), None
    with comm.counting(tp) as c:
        y = par(x)
        fwd = c.summary()
        c.reset()
        y.backward(gy)
        bwd = c.summary()
    d = [assert_parity("output", y, y_ref), assert_parity("input grad", x.grad, gx_ref)]
    for name, p in par.named_parameters():
        d.append(assert_parity(f"grad {name}", p.grad, local_slice(dict(ref.named_parameters())[name].grad, p,
                                                                        tp.rank)))
    d.append(assert_parity("grad norm", grad_norm(par.parameters(), tp),
                           torch.cat([p.grad.flatten() for p in ref.parameters()]).norm()))
    return _maxdiff(d), fwd, bwd


@pytest.mark.parametrize("tp", TPS)
def test_mlp_block(pools, tp):
    diff, fwd, bwd = run_tp(pools, tp, job_mlp, 2, 5, 8, 24)[0]
    if tp > 1:
        assert fwd == {"all_reduce": {"calls": 1, "elements": 2 * 5 * 8, "bytes": 2 * 5 * 8 * 4,
                                      "wire_bytes": 2 * (tp - 1) / tp * 2 * 5 * 8 * 4}}
        assert bwd["all_reduce"]["calls"] == 1 and bwd["all_reduce"]["elements"] == 2 * 5 * 8
        assert set(bwd) == {"all_reduce"}
