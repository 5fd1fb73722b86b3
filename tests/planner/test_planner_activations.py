"""The activation model against what autograd really keeps, for a Hugging Face Llama sharded by
tensorpar, on CPU, without any process group.

A tensor-parallel rank of a layer computes the same tensors as the layer of a "rank-shaped" model with
the rank's query and KV heads and MLP columns (the replicated norms stay full size), so such a model at
tp = 1 stands in for one rank of tp = 2. The real multi-rank runs are in test_planner_calibration.py.
"""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tensorpar.comm import Group  # noqa: E402
from tensorpar.hf.apply import parallelize  # noqa: E402
from tensorpar.hf.plan import make_plan  # noqa: E402
from tensorpar.layers import vocab_parallel_cross_entropy  # noqa: E402
from tensorpar.planner.calibrate import saved_activation_bytes  # noqa: E402
from tensorpar.planner.layout import Assumptions, Layout, Workload  # noqa: E402
from tensorpar.planner.memory import layer_activation_terms, memory_per_device  # noqa: E402
from tensorpar.planner.model_spec import from_dims  # noqa: E402
from tensorpar.planner.partition import RankHeads  # noqa: E402

H, HEADS, FFN, VOCAB, B, S = 256, 8, 640, 1000, 2, 96
FP32, BF16 = torch.float32, torch.bfloat16


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls: threads only contend (the CI machine has two cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def sharded_llama(layers, heads, kv_heads, ffn, dtype, attention):
    """A Llama with ``heads`` query heads of size H / HEADS, through tensorpar's modules at tp = 1."""
    cfg = transformers.LlamaConfig(hidden_size=H, intermediate_size=ffn, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=H // HEADS,
                                   vocab_size=VOCAB, tie_word_embeddings=False)
    cfg._attn_implementation = attention
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(dtype)
    return parallelize(model, make_plan(cfg, 1), Group.single())


def saved(model):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (B, S), generator=gen)
    targets = torch.randint(0, VOCAB, (B, S), generator=gen)

    def forward():
        logits = model(input_ids=ids).logits
        return vocab_parallel_cross_entropy(logits, targets, Group.single(), partition=logits.shape[-1])

    return saved_activation_bytes(forward, params=model.parameters())[1]


@pytest.mark.parametrize("dtype,attention,kv_heads,tp", [
    (FP32, "eager", 8, 1),  # multi-head attention
    (FP32, "eager", 2, 2),  # GQA: KV heads expanded to the rank's query heads
    (BF16, "eager", 2, 1),  # fp32 RMSNorm and softmax inside a bf16 model
    (FP32, "sdpa", 8, 2),
    (BF16, "sdpa", 2, 2),  # fused kernel: logsumexp instead of scores
], ids=lambda v: str(v).removeprefix("torch."))
def test_layer_bytes_match_autograd_exactly(dtype, attention, kv_heads, tp):
    rank_heads, rank_kv = HEADS // tp, max(1, kv_heads // tp)
    per_layer = (saved(sharded_llama(4, rank_heads, rank_kv, FFN // tp, dtype, attention))
                 - saved(sharded_llama(2, rank_heads, rank_kv, FFN // tp, dtype, attention))) / 2
    spec = from_dims(layers=4, hidden=H, heads=HEADS, kv_heads=kv_heads, ffn=FFN, vocab=VOCAB)
    e = torch.tensor([], dtype=dtype).element_size()
    predicted = layer_activation_terms(spec, RankHeads(rank_heads, rank_kv), micro_batch=B, seq_len=S, tp=tp,
                                       sequence_parallel=False, recompute="none",
                                       assume=Assumptions(activation_bytes=e, attention=attention))
    assert sum(predicted.values()) == per_layer, predicted


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_whole_model_bytes_match_autograd(attention):
    model = sharded_llama(2, HEADS, 2, FFN, FP32, attention)
    spec = from_dims(layers=2, hidden=H, heads=HEADS, kv_heads=2, ffn=FFN, vocab=VOCAB)
    predicted = memory_per_device(spec, Layout(1, 1, 1, B), Workload(B, S),
                                  Assumptions(activation_bytes=4, param_bytes=4, grad_bytes=4, attention=attention))
    # Everything but the scalars of the loss' mean (the count of targets).
    assert predicted.activations == pytest.approx(saved(model), abs=16)
