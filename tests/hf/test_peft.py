"""PEFT (LoRA) models under tensor parallelism: adapters follow their base projection's split.

The right values are PEFT's own LoRA model on one process (tp = 1, fp32): logits, the loss, every adapter gradient
and the adapters after AdamW steps. Tolerance 1e-5 (fp32, :func:`tensorpar.testing.assert_parity` "close"): the
sharded model adds the same terms in another order (the row-parallel all-reduce of base + adapter partial products,
the tp sum of the replicated matrices' partial gradients), nothing else differs.
"""
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

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_model(targets=("q_proj", "v_proj"), dropout=0.0):
    """The tiny llama of tests/families.py (6 q heads, 2 KV heads: KV rows shared at tp 3, 4) with LoRA; lora_B made
    non-zero (PEFT initialises it to zero, which would make the adapters a no-op and A's gradient zero)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(family_config("llama")).float()
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, target_modules=list(targets),
                                                      lora_dropout=dropout))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    return model.eval()


def _tp2() -> Group:
    return Group(pg=None, rank=0, size=2)  # refused before any collective: no process group needed


def _adapters(model):
    """``{name without PeftModel's prefix: parameter}`` of the adapter matrices."""
    return {n.replace("base_model.model.", ""): p for n, p in model.named_parameters() if "lora_" in n}


def job_parity(ctx, sequence_parallel=False, steps=3):
    """Logits, loss, every adapter gradient and ``steps`` AdamW steps of the sharded LoRA model against PEFT's."""
    from tensorpar.grads import sync_duplicated_grads, sync_sequence_parallel_grads
    from tensorpar.layers.cross_entropy import vocab_parallel_cross_entropy
    from tensorpar.train.checkpoint.format import full_tensor

    tp = ctx.tp
    ref = lora_model(TARGETS)
    V = ref.config.vocab_size
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(1))
    tgt = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(2))
    par = parallelize(copy.deepcopy(ref), make_plan(ref.config, tp.size, sequence_parallel=sequence_parallel), tp)
    par.train(), ref.train()
    trainable = [p for p in par.parameters() if p.requires_grad]
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3)
    par_opt = torch.optim.AdamW(trainable, lr=1e-3)
    worst = {"logits": 0.0, "loss": 0.0, "grad": 0.0, "weights": 0.0}
    base = [n for n, p in par.named_parameters() if p.requires_grad and "lora_" not in n]
    for step in range(steps):
        want = ref(input_ids=ids).logits
        want_loss = torch.nn.functional.cross_entropy(want.reshape(-1, V), tgt.reshape(-1))
        want_loss.backward()
        logits = par(input_ids=ids).logits                                     # [b, s, V_r]
        loss = vocab_parallel_cross_entropy(logits, tgt, tp, partition=par.tensorpar_plan.vocab)
        loss.backward()
        sync_sequence_parallel_grads(trainable, tp)
        sync_duplicated_grads(trainable, tp)
        got = comm.all_gather(logits.detach(), tp, -1, par.tensorpar_plan.vocab)
        worst["logits"] = max(worst["logits"], assert_parity(f"logits step {step}", got, want.detach()).max_abs)
        worst["loss"] = max(worst["loss"], assert_parity(f"loss step {step}", loss.detach(),
                                                         want_loss.detach()).max_abs)
        mine, theirs = _adapters(par), _adapters(ref)
        assert sorted(mine) == sorted(theirs), (sorted(mine)[:3], sorted(theirs)[:3])
        for n, p in mine.items():
            g = full_tensor(p.grad, p, tp)
            worst["grad"] = max(worst["grad"], assert_parity(f"grad {n} step {step}", g, theirs[n].grad).max_abs)
        ref_opt.step(), ref_opt.zero_grad()
        par_opt.step(), par_opt.zero_grad()
        for n, p in mine.items():
            w = full_tensor(p.data, p, tp)
            worst["weights"] = max(worst["weights"], assert_parity(f"{n} after step {step}", w, theirs[n]).max_abs)
    frozen = [n for n, p in par.named_parameters() if not p.requires_grad]
    assert frozen and not base, base          # base weights stay frozen: only adapters train
    return worst, len(par_opt.state)


@pytest.mark.parametrize("tp", [2, 3])
def test_lora_parity_with_peft(pools, tp):
    """tp 2 and 3 (KV heads shared by two ranks at tp 3: their B rows are summed over holders), plus sequence
    parallelism at tp 2: every value within 1e-5 of PEFT at tp = 1 (each comparison raises otherwise)."""
    for worst, n_state in run_tp(pools, tp, job_parity, tp == 2):
        assert max(worst.values()) < 1e-4, worst
        assert n_state == 2 * 2 * 7   # AdamW state for the adapters only: A and B of 7 projections x 2 layers


@pytest.mark.slow
def test_lora_parity_with_peft_tp4(pools):
    for worst, _ in run_tp(pools, 4, job_parity, False):
        assert max(worst.values()) < 1e-4, worst


