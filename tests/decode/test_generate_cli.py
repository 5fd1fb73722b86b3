"""`tensorpar generate` end to end through the elastic launcher, and its bad-input errors."""
import os
import subprocess
import sys

import pytest

from tests.decode.test_generate import make_model_folder


def _cli(*args, timeout=240):
    env = dict(os.environ, PYTHONPATH=os.getcwd(), TENSORPAR_THREADS="1")
    return subprocess.run([sys.executable, "-m", "tensorpar", "generate", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory):
    """A random llama with the SmolLM2-style byte-level BPE tokenizer of a tiny vocabulary."""
    folder = make_model_folder(tmp_path_factory.mktemp("cli") / "tiny", "llama")
    _add_tokenizer(folder)
    return str(folder)


def _add_tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {chr(ord("a") + i): i for i in range(26)} | {" ": 26, ".": 27, "<eos>": 28}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<eos>").save_pretrained(folder)


def test_generate_tp2_runs_and_exits_clean(tiny_with_tokenizer):
    r = _cli("--model", tiny_with_tokenizer, "--tp", "2", "--prompt", "the cat", "--max-new-tokens", "5",
             "--fast-collectives", "off")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "time to first token" in r.stdout and "tokens/s" in r.stdout


def test_print_plan(tiny_with_tokenizer):
    r = _cli("--model", tiny_with_tokenizer, "--tp", "3", "--print-plan")
    assert r.returncode == 0, r.stderr
    assert "ShardingPlan(llama, tp_size=3" in r.stdout and "9 q heads -> [3, 3, 3]" in r.stdout


def test_missing_path():
    r = _cli("--model", "/nonexistent/model", "--tp", "2")
    assert r.returncode != 0 and "no such file or folder" in r.stderr


def test_unsupported_architecture(tmp_path):
    from transformers import BloomConfig
    BloomConfig(hidden_size=32, n_head=4, n_layer=1, vocab_size=50).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    r = _cli("--model", str(tmp_path), "--tp", "2")
    assert r.returncode != 0 and "unsupported architecture" in r.stderr and "llama" in r.stderr
    assert "--plan-file" in r.stderr          # the way to shard an architecture without a built-in table


def test_truncated_safetensors(tiny_with_tokenizer, tmp_path):
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(tiny_with_tokenizer, bad)
    f = bad / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    r = _cli("--model", str(bad), "--tp", "2")
    assert r.returncode != 0 and "model.safetensors" in r.stderr


def test_tp_larger_than_heads(tiny_with_tokenizer):
    r = _cli("--model", tiny_with_tokenizer, "--tp", "10", "--print-plan")
    assert r.returncode != 0 and "tp_size (10) exceeds the number of attention heads (9)" in r.stderr


def test_prompt_longer_than_positions(tiny_with_tokenizer):
    r = _cli("--model", tiny_with_tokenizer, "--tp", "2", "--prompt", "a" * 200)
    assert r.returncode != 0 and "max_position_embeddings=128" in r.stderr


def test_ctrl_c_stops_every_rank(tiny_with_tokenizer):
    import signal
    import time
    env = dict(os.environ, PYTHONPATH=os.getcwd(), TENSORPAR_THREADS="1")
    p = subprocess.Popen([sys.executable, "-m", "tensorpar", "generate", "--model", tiny_with_tokenizer, "--tp", "2",
                          "--prompt", "the cat", "--max-new-tokens", "100", "--fast-collectives", "off"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    deadline = time.monotonic() + 120
    out = ""
    while "the cat" not in out and time.monotonic() < deadline:   # wait until rank 0 is generating
        out += p.stdout.read(1) or ""
    p.send_signal(signal.SIGINT)
    rc = p.wait(timeout=60)
    err = p.stderr.read()
    assert rc != 0 and "interrupted" in err, err[-2000:]
    # nothing of this session is left running (allow a few seconds for processes to finish exiting)
    for _ in range(40):
        left = subprocess.run(["pgrep", "-a", "-s", str(p.pid)], capture_output=True, text=True).stdout.strip()
        if not left:
            break
        time.sleep(0.25)
    assert left == "", left


@pytest.mark.parametrize("args,msg", [(["--tp", "0"], "--tp must be a positive integer"),
                                      (["--timeout", "0"], "--timeout must be a positive"),
                                      (["--prompt", ""], "--prompt must not be empty")])
def test_bad_options_fail_before_launch(tiny_with_tokenizer, args, msg):
    r = _cli("--model", tiny_with_tokenizer, *args)
    assert r.returncode == 2 and msg in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("args", [["--top-p", "0.5", "--top-k", "5", "--seed", "7"], ["--top-k", "5"],
                                  ["--top-p", "0.9", "--temperature", "0"], ["--seed", "7"]])
def test_sampling_options_without_temperature_refused(tiny_with_tokenizer, args):
    """Sampling options at the default temperature 0 (greedy) would do nothing: one line, before any rank starts."""
    import argparse

    from tensorpar import generate
    p = argparse.ArgumentParser()
    generate.add_arguments(p)
    with pytest.raises(ValueError, match=r"^--(top-p|top-k|seed) .*need --temperature > 0"):
        generate.validate(p.parse_args(["--model", tiny_with_tokenizer, *args]))
    # with a temperature they are used, and the defaults alone stay greedy
    generate.validate(p.parse_args(["--model", tiny_with_tokenizer, *args, "--temperature", "0.8"]))
    generate.validate(p.parse_args(["--model", tiny_with_tokenizer, "--top-k", "0", "--top-p", "1"]))
    assert "default 0 = greedy" in " ".join(p.format_help().split())


def test_long_prefill_says_what_it_does(tiny_with_tokenizer):
    prompts = []
    for i in range(10):                       # >= 512 prompt tokens in all (10 prompts of >= 60 tokens)
        prompts += ["--prompt", f"p{i} " + "x y " * 30]
    r = _cli("--model", tiny_with_tokenizer, "--tp", "2", "--max-new-tokens", "2", *prompts)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "tensorpar: prefilling 10 x" in r.stderr and "prompt tokens on tp=2 ranks" in r.stderr


def test_check_collectives_flag_runs_clean(tiny_with_tokenizer):
    # the fingerprint check runs at the first decode step (ranks agree: no error); mismatches are in test_fingerprint
    r = _cli("--model", tiny_with_tokenizer, "--tp", "2", "--prompt", "the cat", "--max-new-tokens", "4",
             "--check-collectives")
    assert r.returncode == 0, r.stderr[-2000:]


def test_quantize_int8_tp2_text_equals_tp1(tiny_with_tokenizer, tmp_path):
    """int8 blocks of 32 inputs: a model whose inputs are whole blocks at tp 1 and 2 (tests/decode/test_quant.py's
    llama) prints the same text at both; the tiny llama (hidden 36) is refused before any rank starts."""
    import tests.decode.test_generate as tg
    from tests.decode.test_quant import QARCHS
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(tg.ARCHS, "llama", QARCHS["llama"])
        folder = str(make_model_folder(tmp_path / "q", "llama"))
    _add_tokenizer(folder)
    outs = []
    for tp in ("1", "2"):
        r = _cli("--model", folder, "--tp", tp, "--prompt", "the cat", "--max-new-tokens", "8", "--quantize", "int8")
        assert r.returncode == 0, r.stderr[-3000:]
        outs.append(r.stdout.splitlines()[0])
    assert outs[0] == outs[1] and outs[0].startswith("the cat")
    r = _cli("--model", tiny_with_tokenizer, "--tp", "1", "--prompt", "the cat", "--quantize", "int8")
    assert r.returncode == 2 and "the hidden size is split as [36]" in r.stderr, r.stderr[-2000:]


def test_quantize_int8_refused_for_a_family_without_the_lean_path(tmp_path):
    folder = make_model_folder(tmp_path / "gpt2", "gpt2")
    r = _cli("--model", str(folder), "--tp", "2", "--quantize", "int8")
    assert r.returncode == 2
    ours = [line for line in r.stderr.splitlines() if line.startswith("tensorpar:")]   # (+ transformers' warnings)
    assert len(ours) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "--quantize int8" in ours[0] and "'gpt2'" in ours[0] and "--quantize none" in ours[0]


def test_chat_without_a_chat_template_is_one_line(tiny_with_tokenizer):
    """Old code: transformers' paragraph-long error (with a docs URL) from every rank, not naming --chat."""
    r = _cli("--model", tiny_with_tokenizer, "--tp", "2", "--prompt", "the cat", "--chat", "--max-new-tokens", "2")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "--chat:" in r.stderr and "has no chat template" in r.stderr and "drop --chat" in r.stderr
