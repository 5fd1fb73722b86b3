"""Streamed text equals batch-decoded text (emoji, CJK, characters split over tokens); every EOS id of
generation_config.json stops a row; --chat separates prompt and answer; the stats line never says nan."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tensorpar.streaming import (REPLACEMENT, IncrementalDecoder, TokenPrinter, chat_header, eos_token_ids,
                                 stats_line)
from tests.tiny_gguf import bytes_to_unicode

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXTS = [
    "Hello 😀 world",
    "日本語のテキストです。",
    "mixed 中文 and emoji 👩‍👩‍👧 family 🇫🇷!",
    "Ünïcödé ✓ naïve café — “quotes”",
    "한국어 텍스트와 🎉🎉🎉 축하",
    "😀",
    "plain ascii only",
]


@pytest.fixture(scope="module")
def byte_bpe():
    """A byte-level BPE tokenizer (the GPT-2 / SmolLM2 scheme) with merges that cut characters: one token
    is a space plus an emoji's first byte, another the last byte of 日 plus the first byte of 本."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    bu = bytes_to_unicode()
    vocab = {ch: i for i, ch in enumerate(bu[b] for b in range(256))}
    merges = [(bu[0x20], bu[0xF0]), (bu[0xA5], bu[0xE6]), (bu[0x97], bu[0xA5])]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>")
    tok.add_special_tokens({"eos_token": "<eos>"})
    return tok


def _stream(tok, ids):
    pieces: list[str] = []
    printer = TokenPrinter(tok, write=pieces.append)
    for step, i in enumerate(ids):
        printer(step, torch.tensor([i]))
    printer.close()
    return pieces


def _splits_a_character(tok, ids) -> bool:
    return any(tok.decode(ids[:k], skip_special_tokens=True).endswith(REPLACEMENT) for k in range(1, len(ids)))


def test_streamed_text_equals_batch_decode_offline_tokenizer(byte_bpe):
    split_seen = 0
    for text in TEXTS:
        ids = byte_bpe.encode(text, add_special_tokens=False)
        pieces = _stream(byte_bpe, ids)
        assert "".join(pieces) == byte_bpe.decode(ids, skip_special_tokens=True) == text
        assert not any(REPLACEMENT in p for p in pieces), (text, pieces)
        split_seen += _splits_a_character(byte_bpe, ids)
    assert split_seen >= 5  # the set really cuts characters across tokens


def test_merged_token_across_a_character_boundary(byte_bpe):
    ids = byte_bpe.encode("日本", add_special_tokens=False)
    assert any(len(byte_bpe.convert_ids_to_tokens(i)) == 2 for i in ids)  # the A5+E6 merge was used
    pieces = _stream(byte_bpe, ids)
    # The token that completes 日 also starts 本, so 日 is held back with it until 本 is complete.
    assert pieces == ["日本"]


def test_eos_mid_stream_prints_nothing_and_an_unfinished_character_is_flushed(byte_bpe):
    ids = byte_bpe.encode("a😀", add_special_tokens=False) + [byte_bpe.eos_token_id]
    assert "".join(_stream(byte_bpe, ids)) == "a😀"
    # A lead byte that never gets its continuation: held back while generating, printed by close()
    # exactly as the batch decode shows it.
    cut = byte_bpe.encode("b😀", add_special_tokens=False)[:-2]
    pieces = _stream(byte_bpe, cut)
    assert "".join(pieces) == byte_bpe.decode(cut) and pieces[-1].endswith(REPLACEMENT)
    assert not any(REPLACEMENT in p for p in pieces[:-1])


def test_incremental_decoder_works_with_a_plain_decode_function():
    def decode(ids):
        return bytes(ids).decode("utf-8", errors="replace")

    data = "€uro 漢字 🙂".encode()
    dec = IncrementalDecoder(decode)
    pieces = [p for p in dec.push_many(data) if p] + [dec.flush()]
    assert "".join(pieces) == "€uro 漢字 🙂"
    assert not any(REPLACEMENT in p for p in pieces)


@pytest.mark.network
def test_streamed_text_equals_batch_decode_smollm2_tokenizer():
    from transformers import AutoTokenizer

    from tensorpar.hub import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model("smollm2", progress=False)))
    split_seen = 0
    for text in TEXTS:
        for chat in (False, True):
            prompt = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False) if chat else text
            ids = tok.encode(prompt, add_special_tokens=False)
            pieces = _stream(tok, ids)
            assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
            assert not any(REPLACEMENT in p for p in pieces), (text, pieces)
            split_seen += _splits_a_character(tok, ids)
    assert split_seen >= 4


