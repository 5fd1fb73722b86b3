"""Sharded load: each rank owns contiguous tensors of exactly its shard, read with plain file reads;
checkpoint tensors are checked against the config in both directions before any rank computes;
``--model`` resolves hub ids from the local Hugging Face cache; the chosen attention survives sharding.

Loading needs no collective, so most tests build rank ``r`` of ``tp`` in this process with a one-rank
view ``Group(pg=None, rank=r, size=tp)``; the multi-process path is covered by tests/decode/test_generate.py.
The right values come from the file itself (``safetensors.torch.load_file``) indexed with plain torch.
"""
import argparse
import json

import pytest
import torch

from tensorpar.comm import Group
from tensorpar.hf import load
from tensorpar.hf.load import SafetensorsReader, build_parallel_model, check_checkpoint, read_shard

LLAMA = dict(model_type="llama", vocab_size=53, hidden_size=36, intermediate_size=40, num_hidden_layers=3,
             num_attention_heads=9, num_key_value_heads=3, head_dim=4, max_position_embeddings=64,
             tie_word_embeddings=False)
GPT2 = dict(model_type="gpt2", vocab_size=53, n_embd=24, n_layer=2, n_head=6, n_positions=64,
            tie_word_embeddings=True)


def make_folder(path, kw, dtype=torch.float32, seed=0):
    from transformers import AutoConfig, AutoModelForCausalLM
    kw = dict(kw)
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("load")
    return {"llama": make_folder(root / "llama", LLAMA), "gpt2": make_folder(root / "gpt2", GPT2),
            "llama_bf16": make_folder(root / "llama_bf16", LLAMA, dtype=torch.bfloat16, seed=1),
            "llama_tied": make_folder(root / "llama_tied", dict(LLAMA, tie_word_embeddings=True), seed=2)}


def file_tensors(folder):
    from safetensors.torch import load_file
    return load_file(str(folder / "model.safetensors"))


def expected_slice(full, p, rank):
    """The rows of the file tensor that ``p`` holds on ``rank``, by plain indexing."""
    dim = getattr(p, "tp_dim", None)
    if dim is None:
        return full
    return full.index_select(dim, torch.tensor(p.tp_partition.indices(rank)))


def build(folder, rank, tp, **kw):
    model, plan = build_parallel_model(folder, Group(pg=None, rank=rank, size=tp), **kw)
    return model, plan


# ------------------------------------------------------------------------------------------ reader

