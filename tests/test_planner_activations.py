"""The activation model against what autograd really keeps, for Hugging Face Llama code on CPU.

A tensor-parallel rank of a layer computes the same tensors as a layer with the rank's heads and MLP
columns (the replicated norms stay full size), so a "rank-shaped" Llama with ``num_heads / tp`` heads and
``ffn / tp`` columns and an explicit head_dim stands in for a rank here, without any process group.
The tensor-parallel run itself is checked by the calibration tests.
"""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tensorpar.planner.calibrate import peak_memory_bytes, saved_activation_bytes  # noqa: E402
from tensorpar.planner.layout import Assumptions, Layout, Workload  # noqa: E402
from tensorpar.planner.memory import layer_activation_terms, memory_per_device  # noqa: E402
from tensorpar.planner.model_spec import from_dims  # noqa: E402
from tensorpar.planner.partition import RankHeads  # noqa: E402

H, HEADS, FFN, VOCAB, B, S = 256, 8, 640, 1000, 2, 96


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls: threads only contend (the CI machine has two cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def llama(layers, heads, kv_heads, ffn, dtype, attention, vocab=VOCAB):
    cfg = transformers.LlamaConfig(hidden_size=H, intermediate_size=ffn, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=H // HEADS,
                                   vocab_size=vocab, tie_word_embeddings=False, attn_implementation=attention)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(dtype)


def saved(model, batch=B, seq=S):
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    _, nbytes = saved_activation_bytes(lambda: model(input_ids=ids, labels=ids), params=model.parameters())
    return nbytes


FP32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize("dtype,attention,kv_heads,tp", [
    (FP32, "eager", 8, 1),  # multi-head attention
    (FP32, "eager", 2, 2),  # GQA: eager attention materialises K/V repeated to the query heads
    (BF16, "eager", 2, 1),  # fp32 RMSNorm and softmax inside a bf16 model
    (FP32, "sdpa", 8, 2),
    (BF16, "sdpa", 2, 2),  # fused kernel: compact K/V, logsumexp instead of scores
], ids=lambda v: str(v).removeprefix("torch."))
def test_layer_bytes_match_autograd_exactly(dtype, attention, kv_heads, tp):
    rank_heads, rank_kv = HEADS // tp, max(1, kv_heads // tp)
    per_layer = (saved(llama(4, rank_heads, rank_kv, FFN // tp, dtype, attention))
                 - saved(llama(2, rank_heads, rank_kv, FFN // tp, dtype, attention))) / 2
    spec = from_dims(layers=4, hidden=H, heads=HEADS, kv_heads=kv_heads, ffn=FFN, vocab=VOCAB)
    e = torch.tensor([], dtype=dtype).element_size()
    predicted = layer_activation_terms(spec, RankHeads(rank_heads, rank_kv), micro_batch=B, seq_len=S, tp=tp,
                                       sequence_parallel=False, recompute="none",
                                       assume=Assumptions(activation_bytes=e, attention=attention))
    assert sum(predicted.values()) == per_layer, predicted


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_whole_model_bytes_match_autograd(attention):
    model = llama(2, HEADS, 2, FFN, torch.float32, attention)
    spec = from_dims(layers=2, hidden=H, heads=HEADS, kv_heads=2, ffn=FFN, vocab=VOCAB)
    predicted = memory_per_device(spec, Layout(1, 1, 1, B), Workload(B, S),
                                  Assumptions(activation_bytes=4, param_bytes=4, grad_bytes=4, attention=attention))
    # Everything but the 4-byte scalar loss kept by the loss' backward.
    assert predicted.activations == pytest.approx(saved(model), abs=16)


def test_training_step_peak_within_15_percent_at_tp1():
    """Peak live memory of a real forward + backward, above the weights, against the predicted
    activations (the issue's calibration check, at tp=1 where no process group is needed)."""
    vocab, batch, seq = 512, 4, 256
    model = llama(4, HEADS, 2, FFN, torch.float32, "eager", vocab=vocab)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(2))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()

    _, peak = peak_memory_bytes(step, baseline=[*model.parameters(), ids])
    spec = from_dims(layers=4, hidden=H, heads=HEADS, kv_heads=2, ffn=FFN, vocab=vocab)
    predicted = memory_per_device(spec, Layout(1, 1, 1, batch), Workload(batch, seq),
                                  Assumptions(activation_bytes=4, param_bytes=4, grad_bytes=4, attention="eager"))
    assert peak == pytest.approx(predicted.activations, rel=0.15), (peak, predicted.activations)
