"""One decode engine: ``generate_tokens`` is a client of :class:`tensorpar.serve.engine.Engine` (the loop the server
runs), on the lean path and on the module path, and sliding-window families decode through that engine (slot cache
plus a windowed mask per kind of layer) with transformers' greedy tokens, in generate and in continuous batching.

References: transformers' single-process greedy ``generate`` of each prompt alone on the unsharded model. Greedy
tokens must be identical (no tolerance: the sharded logits agree with transformers' to ~1e-6 in fp32, far from
any tie in these random models)."""
import copy

import pytest
import torch

from tensorpar.testing import random_model

from tensorpar.generate import SamplingConfig, generate_tokens
from tests._ranks import run_tp
from tests.decode.test_generate import make_model_folder, prompts

N = 16
LENGTHS = (9, 3, 6)          # longer than the windows (4, 5) before the first decode, and after it


class _StepSpy:
    """Counts :meth:`Engine.step` calls in this process (restored by :meth:`close`; pool ranks are reused)."""

    def __init__(self):
        from tensorpar.serve.engine import Engine
        self.steps, self._orig = 0, Engine.step

        def step(eng, plan, samplers):
            self.steps += 1
            return self._orig(eng, plan, samplers)
        Engine.step = step

    def close(self):
        from tensorpar.serve.engine import Engine
        Engine.step = self._orig


def job_spy(ctx, folder, eos):
    from tensorpar.hf.load import build_parallel_model
    model, _ = build_parallel_model(folder, ctx.tp)
    ids, mask = prompts(53)
    spy = _StepSpy()
    try:
        res = generate_tokens(model, ctx.tp, ids, mask, sampling=SamplingConfig(max_new_tokens=8), eos_token_id=eos)
    finally:
        spy.close()
    return res.tokens, spy.steps


@pytest.mark.parametrize("arch", ["llama", "gpt2"])          # the lean path and the module path
def test_generate_steps_the_engine(pools, tmp_path, arch):
    """Every token of generate_tokens comes from one Engine.step (old code: its own loop, no Engine at all): 8
    steps for 8 tokens; with an EOS that ends every row early, one step per token made and no more."""
    folder = str(make_model_folder(tmp_path / arch, arch))
    for tokens, steps in run_tp(pools, 2, job_spy, folder, None):
        assert tokens.shape == (3, 8) and steps == 8
    eos = int(tokens[0, 2])                                  # a token row 0 makes at step 2
    ended = [next((j for j in range(8) if int(tokens[i, j]) == eos), 7) for i in range(3)]
    for got, steps in run_tp(pools, 2, job_spy, folder, eos):
        assert steps == max(ended) + 1 == got.shape[1]
        for i, e in enumerate(ended):        # rows that ended are padded with pad_id (0) after their EOS
            assert got[i, :e + 1].tolist() == tokens[i, :e + 1].tolist() and not got[i, e + 1:].any()


def _windowed_config(name):
    import transformers as T

    from tests.families import config
    if name == "qwen2":      # windows on the layers from max_window_layers on: one full, one sliding layer
        c = T.Qwen2Config(vocab_size=37, max_position_embeddings=64, hidden_size=40, intermediate_size=44,
                          num_hidden_layers=2, num_attention_heads=5, num_key_value_heads=1, head_dim=8,
                          use_sliding_window=True, sliding_window=4, max_window_layers=1)
        c._attn_implementation = "sdpa"
        return c
    if name == "starcoder2":
        from tests.families_fam import config as fam
        return fam("starcoder2")
    return config(name)


def job_windowed(ctx, name, prompt_rows):
    from tensorpar.hf.apply import parallelize
    from tensorpar.hf.plan import make_plan
    from tensorpar.serve.engine import Engine
    from tensorpar.serve.plan import Row, StepPlan
    cfg = _windowed_config(name)
    ref = random_model(cfg).eval()
    par = parallelize(copy.deepcopy(ref), make_plan(cfg, ctx.tp.size), ctx.tp).eval()
    want = []
    with torch.no_grad():
        for p in prompt_rows:
            x = torch.tensor([p])
            want.append(ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=N, min_new_tokens=N,
                                     do_sample=False, pad_token_id=0, eos_token_id=None)[0, len(p):].tolist())
    s = max(len(p) for p in prompt_rows)
    ids = torch.tensor([[0] * (s - len(p)) + p for p in prompt_rows])
    mask = torch.tensor([[0] * (s - len(p)) + [1] * len(p) for p in prompt_rows])
    spy = _StepSpy()
    try:
        got = generate_tokens(par, ctx.tp, ids, mask, sampling=SamplingConfig(max_new_tokens=N)).tokens.tolist()
    finally:
        spy.close()
    # continuous batching in the server's engine: request 0 alone, then requests 1 and 2 joining at step 3
    engine = Engine(par, ctx.tp, max_batch=3, max_len=s + N)
    out = {i: [] for i in range(3)}
    for step in range(N + 3):
        rows = []
        for i, p in enumerate(prompt_rows):
            join = 0 if i == 0 else 3
            if step == join:
                rows.append(Row(i, list(p), 0))
            elif join < step and len(out[i]) < N:
                rows.append(Row(i, out[i][-1:], len(p) + len(out[i]) - 1))
        if rows:
            res = engine.step(StepPlan("step", rows), None)
            for r, t in zip(rows, res.tokens):
                out[r.slot].append(t)
    return want, got, [out[i] for i in range(3)], spy.steps, engine.lean is None


@pytest.mark.parametrize("name", ["mistral", "gemma2", "gemma3_text", "qwen2", "starcoder2"])
def test_windowed_family_decodes_through_the_engine(pools, name):
    """Sliding windows (mistral 5, starcoder2 5, gemma2/gemma3 4 on alternate layers, qwen2 4 on its second layer)
    at tp=2, prompts of 9, 3 and 6 tokens: generate (one padded batch, through Engine.step) and the server's
    engine (a request joining a running one) give each prompt's greedy tokens of transformers alone, on the lean
    path (windows narrow its masks over each slot's cache positions). Old code: generate ran its own loop (no
    Engine.step) and Engine refused any window shorter than max_len; then the module path ran windowed families."""
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(1, 37, (n,), generator=g).tolist() for n in LENGTHS]
    for r, (want, got, served, steps, module_path) in enumerate(run_tp(pools, 2, job_windowed, name, rows)):
        assert not module_path and steps == N, f"{name} rank {r}: not the engine's lean path"
        assert got == want, f"{name} rank {r}: generate\n{got}\n{want}"
        assert served == want, f"{name} rank {r}: serve engine\n{served}\n{want}"


def test_serve_accepts_a_windowed_model_before_launch(tmp_path):
    """The launcher's check no longer refuses a window shorter than --max-model-len (old code: "the model uses
    sliding_window=4, which tensorpar serve does not implement; use --max-model-len 4 or less")."""
    import argparse
    import json

    from tensorpar.serve import cli
    from tests.decode.test_serve import make_folder
    folder = make_folder(tmp_path / "mistral")
    cfg = json.loads((tmp_path / "mistral" / "config.json").read_text())
    cfg.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=4)
    (tmp_path / "mistral" / "config.json").write_text(json.dumps(cfg))
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    assert cli.validate(p.parse_args(["--model", folder, "--max-model-len", "64"])).task.max_len == 64
