"""``--ep`` on ``tensorpar generate``, ``serve`` and ``verify`` (issue 22): a mixture-of-experts model's experts split
whole over ep replicas of the tp ranks (:func:`tensorpar.hf.modules.expert_parallelize`, on the dp axis), and the
refusals of an ``--ep`` that cannot run, in one line from the launching process.

Model: the small random Mixtral of tests/families_moe.py (4 experts, top-2 routing, vocabulary 37) with a
character-level tokenizer covering all 37 ids. Greedy tokens must equal transformers' ``generate`` on the unsharded
model exactly (the argmax of logits that agree to fp32 rounding; tests/hf/test_families_moe.py's expert-parallel
parity test checks those logits within 1e-5).
"""
import os
import subprocess
import sys

import pytest
import torch

from tensorpar.testing import random_model

SYMBOLS = [chr(ord("a") + i) for i in range(26)] + [" ", "."] + [str(d) for d in range(8)]   # ids 0..35
EOS = 36


def _cli(cmd, *args, timeout=400):
    env = dict(os.environ, PYTHONPATH=os.getcwd(), TENSORPAR_THREADS="1")
    return subprocess.run([sys.executable, "-m", "tensorpar", cmd, *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    """A random Mixtral (4 experts) saved with a tokenizer of one character per id (37 ids, the last <eos>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.families_moe import config
    cfg = config("mixtral")
    cfg.eos_token_id, cfg.bos_token_id, cfg.pad_token_id = EOS, None, EOS
    model = random_model(cfg)
    folder = tmp_path_factory.mktemp("moe") / "mixtral"
    model.save_pretrained(folder)
    tk = Tokenizer(models.WordLevel({s: i for i, s in enumerate(SYMBOLS)} | {"<eos>": EOS}, unk_token="<eos>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<eos>").save_pretrained(folder)
    return str(folder)


def _reference_text(folder, prompt, n):
    """transformers' greedy continuation of ``prompt`` on the unsharded model, decoded as generate prints it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                       eos_token_id=EOS, pad_token_id=EOS)[0, ids.shape[1]:]
    return prompt + tok.decode(out, skip_special_tokens=True)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_generate_ep2_greedy_equals_transformers(moe_folder, tp):
    r = _cli("generate", "--model", moe_folder, "--tp", str(tp), "--ep", "2", "--prompt", "the cat sat",
             "--max-new-tokens", "12", "--fast-collectives", "off")
    assert r.returncode == 0, r.stderr[-3000:]
    text = r.stdout.splitlines()[0]
    assert text == _reference_text(moe_folder, "the cat sat", 12), r.stdout


@pytest.mark.slow  # CI keeps test_generate_ep2_greedy_equals_transformers
def test_verify_ep2_passes(moe_folder):
    r = _cli("verify", "--model", moe_folder, "--tp", "1", "--ep", "2", "--fast-collectives", "off")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tensorpar verify: OK" in r.stdout and "ep=2" in r.stdout
    assert "at tp 1 (" in r.stdout                   # the tp degree, not the world size tp x ep (review finding)
    assert "model.layers.1.mlp" in r.stdout          # the MoE block's output compared (it holds the split experts)


@pytest.mark.slow
def test_serve_ep2_greedy_equals_transformers_and_samples(moe_folder):
    # rank 0 schedules; the other ep replica follows its plans (broadcast over every rank) and runs the same steps,
    # its experts serving rank 0's tokens; a sampled request exercises a follower that is tp rank 0 of its replica
    from transformers import AutoModelForCausalLM

    from tests.decode.test_serve import post, start_server, stop_server
    p, url = start_server(moe_folder, "--ep", "2", "--max-batch", "2", "--max-model-len", "48", tp=1)
    try:
        ids = [19, 7, 4, 26, 2, 0, 19]
        st, r = post(url, "/v1/completions", {"model": moe_folder, "prompt": ids, "max_tokens": 10,
                                              "temperature": 0, "return_token_ids": True})
        assert st == 200, r
        ref = AutoModelForCausalLM.from_pretrained(moe_folder, dtype=torch.float32).eval()
        x = torch.tensor([ids])
        want = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=10, do_sample=False,
                            eos_token_id=EOS, pad_token_id=EOS)[0, len(ids):].tolist()
        assert r["choices"][0]["token_ids"] == [t for t in want if t != EOS][:len(r["choices"][0]["token_ids"])]
        assert len(r["choices"][0]["token_ids"]) == (want.index(EOS) if EOS in want else 10)
        st, r = post(url, "/v1/completions", {"model": moe_folder, "prompt": ids, "max_tokens": 6,
                                              "temperature": 1, "seed": 5})
        assert st == 200, r
    finally:
        rc, left = stop_server(p)
    assert rc == 0 and not left, (rc, left)


@pytest.mark.parametrize("cmd", ["generate", "serve", "verify"])
@pytest.mark.parametrize("ep,match", [("3", "--ep 3: does not divide the model's 4 experts; use --ep in [1, 2, 4]"),
                                      ("0", "--ep must be a positive integer")])
def test_ep_that_cannot_split_the_experts_is_refused(moe_folder, capsys, cmd, ep, match):
    from tensorpar.cli import main
    rc = main([cmd, "--model", moe_folder, "--tp", "1", "--ep", ep, *(["--port", "0"] if cmd == "serve" else [])])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert match in err and err.count("\n") == 1 and err.startswith(f"tensorpar {cmd}: error: "), err


@pytest.fixture(scope="module")
def dense_folder(tmp_path_factory):
    from tests.decode.test_generate import make_model_folder
    return str(make_model_folder(tmp_path_factory.mktemp("dense") / "llama", "llama"))


@pytest.mark.parametrize("cmd", ["generate", "serve", "verify"])
def test_ep_on_a_dense_model_is_refused(dense_folder, capsys, cmd):
    from tensorpar.cli import main
    rc = main([cmd, "--model", dense_folder, "--tp", "1", "--ep", "2", *(["--port", "0"] if cmd == "serve" else [])])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "--ep 2: model_type='llama' has no mixture-of-experts layers; expert parallelism needs one of" in err, err
    assert "use --ep 1" in err and err.count("\n") == 1, err
