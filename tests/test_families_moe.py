"""Mixture-of-experts families (mixtral, qwen2_moe, qwen3_moe) sharded at tp = 1..4 with expert tensor
parallelism, against the unsharded transformers model: logits, the load-balancing auxiliary loss
(``output_router_logits``), the total loss, every gradient (slice by slice), grad norm; a one-token step in
which some experts receive no token; 16 greedy tokens with the KV cache for a batch of 2 and for a batch of 1
(one token per decode step, fewer tokens than ranks); one all-reduce per MoE layer in forward.

Tolerance (tensorpar.testing): "close", fp32 1e-5 relative (row-parallel sums in another order); greedy tokens
and the routing of every token must be identical."""
import copy

import pytest
import torch
import torch.nn.functional as F

from tensorpar import comm
from tensorpar.generate import SamplingConfig, generate_tokens
from tensorpar.grads import grad_norm, sync_duplicated_grads, sync_sequence_parallel_grads
from tensorpar.hf.apply import parallelize
from tensorpar.hf.plan import make_plan
from tensorpar.layers import vocab_parallel_cross_entropy
from tensorpar.testing import assert_parity, compare_grads
from tests._ranks import run_tp
from tests.families_moe import FAMILIES, config


def _models(tp, model_type):
    from transformers import AutoModelForCausalLM
    cfg = config(model_type)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():               # random weights everywhere (Qwen routers start at zero)
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    par = parallelize(copy.deepcopy(ref), make_plan(cfg, tp.size), tp)
    return cfg, ref, par


def _step(cfg, ref, par, tp, ids):
    """One forward/backward of LM loss + coef * aux loss on both models; the parity diffs."""
    coef = cfg.router_aux_loss_coef
    for m in (ref, par):
        m.zero_grad(set_to_none=True)
    out_ref = ref(ids, output_router_logits=True)
    loss_ref = F.cross_entropy(out_ref.logits[:, :-1].reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1)) \
        + coef * out_ref.aux_loss
    loss_ref.backward()
    out = par(ids, output_router_logits=True)
    loss = vocab_parallel_cross_entropy(out.logits[:, :-1], ids[:, 1:], tp, partition=par) + coef * out.aux_loss
    loss.backward()
    sync_sequence_parallel_grads(par.parameters(), tp)
    sync_duplicated_grads(par.parameters(), tp)
    d = [assert_parity("logits", comm.all_gather(out.logits.detach(), tp, -1, par.tensorpar_plan.vocab),
                       out_ref.logits),
         assert_parity("aux loss", out.aux_loss, out_ref.aux_loss),
         assert_parity("loss", loss, loss_ref)]
    for i, (a, b) in enumerate(zip(out.router_logits, out_ref.router_logits)):
        d.append(assert_parity(f"router logits {i}", a, b))
        k = cfg.num_experts_per_tok
        assert torch.equal(a.topk(k, -1).indices, b.topk(k, -1).indices), f"layer {i}: tokens routed differently"
    d += compare_grads(par, ref, tp.rank)
    d.append(assert_parity("grad norm", grad_norm(par.parameters(), tp),
                           torch.cat([p.grad.flatten() for p in ref.parameters() if p.grad is not None]).norm()))
    return d


def job_moe(ctx, model_type):
    tp = ctx.tp
    cfg, ref, par = _models(tp, model_type)
    torch.manual_seed(1)
    d = _step(cfg, ref, par, tp, torch.randint(0, cfg.vocab_size, (2, 9)))
    # two tokens, top-2 of 4 experts: in every MoE layer at least one expert receives no token
    ids = torch.randint(0, cfg.vocab_size, (1, 2))
    d += _step(cfg, ref, par, tp, ids)
    idle = [n for n, p in ref.named_parameters() if n.endswith("experts.gate_up_proj")
            and any(bool((g == 0).all()) for g in p.grad)]
    assert idle, "the two-token step was meant to leave some expert without tokens"
    # greedy decoding with the KV cache: batch 2, and batch 1 (one token per decode step, fewer than ranks)
    par.eval(), ref.eval()
    for b in (2, 1):
        prompt = torch.randint(1, cfg.vocab_size, (b, 5))
        want = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False,
                            min_new_tokens=16, pad_token_id=0, eos_token_id=None)[:, 5:]
        got = generate_tokens(par, tp, prompt, sampling=SamplingConfig(max_new_tokens=16)).tokens
        assert torch.equal(got, want), f"greedy tokens differ (batch {b}):\n{got}\n{want}"
    return max(x.max_abs for x in d), len(d), idle


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_moe_family_parity(pools, model_type, tp):
    diff, n, idle = run_tp(pools, tp, job_moe, model_type)[0]
    assert n > 20 and idle


def job_one_allreduce(ctx, model_type):
    """All-reduces in the forward of one experts module, with every expert receiving tokens."""
    tp = ctx.tp
    cfg, ref, par = _models(tp, model_type)
    experts = par.model.layers[0].mlp.experts
    torch.manual_seed(2)
    x = torch.randn(12, cfg.hidden_size, requires_grad=True)
    _, w, idx = ref.model.layers[0].mlp.gate(x)
    assert len(idx.unique()) == experts.num_experts
    with comm.counting(tp) as c:
        y = experts(x, idx, w)
    fwd = dict(c.calls)
    want = ref.model.layers[0].mlp.experts(x, idx, w)
    assert_parity("experts output", y, want)
    return fwd


@pytest.mark.parametrize("tp", [2, 4])
def test_experts_one_allreduce_per_layer(pools, tp):
    calls = run_tp(pools, tp, job_one_allreduce, "mixtral")
    assert all(c == {"all_reduce": 1} for c in calls), calls


@pytest.mark.parametrize("model_type", FAMILIES)
def test_moe_plan_claims_every_tensor(model_type):
    from tensorpar.hf.plan import meta_model
    plan = make_plan(config(model_type), 3)       # check=True: every parameter and buffer is claimed
    names = {n for n, _ in meta_model(config(model_type)).named_parameters()}
    claimed = {n for n in names if any(plan.match(".".join(n.split(".")[:k])) is not None
                                       for k in range(1, n.count(".") + 1))}
    assert claimed == names
    assert "moe_experts" in str(plan)


def test_moe_refuses_sequence_parallel_and_router_jitter():
    with pytest.raises(ValueError, match="sequence_parallel=True is not supported for mixtral"):
        make_plan(config("mixtral"), 2, sequence_parallel=True)
    cfg = config("mixtral")
    cfg.router_jitter_noise = 0.1
    with pytest.raises(ValueError, match=r"router_jitter_noise=0.1 is not supported.*set router_jitter_noise=0.0"):
        make_plan(cfg, 2)


def test_experts_refuse_unsupported_layouts():
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from tensorpar.hf.modules import TPExperts
    from tensorpar.parallel import ParallelContext
    tp = ParallelContext.single().tp
    experts = MixtralExperts(config("mixtral"))
    experts.has_bias = True
    with pytest.raises(ValueError, match=r"MixtralExperts.has_bias=True is not supported"):
        TPExperts(experts, tp, partition=tp.partition(12))
    experts = MixtralExperts(config("mixtral"))
    with pytest.raises(ValueError, match=r"does not split the experts' intermediate size 12"):
        TPExperts(experts, tp, partition=tp.partition(14))