@pytest.mark.network
def test_smollm2_generation_streams_the_batch_decoded_answer():
    """A real greedy answer to a Chinese/emoji chat prompt, streamed token by token as the CLI does."""
    from transformers import AutoTokenizer

    from tensorpar.generate import SamplingConfig, _encode, generate_tokens
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.hub import resolve_model
    from tensorpar.parallel import ParallelContext

    folder = str(resolve_model("smollm2", progress=False))
    ctx = ParallelContext.single()
    model, _ = build_parallel_model(folder, ctx.tp)
    tok = AutoTokenizer.from_pretrained(folder)
    ids, mask = _encode(tok, ["用中文回答：巴黎是哪个国家的首都？🙂"], chat=True)
    pieces: list[str] = []
    printer = TokenPrinter(tok, write=pieces.append)
    res = generate_tokens(model, ctx.tp, ids, mask, sampling=SamplingConfig(max_new_tokens=24),
                          eos_token_id=eos_token_ids(folder, tok), pad_id=tok.pad_token_id, on_token=printer)
    printer.close()
    want = tok.decode(res.tokens[0], skip_special_tokens=True)
    assert "".join(pieces) == want
    assert not any(REPLACEMENT in p for p in pieces)


# ---------------------------------------------------------------- EOS ids, chat layout, stats line

def test_eos_ids_come_from_generation_config_config_and_tokenizer(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128009]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 128001}))

    class Tok:
        eos_token_id = 7

    assert eos_token_ids(tmp_path, Tok()) == [7, 128001, 128009]
    assert eos_token_ids(tmp_path / "missing") == []


@pytest.mark.parametrize("n, decode_s, want", [
    (1, 0.0, "(1 token; no decode steps to time)"),
    (3, 0.0, "(3 tokens; no decode steps to time)"),
    (3, float("nan"), "(3 tokens; no decode steps to time)"),
    (5, 0.5, "decode 8.0 tokens/s (5 tokens)"),
])
def test_stats_line_never_prints_nan(n, decode_s, want):
    line = stats_line(2, 0.0123, decode_s, n)
    assert line.startswith("[tp=2] time to first token 12.3 ms") and line.endswith(want)
    assert "nan" not in line and "inf" not in line


def test_stats_line_of_a_batch_gives_the_rate_per_row_and_over_the_batch():
    """A batch of 4 prompts: 8 steps/s is 8 tokens/s per row and 32 over the batch (a review: the per-row rate
    alone read as batching being slower than one prompt)."""
    assert stats_line(2, 0.0123, 0.5, 5, rows=4).endswith("decode 8.0 tokens/s per row, 32.0 over 4 rows (5 tokens)")


def test_chat_header_separates_prompt_and_answer():
    assert chat_header("Hi there") == "User: Hi there\nAssistant: "


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory):
    """A random llama with a letter-level tokenizer and a chat template, and the first greedy token its
    chat-formatted prompt produces (read with transformers, single process)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from tensorpar.generate import _encode
    from tests.decode.test_generate import make_model_folder

    folder = make_model_folder(tmp_path_factory.mktemp("chat") / "tiny", "llama")
    vocab = {chr(ord("a") + i): i for i in range(26)} | {" ": 26, ".": 27, "<eos>": 28, ":": 29}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<eos>")
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}. {% endfor %}assistant: "
    tok.save_pretrained(folder)
    ids, mask = _encode(tok, ["the cat"], chat=True)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        first = int(model(input_ids=ids, attention_mask=mask).logits[0, -1].argmax())
    return str(folder), first


@pytest.mark.slow  # CI keeps the in-process streaming tests
def test_cli_stops_at_any_generation_config_eos_and_separates_chat(tiny_chat_model):
    folder, first = tiny_chat_model
    # The model's first greedy token is one of generation_config's EOS ids (not the tokenizer's), so the
    # row must stop after one token; the stats line must then still be a number-free, nan-free line.
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [28, first]}, f)
    env = dict(os.environ, PYTHONPATH=os.getcwd(), TENSORPAR_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "tensorpar", "generate", "--model", folder, "--tp", "2", "--chat",
                        "--prompt", "the cat", "--max-new-tokens", "6", "--fast-collectives", "off"],
                       capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "User: the cat\nAssistant: " in r.stdout
    assert "(1 token; no decode steps to time)" in r.stdout, r.stdout
    assert "nan" not in r.stdout
