"""The job paths on CUDA: HF-model generation against transformers, training against tp = 1, and the CLI.

Marked ``cuda`` and skipped (with the reason) without a CUDA device; ``scripts/gpu_check.sh`` runs them with
tests/core/test_cuda.py. None needs the network: the models are the random-weight ones of the CPU tests
(tests/decode/test_generate.py, tests/_train_jobs.py). Set-ups as in test_cuda.py: ``tp1`` in this process on
``cuda:0``; ``nccl-2gpu`` (skipped below 2 GPUs); ``gloo-1gpu-split`` (two gloo ranks on ``cuda:0``).

Tolerances: greedy tokens equal transformers' on the same GPU (fp32; TF32 stays off, PyTorch's default for
matmuls); training losses and grad norms within 1e-5 relative of tp = 1 on the same GPU and gradients within
the harness's "close" bound, as in tests/train/test_train_parity.py (a cross-rank sum reorders additions).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.core.test_cuda import HAS_CUDA, N_GPUS, SETUPS, _needs, _to_cpu, run_cuda_ranks

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device on this machine")]
N_NEW = 12


def job_greedy(ctx, device, folder, ids, mask, n):
    """Greedy tokens and the last prompt logits of the sharded HF model on ``device``."""
    from tensorpar.generate import SamplingConfig, generate_tokens
    from tensorpar.hf.load import build_parallel_model

    model, _ = build_parallel_model(folder, ctx.tp, device=device)
    out = generate_tokens(model, ctx.tp, ids.to(device), mask.to(device), sampling=SamplingConfig(max_new_tokens=n))
    assert out.tokens.device.type in ("cpu", "cuda")
    return out.tokens


@pytest.fixture(scope="module")
def llama_reference(tmp_path_factory):
    from tests.decode.test_generate import ARCHS, hf_reference, make_model_folder, prompts

    folder = str(make_model_folder(tmp_path_factory.mktemp("cuda") / "llama", "llama"))
    ids, mask = prompts(ARCHS["llama"]["vocab_size"])
    want, _ = hf_reference(folder, ids, mask, N_NEW, device="cuda:0")
    return folder, ids, mask, want.cpu()


@pytest.mark.parametrize("setup", ["tp1"] + list(SETUPS))
def test_hf_llama_greedy_on_cuda_equals_transformers(setup, llama_reference):
    from tensorpar.parallel import ParallelContext

    folder, ids, mask, want = llama_reference
    if setup == "tp1":
        outs = [_to_cpu(job_greedy(ParallelContext.single("cuda:0"), torch.device("cuda:0"), folder, ids, mask,
                                   N_NEW))]
    else:
        _needs(setup)
        outs = run_cuda_ranks(setup, job_greedy, folder, ids, mask, N_NEW)
    for rank, tokens in enumerate(outs):
        assert torch.equal(tokens.cpu(), want), f"{setup} rank {rank}: {tokens.tolist()} != {want.tolist()}"


def job_train(ctx, device, cfg, steps):
    """Losses, grad norms and rank 0's gathered gradients at ``steps`` of the tiny training run on ``device``."""
    from tests._train_jobs import train_run

    out = train_run(ctx, cfg, grad_steps=steps)
    return {k: out[k] for k in ("loss", "norm", "grads", "devices")}


@pytest.mark.parametrize("setup", list(SETUPS))
def test_training_on_cuda_equals_tp1(setup):
    from tensorpar.parallel import ParallelContext
    from tensorpar.testing import assert_parity
    from tests._train_jobs import BASE

    _needs(setup)
    cfg = BASE.replace(steps=6)
    ref = job_train(ParallelContext.single("cuda:0"), torch.device("cuda:0"), cfg, (1, 6))
    cpu = job_train(ParallelContext.single("cpu"), torch.device("cpu"), cfg, ())
    assert max(abs(a - b) / abs(b) for a, b in zip(ref["loss"], cpu["loss"])) < 1e-4, (ref["loss"], cpu["loss"])
    outs = run_cuda_ranks(setup, job_train, cfg, (1, 6))
    assert ref["devices"] == ["cuda:0"], ref["devices"]
    for rank, got in enumerate(outs):
        assert got["devices"] == [SETUPS[setup][1][rank]], f"{setup} rank {rank} trained on {got['devices']}"
        for key in ("loss", "norm"):
            worst = max(abs(a - b) / abs(b) for a, b in zip(got[key], ref[key]))
            assert worst < 1e-5, f"{setup} rank {rank} {key}: {got[key]} vs {ref[key]}"
    for step, grads in outs[0]["grads"].items():
        for name, g in grads.items():
            assert_parity(f"step {step} {name}", g.cpu(), ref["grads"][step][name].cpu())


def _cli(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "tensorpar", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _wide_llama(path):
    """A random llama whose Linear inputs are multiples of 32 (hidden 64, MLP 128), with the CLI tests' tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.decode.test_generate_cli import _add_tokenizer

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=53, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                 tie_word_embeddings=True)).save_pretrained(path)
    _add_tokenizer(path)
    return path


def test_generate_cli_on_cuda(tmp_path):
    from tests.decode.test_generate import make_model_folder
    from tests.decode.test_generate_cli import _add_tokenizer

    folder = make_model_folder(tmp_path / "tiny", "llama")
    _add_tokenizer(folder)
    wide = _wide_llama(tmp_path / "wide")      # int8 weights need inputs in blocks of 32
    for model, extra in ((folder, []), (folder, ["--dtype", "bfloat16"]), (wide, ["--quantize", "int8"]),
                         (wide, ["--quantize", "bf16"])):
        r = _cli("generate", "--model", str(model), "--tp", "1", "--prompt", "the cat", "--max-new-tokens", "5",
                 *extra)
        assert r.returncode == 0, f"{extra}: {r.stderr[-3000:]}"
        assert "tokens/s" in r.stdout, extra
    r = _cli("verify", "--model", str(folder), "--tp", "1", "--train")
    assert r.returncode == 0, f"verify: {r.stdout[-2000:]} {r.stderr[-3000:]}"
    r = _cli("generate", "--model", str(folder), "--tp", str(N_GPUS + 1), "--prompt", "the cat")
    assert r.returncode != 0
    err = r.stderr.strip().splitlines()
    assert len(err) <= 2 and "NCCL needs one GPU per rank" in r.stderr, r.stderr[-3000:]


def test_train_cli_on_cuda(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    r = _cli("train", "--model", "tiny", "--tp", "1", "--data", str(text), "--seq-len", "32", "--batch-size", "4",
             "--steps", "3", "--out", str(tmp_path / "run"), "--no-progress", "--eval-every", "0")
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "run" / "metrics.jsonl").exists()
