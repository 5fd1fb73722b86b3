"""A whole Hugging Face Llama (embedding, attention with grouped KV heads, gated MLP, tied LM head)
sharded by its plan at tp = 1..4, with and without sequence parallelism, against the unsharded
model: logits, loss, every gradient and the grad norm."""
import copy

import pytest
import torch
import torch.nn.functional as F

from tensorpar import comm
from tensorpar.grads import grad_norm, sync_duplicated_grads, sync_sequence_parallel_grads
from tensorpar.hf.apply import parallelize
from tensorpar.hf.plan import make_plan
from tensorpar.layers import vocab_parallel_cross_entropy
from tensorpar.testing import assert_parity, compare_grads
from tests._ranks import run_tp


def tiny_llama_config(**kw):
    from transformers import GPT2Config, LlamaConfig
    if kw.pop("model_type", "llama") == "gpt2":
        cfg = GPT2Config(vocab_size=37, n_embd=24, n_layer=2, n_head=6, n_positions=64, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, **kw)  # dropout off: parity is exact math
        cfg._attn_implementation = "sdpa"
        return cfg
    base = dict(vocab_size=37, hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=6,
                num_key_value_heads=2, head_dim=4, max_position_embeddings=64, tie_word_embeddings=True,
                rms_norm_eps=1e-5)
    base.update(kw)
    cfg = LlamaConfig(**base)
    cfg._attn_implementation = "sdpa"
    return cfg


def job_llama(ctx, cfg_kw, sequence_parallel, label_smoothing):
    from transformers import AutoModelForCausalLM
    tp = ctx.tp
    cfg = tiny_llama_config(**cfg_kw)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg).float()
    par = parallelize(copy.deepcopy(ref), make_plan(cfg, tp.size, sequence_parallel=sequence_parallel), tp)
    plan = par.tensorpar_plan
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    # reference
    logits_ref = ref(ids).logits
    loss_ref = F.cross_entropy(logits_ref[:, :-1].reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1),
                               label_smoothing=label_smoothing)
    loss_ref.backward()
    # sharded
    with comm.counting(tp) as counter:
        logits = par(ids).logits                           # [b, s, V_r]
        loss = vocab_parallel_cross_entropy(logits[:, :-1], ids[:, 1:], tp, partition=plan.vocab,
                                            label_smoothing=label_smoothing)
        loss.backward()
        sync_sequence_parallel_grads(par.parameters(), tp)
        sync_duplicated_grads(par.parameters(), tp)
    d = [assert_parity("logits", comm.all_gather(logits.detach(), tp, -1, plan.vocab), logits_ref),
         assert_parity("loss", loss, loss_ref)]
    d += compare_grads(par, ref, tp.rank)
    d.append(assert_parity("grad norm", grad_norm(par.parameters(), tp),
                           torch.cat([p.grad.flatten() for p in ref.parameters()]).norm()))
    if cfg.tie_word_embeddings:                             # tied: still one parameter
        assert par.lm_head.weight is par.get_input_embeddings().weight
    return max(x.max_abs for x in d), len(d), counter.summary()


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_llama_parity(pools, tp):
    # 6 query heads, 2 kv heads: at tp=4 heads split 2/2/1/1 and kv head 0/1 straddle ranks
    diff, n, _ = run_tp(pools, tp, job_llama, {}, False, 0.0)[0]
    assert n > 20


@pytest.mark.parametrize("tp", [2, 4])
def test_llama_parity_sequence_parallel(pools, tp):
    diff, n, counts = run_tp(pools, tp, job_llama, {}, True, 0.1)[0]
    assert counts["reduce_scatter"]["calls"] > 0 and counts["all_gather"]["calls"] > 0


def test_llama_smollm2_head_shape_tp3(pools):
    # SmolLM2's 9 query / 3 KV heads shape, untied head, uneven vocab over 3 ranks
    run_tp(pools, 3, job_llama, dict(num_attention_heads=9, num_key_value_heads=3, hidden_size=36,
                                     tie_word_embeddings=False, vocab_size=41), False, 0.1)


@pytest.mark.parametrize("tp", [3])
def test_gpt2_parity_fused_qkv_conv1d(pools, tp):
    run_tp(pools, tp, job_llama, {"model_type": "gpt2"}, False, 0.1)


def test_plan_is_printable_and_validates():
    cfg = tiny_llama_config(num_attention_heads=9, num_key_value_heads=3, hidden_size=36)
    plan = make_plan(cfg, 2)
    text = str(plan)
    assert "model.layers.*.self_attn.q_proj" in text and "column(heads)" in text
    assert "9 q heads -> [5, 4]" in text and "r0:[0, 1] r1:[1, 2]" in text
    with pytest.raises(ValueError, match=r"tp_size \(10\) exceeds the number of attention heads \(9\)"):
        make_plan(cfg, 10)
    from transformers import BloomConfig
    with pytest.raises(ValueError, match="unsupported architecture model_type='bloom'.*llama"):
        make_plan(BloomConfig(), 2)
