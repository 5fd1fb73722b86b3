"""Pipeline stages in generation (``generate --pp``): the greedy tokens equal transformers' single-process generate,
each rank holds its stage's parameters only, and a bad ``--pp`` is one line before any rank starts."""
import os
import subprocess
import sys

import pytest
import torch

from tensorpar.generate import SamplingConfig, generate_tokens
from tensorpar.parallel import ParallelConfig
from tensorpar.testing import WorkerPool
from tests.decode.test_generate import ARCHS, hf_reference, make_model_folder, prompts

# 4 layers: two stages of two layers (tied llama: the last stage holds the embedding as its head; untied qwen2 with
# QKV biases; qwen3: q/k norms, no lean path, so the module path's stage forward)
PP_ARCHS = {
    "llama": dict(ARCHS["llama"], num_hidden_layers=4),
    "qwen2": dict(ARCHS["qwen2"], num_hidden_layers=4),
    "qwen3": dict(model_type="qwen3", vocab_size=53, hidden_size=24, intermediate_size=40, num_hidden_layers=4,
                  num_attention_heads=6, num_key_value_heads=2, head_dim=4, max_position_embeddings=128,
                  tie_word_embeddings=False),
}


@pytest.fixture(scope="module")
def pp_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp_models")
    out = {}
    for a, kw in PP_ARCHS.items():
        ARCHS[f"pp_{a}"] = kw
        try:
            out[a] = str(make_model_folder(root / a, f"pp_{a}"))
        finally:
            del ARCHS[f"pp_{a}"]
    return out


def job_generate(ctx, folder, ids, mask, n, path):
    """This rank's tokens (the stage's load of :func:`tensorpar.job.load_model`), its parameter bytes and the
    decoder layers it holds."""
    from transformers import AutoConfig

    from tensorpar.job import Job, load_model
    job = Job(parallel=ctx.config, timeout_s=60.0, folder=folder, model_config=AutoConfig.from_pretrained(folder))
    model, _ = load_model(job, ctx)
    res = generate_tokens(model, ctx.tp, ids, mask, sampling=SamplingConfig(max_new_tokens=n), pp=ctx.pp, path=path)
    held = [i for i, layer in enumerate(model.model.layers) if not isinstance(layer, torch.nn.Identity)]
    return res.tokens, sum(p.numel() * p.element_size() for p in model.parameters()), held


def stage_bytes(folder, tp: int, pp: int) -> list[list[int]]:
    """The parameter bytes each rank [stage][tp rank] should hold, from the unsharded transformers model: its stage's
    layers, the embedding on the first stage (and on the last with a tied head), the final norm and head on the
    last, each split over tp as the plan splits it (the vocabulary and the layers' matrices by rows or columns; the
    norms replicated)."""
    from transformers import AutoModelForCausalLM

    from tensorpar.hf.plan import make_plan
    from tensorpar.pipeline.stages import stage_layers
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    plan = make_plan(model.config, tp)
    tied = model.config.tie_word_embeddings
    out = []
    for s in range(pp):
        layers, first, last = stage_layers(model.config.num_hidden_layers, s, pp)
        row = []
        for r in range(tp):
            total = 0
            for name, p in model.named_parameters(remove_duplicate=False):
                if name.startswith("model.layers."):
                    keep = int(name.split(".")[2]) in layers
                elif name.startswith("model.embed_tokens"):
                    keep = first or (last and tied)
                else:                                           # model.norm, lm_head
                    keep = last
                if name == "lm_head.weight" and tied:
                    keep = False                                # the embedding's tensor, counted once
                if keep:
                    total += p.numel() * 4
            row.append(total)
        out.append(row)
    return out


@pytest.fixture(scope="module")
def pool_pp2():
    p = WorkerPool(2, ParallelConfig(pp=2), collective_timeout_s=60.0)
    yield p
    p.close()


def test_greedy_tp2_pp2_equals_transformers(pp_dirs):
    """(tp 2, pp 2), four ranks, lean path: every rank's tokens are transformers' greedy tokens for three prompts
    (two left-padded), and each stage holds exactly its two layers. Exact: fp32, the logits differ from one process
    by reordered sums (~1e-6), far below the gaps between the top tokens of a random model's 53-token vocabulary."""
    folder = pp_dirs["llama"]
    ids, mask = prompts(53)
    want, _ = hf_reference(folder, ids, mask, 6)
    pool = WorkerPool(4, ParallelConfig(tp=2, pp=2), collective_timeout_s=60.0)
    try:
        out = pool.run(job_generate, folder, ids, mask, 6, "auto")
    finally:
        pool.close()
    for tokens, _, _ in out:
        torch.testing.assert_close(tokens, want, rtol=0, atol=0)
    assert [held for _, _, held in out] == [[0, 1], [0, 1], [2, 3], [2, 3]]


@pytest.mark.slow
@pytest.mark.parametrize("arch,path", [("llama", "lean"), ("qwen2", "lean"), ("qwen3", "auto"), ("llama", "hf")])
def test_greedy_pp2_equals_transformers(pool_pp2, pp_dirs, arch, path):
    """pp 2 on the lean path (tied and untied heads, QKV biases) and the module path (qwen3's q/k norms; llama
    forced onto it): transformers' greedy tokens (exact, as above)."""
    folder = pp_dirs[arch]
    ids, mask = prompts(53)
    want, _ = hf_reference(folder, ids, mask, 6)
    for tokens, _, _ in pool_pp2.run(job_generate, folder, ids, mask, 6, path):
        torch.testing.assert_close(tokens, want, rtol=0, atol=0)


@pytest.mark.slow
def test_parameter_bytes_per_rank_are_the_stage_share(pool_pp2, pp_dirs):
    """Each pipeline rank holds exactly its stage's parameters (counted from the unsharded model: its layers, the
    embedding on the first stage and also on the last for a tied head, the final norm and head on the last), and
    the stages together hold the whole model once plus the tied embedding's second copy."""
    for arch in ("llama", "qwen2"):
        folder = pp_dirs[arch]
        ids, mask = prompts(53)
        got = [b for _, b, _ in pool_pp2.run(job_generate, folder, ids, mask, 2, "auto")]
        assert got == [row[0] for row in stage_bytes(folder, 1, 2)], arch


def _cli(*args, timeout=240):
    env = dict(os.environ, PYTHONPATH=os.getcwd(), TENSORPAR_THREADS="1")
    return subprocess.run([sys.executable, "-m", "tensorpar", "generate", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
