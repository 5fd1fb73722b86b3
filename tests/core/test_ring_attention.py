"""Context-parallel attention (tensorpar.layers.ring_attention) equals full causal attention: torch's
``scaled_dot_product_attention(is_causal=True)`` on the whole sequence in one process is the reference.

Each cp rank (gloo on CPU, ``ParallelConfig(cp=n)``) builds the same full q, k, v and upstream gradient from one
seed, keeps its load-balanced positions (chunks r and 2cp-1-r), runs ring or all2all attention, back-propagates its
slice of the upstream gradient and compares its output slice and its dq/dk/dv slices with the reference's.
GQA is covered (4 query heads on 2 KV heads) and so is cp = 3 (odd: the ring's pairing of early and late chunks
is not symmetric).

Tolerance: 1e-5 absolute (values and gradients are O(1)). The ring merges per-block softmaxes with their
log-sum-exp and the backward recomputes probabilities from the saved log-sum-exp, so sums run in another order
than SDPA's: fp32 reordering, measured <= 1e-6 here.
"""
import pytest
import torch
import torch.nn.functional as F

from tensorpar.layers.ring_attention import (check_all2all_heads, check_cp_seq_len, cp_attention, cp_positions,
                                             cp_shard)
from tensorpar.parallel import ParallelConfig
from tensorpar.testing import WorkerPool

TOL = 1e-5
B, H, KV, S, D = 2, 4, 2, 24, 8


def reference(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, S, D, generator=g, dtype=torch.float64).float() for h in (H, KV, KV))
    dout = torch.randn(B, H, S, D, generator=g)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qr, kr.repeat_interleave(H // KV, 1), vr.repeat_interleave(H // KV, 1),
                                         is_causal=True)
    out.backward(dout)
    return (q, k, v, dout), (out.detach(), qr.grad, kr.grad, vr.grad)


def job_cp(ctx, mode, seed):
    from tensorpar import comm
    cp = ctx.cp
    (q, k, v, dout), ref = reference(seed)
    local = [cp_shard(t, cp.size, cp.rank, dim=2).clone().requires_grad_() for t in (q, k, v)]
    with comm.counting(cp) as counter:
        out = cp_attention(*local, cp, mode)
        out.backward(cp_shard(dout, cp.size, cp.rank, dim=2))
    got = [out.detach()] + [t.grad for t in local]
    return [float((g - cp_shard(r, cp.size, cp.rank, dim=2)).abs().max()) for g, r in zip(got, ref)], \
        {kind: c["bytes"] for kind, c in counter.summary().items()}


def planner_bytes(cp, mode):
    """Bytes a rank sends per layer (forward and backward) by tensorpar.planner.traffic.cp_collectives."""
    from tensorpar.planner.layout import Assumptions, Layout, Workload
    from tensorpar.planner.model_spec import from_dims
    from tensorpar.planner.traffic import cp_collectives
    model = from_dims(layers=1, hidden=H * D, heads=H, kv_heads=KV, vocab=64, head_dim=D)
    calls = cp_collectives(model, Layout(1, 1, 1, B, cp=cp, cp_mode=mode), Workload(B, S),
                           Assumptions(activation_bytes=4), layers=1)
    return sum(c.payload_bytes for c in calls)


@pytest.fixture(scope="module")
def pools():
    made = {}

    def get(n):
        if n not in made:
            made[n] = WorkerPool(n, ParallelConfig(cp=n), collective_timeout_s=60.0)
        return made[n]
    yield get
    for p in made.values():
        p.close()


# cp 2 (both modes) and cp 4 ring in CI (~20 s with the pools' start-up); cp 4 all2all and the odd cp 3 slow
@pytest.mark.parametrize("cp,mode", [(2, "ring"), (2, "all2all"), (4, "ring"),
                                     pytest.param(4, "all2all", marks=pytest.mark.slow),
                                     pytest.param(3, "ring", marks=pytest.mark.slow)])
def test_cp_attention_equals_sdpa(pools, cp, mode):
    """... and every rank sends exactly the bytes the planner counts for one layer (ring: the K/V blocks forward
    and backward and their gradients, fp32; all2all: the 4 + 4 all-to-alls), counted by the cp group's counter."""
    want = planner_bytes(cp, mode)
    for rank, (diffs, sent) in enumerate(pools(cp).run(job_cp, mode, cp)):
        assert max(diffs) <= TOL, f"cp={cp} {mode} rank {rank}: max |diff| (out, dq, dk, dv) = {diffs}"
        assert sent == {"send" if mode == "ring" else "all_to_all": want}, f"cp={cp} {mode} rank {rank}: {sent}"


def test_layout_and_refusals():
    # rank r holds chunks r and 2cp-1-r: at cp 2, s 8: rank 0 positions 0,1,6,7; rank 1 positions 2..5
    assert cp_positions(8, 2, 0).tolist() == [0, 1, 6, 7] and cp_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    every = torch.cat([cp_positions(24, 3, r) for r in range(3)]).sort().values
    assert torch.equal(every, torch.arange(24))
    with pytest.raises(ValueError, match=r"seq_len=10 is not divisible by 2 x cp = 4 .* use seq_len=8 or 12"):
        check_cp_seq_len(10, 2)
    with pytest.raises(ValueError, match=r"cp_mode='all2all' needs the query heads of each tp rank \(3 at tp=2\) "
                                         r"divisible by cp=2; use cp_mode='ring'"):
        check_all2all_heads(3, 2, 2)


@pytest.mark.parametrize("causal", [False, True])
def test_block_kernels_fused_and_in_full_agree(causal):
    """One (query chunk, key chunk) block: the path other devices take (scores in full) equals torch's fused CPU
    flash kernel and its backward, output, log-sum-exp and dq/dk/dv (given the whole row's output and
    log-sum-exp, as the ring passes them). Tolerance 1e-5: fp32 sums in another order."""
    from tensorpar.layers.ring_attention import _block_backward, _block_forward
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(2, 4, 12, 8, generator=g) for _ in range(4))
    scale = 8 ** -0.5
    fused = _block_forward(q, k, v, scale, causal, fused=True)
    full = _block_forward(q, k, v, scale, causal, fused=False)
    for a, b in zip(fused, full):
        assert (a - b).abs().max() <= TOL
    o, lse = fused
    for a, b in zip(_block_backward(do, q, k, v, o, lse, scale, causal, fused=True),
                    _block_backward(do, q, k, v, o, lse, scale, causal, fused=False)):
        assert (a - b).abs().max() <= TOL
