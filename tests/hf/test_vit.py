"""Vision transformers (transformers' ViT and DINOv2 image classifiers) sharded at tp = 1..4 against the
unsharded model: classification logits, loss, every gradient (slice by slice) and the grad norm.

Configs: 5 heads (divisible by neither 3 nor 4: uneven head splits), ``head_dim`` different from
``hidden / heads``, an MLP size that 3 does not divide; dropout off (parity is exact math)."""
import copy

import pytest
import torch

from tensorpar.grads import grad_norm, sync_duplicated_grads
from tensorpar.hf.apply import parallelize
from tensorpar.hf.plan import make_plan, meta_model
from tensorpar.testing import assert_parity, compare_grads, random_model
from tests._ranks import run_tp

MODELS = ["vit", "dinov2", "dinov2_swiglu", "siglip"]


def config(name: str):
    import transformers as T

    common = dict(hidden_size=40, num_hidden_layers=2, num_attention_heads=5, image_size=16, patch_size=4,
                  num_labels=7, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if name == "vit":
        c = T.ViTConfig(intermediate_size=44, **common)
        c.head_dim = 12                        # q/k/v are 5 x 12 = 60 rows, hidden is 40
        c._attn_implementation = "sdpa"
    elif name == "dinov2":
        c = T.Dinov2Config(mlp_ratio=1, layerscale_value=0.5, **common)   # MLP 40 (3 does not divide it)
        c.head_dim = 6
        c._attn_implementation = "eager"
    elif name == "dinov2_swiglu":
        c = T.Dinov2Config(mlp_ratio=2, use_swiglu_ffn=True, **common)   # SwiGLU hidden 56
        c._attn_implementation = "sdpa"
    elif name == "siglip":   # the vision tower of SiglipForImageClassification (5 heads of 8, MLP 44)
        vision = {k: v for k, v in common.items() if k not in ("num_labels", "hidden_dropout_prob",
                                                                 "attention_probs_dropout_prob")}
        c = T.SiglipConfig(vision_config=dict(intermediate_size=44, **vision), num_labels=7,
                           text_config=dict(hidden_size=40, num_hidden_layers=1, num_attention_heads=5,
                                            intermediate_size=44, vocab_size=37, bos_token_id=0, eos_token_id=1,
                                            pad_token_id=1))
        c._attn_implementation = "sdpa"
    else:
        raise KeyError(name)
    return c


def job_classifier(ctx, name):
    from transformers import AutoModelForImageClassification
    tp = ctx.tp
    cfg = config(name)
    ref = random_model(cfg, auto_class=AutoModelForImageClassification)
    par = parallelize(copy.deepcopy(ref), make_plan(cfg, tp.size), tp)
    pixels = torch.randn(3, 3, 16, 16)
    labels = torch.tensor([1, 6, 3])
    out_ref = ref(pixel_values=pixels, labels=labels)
    out_ref.loss.backward()
    out = par(pixel_values=pixels, labels=labels)
    out.loss.backward()
    sync_duplicated_grads(par.parameters(), tp)
    # DINOv2's mask token (masked-image modelling) and SigLIP's attention-pooling head are not used by the
    # classifier: no gradient in either model; zero both
    unused = [n for n, p in ref.named_parameters() if p.grad is None]
    assert [n for n, p in par.named_parameters() if p.grad is None] == unused
    want = {"dinov2": ["dinov2.embeddings.mask_token"], "dinov2_swiglu": ["dinov2.embeddings.mask_token"],
            "siglip": [n for n, _ in ref.named_parameters() if n.startswith("vision_model.head.")]}
    assert unused == want.get(name, []), unused
    for m in (ref, par):
        for n in unused:
            m.get_parameter(n).grad = torch.zeros_like(m.get_parameter(n))
    d = [assert_parity("logits", out.logits, out_ref.logits), assert_parity("loss", out.loss, out_ref.loss)]
    d += compare_grads(par, ref, tp.rank)
    d.append(assert_parity("grad norm", grad_norm(par.parameters(), tp),
                           torch.cat([p.grad.flatten() for p in ref.parameters()]).norm()))
    local = par.get_submodule(par.tensorpar_plan.entries[1].pattern.replace("*", "0")).q_proj.weight.shape
    return max(x.max_abs for x in d), len(d), tuple(local)


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
@pytest.mark.parametrize("name", MODELS)
def test_classifier_parity(pools, name, tp):
    res = run_tp(pools, tp, job_classifier, name)
    cfg = config(name)
    vc = getattr(cfg, "vision_config", cfg)
    hd = getattr(vc, "head_dim", vc.hidden_size // vc.num_attention_heads)
    plan = make_plan(cfg, tp)
    for r, (_, n, shape) in enumerate(res):
        assert n > 20
        assert shape == (plan.heads.q_heads.sizes[r] * hd, vc.hidden_size)   # whole heads on every rank


@pytest.mark.parametrize("name", MODELS)
def test_plan_claims_every_tensor(name):
    cfg = config(name)
    plan = make_plan(cfg, 3)
    model = meta_model(cfg)
    assert type(model).__name__.endswith("ForImageClassification")
    assert plan.vocab is None and plan.heads.q_heads.sizes == (2, 2, 1)
    text = str(plan)
    assert "encoder_attention" in text and "q_proj" in text


def test_vit_tp_larger_than_heads_is_an_error():
    with pytest.raises(ValueError, match=r"tp_size \(6\) exceeds the number of attention heads \(5\)"):
        make_plan(config("vit"), 6)


def test_vit_sequence_parallel_is_refused():
    with pytest.raises(ValueError, match="sequence_parallel=True is not supported for vit"):
        make_plan(config("vit"), 2, sequence_parallel=True)


def test_decoders_still_build_causal_lms():
    from tests.families import config as decoder_config
    assert type(meta_model(decoder_config("llama"))).__name__ == "LlamaForCausalLM"


def job_example(ctx, spec, image):
    from examples.classify_vit import classify
    logits, diff = classify(ctx, spec, image)
    return logits, diff


def test_example_classifies_an_image_like_the_unsharded_model(pools, tmp_path):
    """examples/classify_vit.py at tp = 3: a random-weight ViT (checked in the job) and a saved DINOv2 folder
    loaded from safetensors (checked here against the unsharded model on the same pixels)."""
    from transformers import AutoModelForImageClassification

    from examples.classify_vit import load_image, tiny_config
    logits, diff = run_tp(pools, 3, job_example, "vit", None)[0]
    assert logits.shape == (1, 10) and diff < 1e-5
    torch.manual_seed(1)
    ref = AutoModelForImageClassification.from_config(tiny_config("dinov2")).eval()
    ref.save_pretrained(tmp_path)
    res = run_tp(pools, 3, job_example, str(tmp_path), None)
    with torch.no_grad():
        want = ref(pixel_values=load_image(None, 32)).logits
    for logits, diff in res:
        assert diff is None
        assert_parity("logits from folder", logits, want)


def test_models_table_and_generate_know_vision_families(tmp_path):
    """`tensorpar models` lists vit/dinov2 without text generation or training, and `tensorpar generate`
    refuses an image classifier before any rank starts, pointing to the example."""
    import argparse

    from transformers import AutoModelForImageClassification

    from tensorpar.generate import validate
    from tensorpar.models import rows
    table = {r["model_type"]: r for r in rows()}
    assert not table["vit"]["generate"] and not table["dinov2"]["train"] and table["llama"]["generate"]
    AutoModelForImageClassification.from_config(config("vit")).save_pretrained(tmp_path)
    args = argparse.Namespace(tp=2, timeout=10.0, prompt=None, max_new_tokens=4, temperature=0.0, top_k=0,
                              top_p=1.0, seed=None, model=str(tmp_path), chat=False, plan_file=None)
    with pytest.raises(ValueError, match="model_type='vit' is an image classifier.*examples/classify_vit.py"):
        validate(args)


def job_dropout(ctx, name):
    """Training-mode logits with attention and hidden dropout on, keyed masks (seed 7): returned to compare
    across tp; and, with the dropout probabilities set to 0 but the keyed kernel still selected, equal to the
    unsharded model (the keyed kernel must not apply its causal default to an encoder)."""
    import transformers as T

    from tensorpar.hf.modules import TPEncoderAttention
    tp = ctx.tp
    cfg = config(name)
    cfg.attention_probs_dropout_prob, cfg.hidden_dropout_prob = 0.3, 0.2
    torch.manual_seed(0)
    ref = T.AutoModelForImageClassification.from_config(cfg).float()
    par = parallelize(copy.deepcopy(ref), make_plan(cfg, tp.size), tp, dropout_seed=7)
    attn = [m for m in par.modules() if isinstance(m, TPEncoderAttention)]
    assert attn and all(m.attention_fn is not None for m in attn)
    pixels = torch.randn(2, 3, 16, 16)
    par.train()
    with torch.no_grad():
        dropped = par(pixel_values=pixels).logits
        for m in attn:
            m.attention_dropout = 0.0
        for m in par.modules():
            if hasattr(m, "p") and isinstance(getattr(m, "p"), float):
                m.p = 0.0
        no_drop = par(pixel_values=pixels).logits
        want = ref.eval()(pixel_values=pixels).logits
    assert_parity("keyed kernel without dropout vs unsharded", no_drop, want)
    return dropped, no_drop


def test_attention_dropout_is_keyed_and_non_causal(pools):
    """Dropout masks keyed by global head: tp = 3 gives the tp = 1 training logits exactly (up to summation
    order), and they differ from the no-dropout logits (dropout really ran)."""
    one, plain = run_tp(pools, 1, job_dropout, "vit")[0]
    assert (one - plain).abs().max() > 1e-3
    for t, _ in run_tp(pools, 3, job_dropout, "vit"):
        assert_parity("dropout logits tp=3 vs tp=1", t, one)
