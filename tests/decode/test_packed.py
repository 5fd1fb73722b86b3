"""oneDNN-packed weights replace the plain ones (tensorpar/decode/packed.py; issue 28, item 4): after a decoder is
built and has decoded, a rank holds its weights once (not the plain and the packed copy), and every reader of the
plain weights (``state_dict``, the module path's forward) gets the values it got before packing, bit for bit."""
import pytest
import torch

from tests.decode.test_generate import ARCHS, make_model_folder, prompts


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed")
    return {a: make_model_folder(root / a, a) for a in ("llama", "qwen2")}


def _held_bytes(model, lean) -> int:
    """Distinct storages (packed tensors by object) held by ``model`` and by ``lean``'s per-layer weights and LM
    head: what the two together keep resident (:func:`resident_weight_bytes` over both)."""
    from tensorpar.decode.quantize import resident_weight_bytes
    holder = torch.nn.Module()
    holder.model = model
    holder.__dict__["lean"] = [[L.wqkv, L.wo, L.wgu, L.wd] for L in lean.layers] + [lean.lm_w]
    return resident_weight_bytes(holder)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])       # tied LM head (stays plain), untied (packed)
def test_packed_weights_replace_the_plain_ones(folders, arch, dtype):
    from tensorpar.decode.kernels import can_pack
    from tensorpar.decode.lean import LeanDecoder
    from tensorpar.decode.packed import packed_model, packed_weight_bytes, unpack_weights
    from tensorpar.decode.quantize import resident_weight_bytes
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.parallel import ParallelContext
    ctx = ParallelContext.single()
    model, _ = build_parallel_model(folders[arch], ctx.tp, dtype=dtype)
    if not can_pack(model.lm_head.weight):
        pytest.skip(f"this CPU's oneDNN does not run {dtype}: the decoder does not prepack")
    shard = resident_weight_bytes(model)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    names = [n for n, _ in model.named_parameters()]
    ids, mask = prompts(ARCHS[arch]["vocab_size"])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        module_before = model(ids, attention_mask=mask).logits

    lean = LeanDecoder(model, ctx.tp, max_batch=ids.shape[0], max_len=ids.shape[1] + 4, prepack=True)
    assert lean.packed
    tok = lean.prefill(ids, mask, pos).argmax(-1, keepdim=True)
    for t in range(4):
        tok = lean.decode(tok, pos[:, -1:] + 1 + t, ids.shape[1] + t).argmax(-1, keepdim=True)
    held = _held_bytes(model, lean)
    # 1.1: issue 28's bound; oneDNN's padding is not counted (numel * element_size). Before the fix the packed
    # copies sat beside the plain weights: 1.8x-2.0x here
    assert held <= 1.1 * shard, f"{arch} {dtype}: model + decoder hold {held} bytes, the shard is {shard}"
    assert packed_model(model) and packed_weight_bytes(model) > 0.5 * shard, "the matmul weights were not packed"
    # what tensorpar.speed and bench_decode count as the bytes a token reads: parameters + packed weights
    assert sum(p.numel() * p.element_size() for p in model.parameters()) + packed_weight_bytes(model) == param_bytes

    got = model.state_dict()
    assert list(got) == list(state), "state_dict keys changed (or their order)"
    for k, v in state.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    with torch.no_grad():
        module_after = model(ids, attention_mask=mask).logits        # the modules convert one matrix at a time
    assert torch.equal(module_after, module_before)
    with pytest.raises(RuntimeError, match="[Ii]nference"):
        model.model.layers[0].mlp.down_proj.weight.mul_(2)             # a converted copy: writing to it is refused

    unpack_weights(model)
    assert not packed_model(model) and [n for n, _ in model.named_parameters()] == names
    assert resident_weight_bytes(model) == shard
    a = model.model.layers[0].self_attn
    assert a.k_proj.weight.untyped_storage().data_ptr() == a.__dict__["_lean_fused"][0].untyped_storage().data_ptr()
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