def test_reader_reads_any_selection_of_any_dtype(tmp_path):
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(0)
    tensors = {"f32": torch.randn(7, 5, 3, generator=g), "bf16": torch.randn(11, 6, generator=g).bfloat16(),
               "f16": torch.randn(13, generator=g).half(), "i64": torch.randint(-9, 9, (4, 9), generator=g),
               "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4)}
    save_file(tensors, str(tmp_path / "t.safetensors"))
    with SafetensorsReader(tmp_path / "t.safetensors") as r:
        assert sorted(r.keys()) == sorted(tensors)
        for name, full in tensors.items():
            assert torch.equal(r.read(name), full) and r.shape(name) == tuple(full.shape)
            for dim in range(full.dim()):
                n = full.shape[dim]
                for idx in ([0], list(range(n)), list(range(1, n, 2)), [i for i in range(n) if i % 3 != 1]):
                    idx = [i for i in idx if i < n]
                    want = full.index_select(dim, torch.tensor(idx, dtype=torch.long))
                    assert torch.equal(r.read(name, dim=dim, indices=idx), want), (name, dim, idx)
                    for dt in (torch.float64, torch.bfloat16):  # conversion through a tiny bounce buffer
                        got = r.read(name, dim=dim, indices=idx, dtype=dt, bounce_bytes=8)
                        assert got.dtype == dt and torch.equal(got, want.to(dt)), (name, dim, idx, dt)
        with pytest.raises(ValueError, match="contiguous tensor of shape"):
            r.read("f32", out=torch.empty(7, 5, 4))


def test_truncated_file_is_a_clear_error(tmp_path):
    from safetensors.torch import save_file
    save_file({"w": torch.randn(64, 64)}, str(tmp_path / "t.safetensors"))
    data = (tmp_path / "t.safetensors").read_bytes()
    (tmp_path / "t.safetensors").write_bytes(data[:-100])
    with SafetensorsReader(tmp_path / "t.safetensors") as r, pytest.raises(ValueError, match="truncated"):
        r.read("w")


# ------------------------------------------------------------------------- sharded load (16.4, 9.2)

@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_each_rank_owns_exactly_its_shard(folders, arch):
    """Every parameter is a contiguous tensor whose storage is exactly its own bytes (before: views
    into the memory-mapped file, whose storage is the whole mapping) and equals the file's slice."""
    folder = folders[arch]
    full = file_tensors(folder)
    for tp in (1, 2, 3):
        for rank in range(tp):
            model, _ = build(folder, rank, tp)
            for name, p in model.named_parameters():
                assert p.is_contiguous(), name
                assert p.untyped_storage().nbytes() == p.numel() * p.element_size(), (
                    f"{name}: storage of {p.untyped_storage().nbytes()} bytes for a shard of "
                    f"{p.numel() * p.element_size()}")
                key = name if name in full else "transformer.wte.weight" if name == "lm_head.weight" else name
                assert torch.equal(p.data, expected_slice(full[key], p, rank)), f"{arch} tp={tp} rank {rank}: {name}"


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_vocab_not_divisible_by_tp_gives_each_rank_the_checkpoint_rows(folders, tp):
    """Vocabulary 53 (prime): concatenating the ranks' embedding and LM-head rows gives the file's tensors."""
    folder = folders["llama"]
    full = file_tensors(folder)
    emb, head = [], []
    for rank in range(tp):
        model, plan = build(folder, rank, tp)
        assert model.model.embed_tokens.weight.shape[0] == plan.vocab.sizes[rank]
        emb.append(model.model.embed_tokens.weight.data)
        head.append(model.lm_head.weight.data)
    assert len({e.shape[0] for e in emb}) > 1  # really uneven
    assert torch.equal(torch.cat(emb), full["model.embed_tokens.weight"])
    assert torch.equal(torch.cat(head), full["lm_head.weight"])


def test_bf16_file_into_fp32_model(folders, monkeypatch):
    """Conversion goes through the bounce buffer in chunks (made tiny here) into the fp32 parameters."""
    monkeypatch.setattr(load.reader, "BOUNCE_BYTES", 96)  # read by SafetensorsReader, in load.reader
    folder = folders["llama_bf16"]
    full = file_tensors(folder)
    for rank in range(2):
        model, _ = build(folder, rank, 2, dtype=torch.float32)
        for name, p in model.named_parameters():
            assert p.dtype == torch.float32 and p.untyped_storage().nbytes() == p.numel() * 4, name
            assert torch.equal(p.data, expected_slice(full[name], p, rank).float()), name


def test_read_shard_accepts_a_safe_open_handle(folders):
    """train/checkpoint.py passes a ``safe_open`` handle: same values as the plain-read path."""
    from safetensors import safe_open
    folder = folders["llama"]
    model, _ = build(folder, 1, 3)
    p = model.model.layers[0].self_attn.o_proj.weight
    with safe_open(str(folder / "model.safetensors"), framework="pt") as h, \
            SafetensorsReader(folder / "model.safetensors") as r:
        a = read_shard(h, "model.layers.0.self_attn.o_proj.weight", p, 1)
        b = read_shard(r, "model.layers.0.self_attn.o_proj.weight", p, 1)
    assert torch.equal(a, b) and torch.equal(b, p.data)


# --------------------------------------------------------------------------- checkpoint vs config (14.3)

def _edit_config(src, dest, **changes):
    import shutil
    shutil.copytree(src, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg.update(changes)
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def test_fewer_layers_in_config_than_in_checkpoint_is_refused(folders, tmp_path):
    folder = _edit_config(folders["llama"], tmp_path / "m", num_hidden_layers=2)
    with pytest.raises(ValueError, match=r"num_hidden_layers=2\): 9 checkpoint tensors are not used by the model "
                                         r"\(model\.layers\.2\.input_layernorm\.weight, "):
        check_checkpoint(folder)
    with pytest.raises(ValueError, match="not used by the model"):
        build(folder, 0, 2)


def test_more_layers_in_config_than_in_checkpoint_is_refused(folders, tmp_path):
    folder = _edit_config(folders["llama"], tmp_path / "m", num_hidden_layers=4)
    with pytest.raises(ValueError, match=r"9 tensors the model needs are missing \(model\.layers\.3\."):
        check_checkpoint(folder)


def test_wrong_shape_is_refused(folders, tmp_path):
    folder = _edit_config(folders["llama"], tmp_path / "m", intermediate_size=44)
    with pytest.raises(ValueError, match=r"wrong shape.*\[40, 36\] \(model expects \[44, 36\]\)"):
        check_checkpoint(folder)


def test_quantized_tensor_is_refused(folders, tmp_path):
    from safetensors.torch import save_file
    import shutil
    folder = tmp_path / "m"
    shutil.copytree(folders["llama"], folder)
    t = file_tensors(folder)
    t["model.norm.weight"] = t["model.norm.weight"].to(torch.int8)
    save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.norm\.weight stored as I8"):
        check_checkpoint(folder)


def test_tied_head_and_buffers_are_not_errors(folders, tmp_path):
    """lm_head absent under tie_word_embeddings, or present; a stored rotary inv_freq: all accepted."""
    from safetensors.torch import save_file
    import shutil
    tied = folders["llama_tied"]
    assert "lm_head.weight" not in file_tensors(tied)
    check_checkpoint(tied)
    folder = tmp_path / "m"
    shutil.copytree(tied, folder)
    t = file_tensors(folder)
    t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
    t["model.rotary_emb.inv_freq"] = torch.ones(2)
    save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})
    check_checkpoint(folder)
    model, _ = build(folder, 1, 2)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    check_checkpoint(folders["gpt2"])


