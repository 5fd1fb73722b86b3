"""StarCoder2, GPT-NeoX and OLMo 2 sharded at tp = 1..4 against the unsharded transformers model: logits, loss,
every gradient (slice by slice), grad norm, and 16 greedy tokens (the harness of tests/test_families.py, with the
configs of tests/families_fam.py).

Tolerance (tensorpar.testing): "close", fp32 1e-5 relative; greedy tokens must be identical."""
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
from tests.families_fam import FAMILIES, config


def job_family(ctx, name):
    """tests.test_families.job_family on a config of tests/families_fam.py (``name`` may carry a variant)."""
    from transformers import AutoModelForCausalLM
    tp = ctx.tp
    cfg = config(name)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():               # random weights everywhere, norms and biases too
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    par = parallelize(copy.deepcopy(ref), make_plan(cfg, tp.size), tp)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    logits_ref = ref(ids).logits
    loss_ref = F.cross_entropy(logits_ref[:, :-1].reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1))
    loss_ref.backward()
    logits = par(ids).logits
    loss = vocab_parallel_cross_entropy(logits[:, :-1], ids[:, 1:], tp, partition=par)
    loss.backward()
    sync_sequence_parallel_grads(par.parameters(), tp)
    sync_duplicated_grads(par.parameters(), tp)
    d = [assert_parity("logits", comm.all_gather(logits.detach(), tp, -1, par.tensorpar_plan.vocab), logits_ref),
         assert_parity("loss", loss, loss_ref)]
    d += compare_grads(par, ref, tp.rank)
    d.append(assert_parity("grad norm", grad_norm(par.parameters(), tp),
                           torch.cat([p.grad.flatten() for p in ref.parameters()]).norm()))
    # greedy decoding with the KV cache: 16 tokens equal to transformers' generate
    par.eval(), ref.eval()
    prompt = torch.randint(1, cfg.vocab_size, (2, 5))
    want = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False,
                        min_new_tokens=16, pad_token_id=0, eos_token_id=None)[:, 5:]
    got = generate_tokens(par, tp, prompt, sampling=SamplingConfig(max_new_tokens=16)).tokens
    assert torch.equal(got, want), f"greedy tokens differ:\n{got}\n{want}"
    return max(x.max_abs for x in d), len(d)


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
@pytest.mark.parametrize("name", FAMILIES)
def test_family_parity(pools, name, tp):
    diff, n = run_tp(pools, tp, job_family, name)[0]
    assert n > 10
