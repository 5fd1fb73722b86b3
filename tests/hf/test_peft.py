"""PEFT (LoRA) models under tensor parallelism: adapters are never dropped silently.

A LoRA-wrapped projection holds its base weight and the adapter matrices below it; the attention and MLP styles
would slice the base weight and drop the adapters. ``parallelize`` therefore refuses such a model at plan time
(one line naming the adapter modules), and the merged model (``merge_and_unload``) is sharded and gives the
LoRA model's logits (the right values: PEFT on the unsharded model)."""
from __future__ import annotations

import copy

import pytest
import torch

peft = pytest.importorskip("peft")

from tensorpar import comm  # noqa: E402
from tensorpar.comm import Group  # noqa: E402
from tensorpar.hf.apply import parallelize  # noqa: E402
from tensorpar.hf.plan import make_plan  # noqa: E402
from tensorpar.testing import assert_parity  # noqa: E402
from tests._ranks import run_tp  # noqa: E402
from tests.families import config as family_config  # noqa: E402


def lora_model():
    """The tiny llama of tests/families.py with LoRA on q_proj and v_proj; lora_B made non-zero (PEFT
    initialises it to zero, which would make the adapters a no-op)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(family_config("llama")).float()
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                                      lora_dropout=0.0))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    return model.eval()


def _tp2() -> Group:
    return Group(pg=None, rank=0, size=2)  # refused before any collective: no process group needed


def test_lora_model_is_refused_naming_the_adapters():
    model = lora_model()
    inner = model.get_base_model()  # the LlamaForCausalLM with LoRA layers in place of q_proj / v_proj
    plan = make_plan(inner.config, 2)
    with pytest.raises(ValueError) as e:
        parallelize(inner, plan, _tp2())
    msg = str(e.value)
    assert "\n" not in msg
    assert "model.layers.0.self_attn.q_proj.lora_A" in msg and "merge_and_unload" in msg, msg
    # the PeftModel wrapper itself is refused the same way (its names carry PEFT's prefix)
    with pytest.raises(ValueError, match=r"LoRA.*model\.layers\.0\.self_attn\.q_proj.*merge_and_unload"):
        parallelize(model, plan, _tp2())


def job_merged(ctx):
    model = lora_model()
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits                       # PEFT's LoRA model, unsharded
        merged = copy.deepcopy(model).merge_and_unload()
        par = parallelize(merged, make_plan(merged.config, ctx.tp.size), ctx.tp)
        got = comm.all_gather(par(ids).logits, ctx.tp, -1, par.tensorpar_plan.vocab)
    return assert_parity("logits", got, want).max_abs


def test_merged_lora_model_is_sharded_with_its_adapters(pools):
    """The remedy the refusal names: merged adapters are part of the weights; logits equal PEFT's LoRA model
    (fp32; tolerance of tensorpar.testing.assert_parity: only the reduction order differs)."""
    for d in run_tp(pools, 2, job_merged):
        assert d < 1e-4
