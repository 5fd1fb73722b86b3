"""Sequence parallelism that saves memory (Korthikanti et al. 2022, section 4.2.2) and the overlapped
column-parallel backward, on a Hugging Face Llama sharded by its plan.

One job per tp degree checks, against the unsharded model and tensorpar at tp = 1:
* loss and every gradient equal to the unsharded model's (the column-parallel layers keep only the
  sequence shard of their input and all-gather it again in backward);
* the bytes autograd saves per rank (counted storage by storage, deterministic) are below tp = 1's and
  equal the planner's prediction for the same shapes;
* the overlapped backward (input-gradient collective running while the weight gradients are computed)
  gives exactly the gradients of the synchronous one, and the asynchronous raw collectives (uneven shard
  sizes too) exactly the synchronous ones.
"""
import copy

import pytest
import torch

from tensorpar import comm
from tensorpar.comm import Group
from tensorpar.grads import sync_duplicated_grads, sync_sequence_parallel_grads
from tensorpar.hf.apply import parallelize
from tensorpar.hf.plan import make_plan
from tensorpar.layers import vocab_parallel_cross_entropy
from tensorpar.layers.linear import set_grad_comm_overlap
from tensorpar.planner.calibrate import saved_activation_bytes
from tensorpar.planner.layout import Assumptions, Layout, Workload
from tensorpar.planner.memory import memory_per_device
from tensorpar.planner.model_spec import from_dims
from tensorpar.testing import assert_parity, compare_grads
from tests._ranks import run_tp

SHAPE = dict(hidden=48, heads=6, kv_heads=2, ffn=96, layers=2, vocab=37, batch=2)


def _config():
    from transformers import LlamaConfig
    cfg = LlamaConfig(vocab_size=SHAPE["vocab"], hidden_size=SHAPE["hidden"], intermediate_size=SHAPE["ffn"],
                      num_hidden_layers=SHAPE["layers"], num_attention_heads=SHAPE["heads"],
                      num_key_value_heads=SHAPE["kv_heads"], head_dim=SHAPE["hidden"] // SHAPE["heads"],
                      max_position_embeddings=64, tie_word_embeddings=False, rms_norm_eps=1e-5)
    cfg._attn_implementation = "sdpa"
    return cfg


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def job_sp_memory(ctx, seq):
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(1)
    tp, cfg = ctx.tp, _config()
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg).float()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (SHAPE["batch"], seq), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (SHAPE["batch"], seq), generator=gen)

    def loss_fn(model, group):
        vocab = model.tensorpar_plan.vocab
        return lambda: vocab_parallel_cross_entropy(model(input_ids=ids).logits, targets, group, partition=vocab)

    # the unsharded reference (gradients) and tensorpar at tp = 1 (the activation baseline)
    ref = parallelize(copy.deepcopy(hf), make_plan(cfg, 1), Group.single())
    loss_ref, bytes_tp1 = saved_activation_bytes(loss_fn(ref, Group.single()), params=ref.parameters())
    loss_ref.backward()

    par = parallelize(hf, make_plan(cfg, tp.size, sequence_parallel=True), tp)
    grads = {}
    for overlap in (True, False):
        set_grad_comm_overlap(par, overlap)
        loss, bytes_sp = saved_activation_bytes(loss_fn(par, tp), params=par.parameters())
        with comm.counting(tp) as counter:
            loss.backward()
        sync_sequence_parallel_grads(par.parameters(), tp)
        sync_duplicated_grads(par.parameters(), tp)
        grads[overlap] = _grads(par)
        if overlap:
            diffs = [assert_parity("loss", loss, loss_ref)] + compare_grads(par, ref, tp.rank)
            backward_counts = counter.summary()
        for p in par.parameters():
            p.grad = None
    same = sorted(grads[True]) == sorted(grads[False]) and all(
        torch.equal(grads[True][n], grads[False][n]) for n in grads[True])
    spec = from_dims(layers=SHAPE["layers"], hidden=SHAPE["hidden"], heads=SHAPE["heads"], kv_heads=SHAPE["kv_heads"],
                     ffn=SHAPE["ffn"], vocab=SHAPE["vocab"])
    predicted = memory_per_device(spec, Layout(tp.size, 1, 1, SHAPE["batch"], sequence_parallel=True),
                                  Workload(SHAPE["batch"], seq),
                                  Assumptions(activation_bytes=4, param_bytes=4, grad_bytes=4, attention="sdpa"))
    return dict(n_compared=len(diffs), bytes_tp1=bytes_tp1, bytes_sp=bytes_sp, predicted=predicted.activations,
                overlap_equals_sync=same, backward_counts=backward_counts, async_equals_sync=_async_collectives(tp))


def _async_collectives(tp):
    """The asynchronous raw collectives give exactly the synchronous ones, with uneven shard sizes too."""
    sizes = [tp.size + 1 - r for r in range(tp.size)]                       # e.g. [3, 2] at tp = 2
    gen = torch.Generator().manual_seed(10 + tp.rank)
    local = torch.randn(2, sizes[tp.rank], 5, generator=gen)                 # [b, s_r, h], s_r uneven
    full = torch.randn(2, sum(sizes), 5, generator=gen)
    checks = [torch.equal(comm.all_gather_async(local, tp, 1, sizes).wait(), comm.all_gather(local, tp, 1, sizes)),
              torch.equal(comm.reduce_scatter_async(full.clone(), tp, 1, sizes).wait(),
                          comm.reduce_scatter(full, tp, 1, sizes)),
              torch.equal(comm.all_reduce_async(full.clone(), tp).wait(), comm.all_reduce(full, tp))]
    return all(checks)


@pytest.mark.parametrize("tp,seq", [(2, 16), (3, 12)])
def test_sequence_parallel_saves_memory_and_matches_tp1(pools, tp, seq):
    # tp=3: 6 query heads 2/2/2, KV head 0 straddles ranks 0 and 1
    results = run_tp(pools, tp, job_sp_memory, seq)
    for r in results:
        assert r["n_compared"] > 20
        assert r["overlap_equals_sync"]
        assert r["async_equals_sync"]
        assert r["bytes_sp"] < r["bytes_tp1"], r
        # backward re-gathers the saved shards: one all-gather per column-parallel entry (2 per layer + head)
        # on top of the all-gathers that are the transposes of the forward reduce-scatters (2 per layer)
        # and of the first block's sequence split (1)
        assert r["backward_counts"]["all_gather"]["calls"] == 2 * SHAPE["layers"] + 1 + 2 * SHAPE["layers"] + 1
    bytes_sp = max(r["bytes_sp"] for r in results)                      # the busiest rank
    # the planner's prediction for the busiest rank of these shapes (within 1%: it leaves out the
    # cross-entropy's per-token range mask at tp > 1 and counts a straddling KV group's index coarsely)
    assert bytes_sp == pytest.approx(results[0]["predicted"], rel=0.01), [r["bytes_sp"] for r in results]
    # Korthikanti's 1/t plus the replicated terms: <= 0.55 of tp = 1 at tp = 2 (0.55 * 2/3 at tp = 3)
    assert bytes_sp <= 0.55 * results[0]["bytes_tp1"] * 2 / tp, (bytes_sp, results[0]["bytes_tp1"])