def test_generate_validate_refuses_the_mismatch_before_launch(folders, tmp_path):
    from tensorpar.generate import add_arguments, validate
    folder = _edit_config(folders["llama"], tmp_path / "m", num_hidden_layers=2)
    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(ValueError, match="not used by the model"):
        validate(p.parse_args(["--model", str(folder), "--tp", "2"]))


# ------------------------------------------------------------------------------ models from anywhere (9.5)

def test_hub_id_from_the_local_cache(folders, tmp_path, monkeypatch):
    """A hub cache laid out as huggingface_hub writes it; no network is used (local_files_only)."""
    import shutil

    import huggingface_hub.constants as hc

    from tensorpar import hub
    cache = tmp_path / "hub"
    repo = cache / "models--tp-test--tiny-llama"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(folders["llama"], repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    got = hub.resolve_model("tp-test/tiny-llama")
    assert got == (repo / "snapshots" / commit).resolve()
    with pytest.raises(FileNotFoundError, match=r"'tp-test/not-there'.*not in the local Hugging Face hub cache.*"
                                                r"hf download tp-test/not-there"):
        hub.resolve_model("tp-test/not-there")


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_attention_implementation_is_kept_after_sharding(folders, impl):
    """The chosen attention runs: eager returns the attention probabilities, SDPA returns none."""
    model, _ = build(folders["llama"], 0, 1, attn_implementation=impl)
    attn = model.model.layers[0].self_attn
    assert model.config._attn_implementation == impl and attn.config._attn_implementation == impl
    seen = []
    attn.register_forward_hook(lambda m, i, o: seen.append(o[1]))
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3, 4]]))
    assert (seen[0] is not None) == (impl == "eager")
    if impl == "eager":
        assert seen[0].shape == (1, 9, 4, 4)


def test_checkpoint_without_the_base_model_prefix_loads(folders, tmp_path):
    """Hub GPT-2 checkpoints name tensors ``h.0...`` for ``transformer.h.0...`` (transformers accepts both)."""
    from safetensors.torch import save_file
    import shutil
    folder = tmp_path / "m"
    shutil.copytree(folders["gpt2"], folder)
    full = file_tensors(folder)
    short = {k.removeprefix("transformer."): v for k, v in full.items()}
    short["h.0.attn.bias"] = torch.ones(1, 1, 4, 4)  # the legacy causal-mask buffer transformers ignores
    save_file(short, str(folder / "model.safetensors"), metadata={"format": "pt"})
    check_checkpoint(folder)
    model, _ = build(folder, 1, 2)
    for name, p in model.named_parameters():
        key = "transformer.wte.weight" if name == "lm_head.weight" else name
        assert torch.equal(p.data, expected_slice(full[key], p, 1)), name


@pytest.mark.network
def test_smollm2_config_of_20_layers_over_30_layers_of_weights_is_refused(tmp_path):
    """The case of issue 14: headers only, so this takes about a second once SmolLM2 is cached."""
    from transformers import AutoConfig

    from tensorpar.hub import resolve_model
    folder = resolve_model("smollm2", progress=False)
    config = AutoConfig.from_pretrained(folder)
    check_checkpoint(folder, config)
    config.num_hidden_layers = 20
    with pytest.raises(ValueError, match=r"num_hidden_layers=20\): 90 checkpoint tensors are not used by the model "
                                         r"\(model\.layers\.20\.input_layernorm\.weight, "):
        check_checkpoint(folder, config)