def test_peft_model_wrapper_is_sharded_in_place():
    """``parallelize`` takes the PeftModel itself: its inner model is sharded (here at tp = 1, one process) and
    the PeftModel is returned, giving PEFT's logits."""
    from tensorpar.parallel import ParallelContext
    model = lora_model()
    ids = torch.randint(0, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        out = parallelize(copy.deepcopy(model), make_plan(model.config, 1), ParallelContext.single().tp)
        assert type(out).__name__.startswith("PeftModel")
        assert any(type(m).__name__ == "LoraColumnParallelLinear" for m in out.modules())
        assert_parity("logits", out(input_ids=ids).logits, want)


def test_unsupported_adapters_are_refused_in_one_line():
    """DoRA (a magnitude vector per output row) is not sharded: refused at plan time, naming the module."""
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_config(family_config("llama")).float()
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(ValueError) as e:
        parallelize(model, make_plan(model.config, 2), _tp2())
    msg = str(e.value)
    assert "\n" not in msg and "model.layers.0.self_attn.q_proj" in msg and "DoRA" in msg, msg


def job_merged(ctx):
    model = lora_model()
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits                       # PEFT's LoRA model, unsharded
        merged = copy.deepcopy(model).merge_and_unload()
        par = parallelize(merged, make_plan(merged.config, ctx.tp.size), ctx.tp)
        got = comm.all_gather(par(ids).logits, ctx.tp, -1, par.tensorpar_plan.vocab)
    return assert_parity("logits", got, want).max_abs


@pytest.mark.slow
def test_merged_lora_model_is_sharded_with_its_adapters(pools):
    """Merging first (what generate/serve --lora do) gives the LoRA model's logits too (fp32; tolerance of
    tensorpar.testing.assert_parity: only the reduction order differs)."""
    for d in run_tp(pools, 2, job_merged):
        assert d < 1e-4


def _saved(tmp_path):
    """A base model folder (safetensors) and a PEFT adapter folder trained on it (``save_pretrained``)."""
    model = lora_model(TARGETS)
    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    model.save_pretrained(str(adapter_dir))
    copy.deepcopy(model).unload().save_pretrained(str(base_dir))   # the base without its adapters
    return model, str(base_dir), str(adapter_dir)


def job_generate_load(ctx, folder, adapter):
    """What generate / serve ranks run (:func:`tensorpar.job.load_model`) with ``--lora``: the gathered logits."""
    from transformers import AutoConfig

    from tensorpar.job import Job, load_model
    from tensorpar.parallel import ParallelConfig

    config = AutoConfig.from_pretrained(folder)
    job = Job(ParallelConfig(tp=ctx.tp.size), 60.0, folder=folder, model_config=config,
              plan=make_plan(config, ctx.tp.size), attn_implementation="sdpa", lora=adapter)
    model, plan = load_model(job, ctx)
    ids = torch.arange(18).view(2, 9) % config.vocab_size
    with torch.no_grad():
        return comm.all_gather(model(input_ids=ids).logits, ctx.tp, -1, plan.vocab)


def test_generate_lora_merges_per_rank(pools, tmp_path):
    """``generate`` / ``serve --lora DIR``: each rank merges its part of ``s * B A`` into its base shards at load;
    the logits equal PEFT's model loaded with ``PeftModel.from_pretrained`` on the unsharded base (fp32, 1e-5:
    the merged weight rounds once more than PEFT's unmerged sum)."""
    from transformers import AutoModelForCausalLM

    model, base_dir, adapter_dir = _saved(tmp_path)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    want_model = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    ids = torch.arange(18).view(2, 9) % model.config.vocab_size
    with torch.no_grad():
        want = want_model(input_ids=ids).logits
    for got in run_tp(pools, 2, job_generate_load, base_dir, adapter_dir):
        assert_parity("logits with --lora merged", got, want)


def test_lora_adapter_of_another_base_is_refused(tmp_path):
    """``--lora DIR`` with adapters of another base (hidden size 48 against this model's 24), or a folder that is
    not an adapter: one line naming the tensor and both shapes, before any rank starts (``job_from_args``)."""
    import types

    from transformers import AutoConfig, AutoModelForCausalLM

    from tensorpar.job import job_from_args
    from tensorpar.parallel import ParallelConfig

    other = AutoModelForCausalLM.from_config(family_config("mistral")).float()   # q_proj [48 -> 48]
    peft.get_peft_model(other, peft.LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(str(tmp_path / "a"))
    config = AutoConfig.for_model(**family_config("llama").to_dict())
    args = types.SimpleNamespace(timeout=60, lora=str(tmp_path / "a"))
    with pytest.raises(ValueError) as e:
        job_from_args(args, ParallelConfig(tp=2), model_config=config)
    msg = str(e.value)
    assert "\n" not in msg and "q_proj.lora_A.weight" in msg and "[2, 48]" in msg and "[2, 24]" in msg, msg
    with pytest.raises(ValueError, match="not a PEFT adapter folder"):
        job_from_args(types.SimpleNamespace(timeout=60, lora=str(tmp_path)), ParallelConfig(tp=2),
                      model_config=config)
    # review: a damaged adapter reached the ranks ("'lora_B' (rank 0)") or printed a bare JSON error
    import shutil

    from safetensors.torch import load_file, save_file
    base = AutoModelForCausalLM.from_config(family_config("llama")).float()
    peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(str(tmp_path / "b"))
    shutil.copytree(tmp_path / "b", tmp_path / "c")
    w = load_file(str(tmp_path / "c" / "adapter_model.safetensors"))
    save_file({k: v for k, v in w.items() if not ("layers.1." in k and "lora_B" in k)},
              str(tmp_path / "c" / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.q_proj has lora_A but not both lora_A and lora_B"):
        job_from_args(types.SimpleNamespace(timeout=60, lora=str(tmp_path / "c")), ParallelConfig(tp=2),
                      model_config=config)
    (tmp_path / "b" / "adapter_config.json").write_text("{oops")
    with pytest.raises(ValueError, match=r"--lora .*adapter_config.json cannot be read as a LoRA config"):
        job_from_args(types.SimpleNamespace(timeout=60, lora=str(tmp_path / "b")), ParallelConfig(tp=2),
                      model_config=config)
