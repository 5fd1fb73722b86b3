"""bench/bench_llamacpp.py's F32 GGUF writer (the 1.1B random Llama's file for llama.cpp), checked by transformers'
own GGUF reader: a tiny random Llama written with ``write_f32_gguf`` and read back with ``gguf_file=`` has the
original's tensors and logits exactly (F32 in, F32 out; transformers undoes the q/k row permutation llama.cpp's
converter applies, so a missing or wrong permutation shows up as a mismatch)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

# heads 4 / KV heads 2 (GQA: k_proj is permuted with its own head count); vocab > 259 (the placeholder
# SentencePiece vocabulary's 3 specials + 256 byte tokens)
CONFIG = dict(model_type="llama", vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
              rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def test_write_f32_gguf_reads_back_equal_in_transformers(tmp_path):
    from bench_llamacpp import write_f32_gguf
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.set_num_threads(1)
    kw = dict(CONFIG)
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():       # norms away from 1, so a swapped norm would show
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(1.0, 0.1)
    model.save_pretrained(tmp_path)
    info = write_f32_gguf(tmp_path, tmp_path / "m.gguf", CONFIG)
    assert info["bytes"] == (tmp_path / "m.gguf").stat().st_size
    back = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    want, got = model.state_dict(), back.state_dict()
    assert set(want) == set(got)
    for k in want:      # exact: F32 written, F32 read, the permutation is a reordering
        assert torch.equal(want[k], got[k]), k
    ids = torch.randint(3, CONFIG["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, back(ids).logits)
