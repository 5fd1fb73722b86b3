"""Vision transformers for image classification: transformers' ViT (``ViTForImageClassification``), DINOv2
(``Dinov2ForImageClassification``) and SigLIP's vision tower (``SiglipForImageClassification``, model_type
``siglip``: the vision config is ``config.vision_config``; the attention-pooling head, which the classifier
does not use, is replicated).

Each encoder block: bidirectional attention split by whole heads (q/k/v column-parallel, ``heads x head_dim``
rows, ``head_dim`` may differ from ``hidden / heads``; ``o_proj`` row-parallel), MLP column -> row (``fc1`` /
``fc2``; DINOv2's SwiGLU variant gate/up -> down), LayerNorms (and DINOv2's layer scales) replicated. The patch
embedding (a strided convolution), the class token, the position embeddings, the final norm and the classifier
are replicated: the classification logits ``[b, num_labels]`` are the same full tensor on every rank (no vocab
partition: :attr:`ShardingPlan.vocab` is ``None``). The model is built with ``AutoModelForImageClassification``
(:data:`tensorpar.hf.families.MODEL_CLASSES`).
"""
from __future__ import annotations

from tensorpar.hf.plan import ShardingPlan, head_layout
from tensorpar.hf.styles import MLP, EncoderAttention, Entry, GatedMLP, Replicated
from tensorpar.shard import Partition

_HEAD = "classification head [num_labels, hidden]: logits replicated"


def _check(sequence_parallel, model_type):
    if sequence_parallel:
        raise ValueError(f"sequence_parallel=True is not supported for {model_type} (encoder blocks take the whole "
                         f"sequence); run it with sequence_parallel=False")


def vit_plan(config, tp_size, *, sequence_parallel, head_split_weights, split_weights) -> ShardingPlan:
    _check(sequence_parallel, "vit")
    heads = head_layout(config, tp_size, head_split_weights)
    inter = Partition.make(config.intermediate_size, tp_size, weights=split_weights, name="intermediate_size")
    e = [Entry("vit.embeddings", Replicated(why="patch conv, class token, position embeddings")),
         Entry("vit.layers.*.attention", EncoderAttention(heads)),
         Entry("vit.layers.*.mlp", MLP(inter, up="fc1", down="fc2")),
         Entry("vit.layers.*.layernorm_*", Replicated()),
         Entry("vit.layernorm", Replicated()),
         Entry("classifier", Replicated(why=_HEAD))]
    return ShardingPlan("vit", tp_size, False, heads, None, inter, False, config.num_hidden_layers,
                        "vit.layers.*", e)


def dinov2_intermediate(config) -> int:
    """The MLP hidden size transformers builds for a DINOv2 config (``hidden * mlp_ratio``; SwiGLU keeps two
    thirds of it rounded up to a multiple of 8, as ``Dinov2SwiGLUFFN`` does)."""
    f = int(config.hidden_size * config.mlp_ratio)
    return (int(f * 2 / 3) + 7) // 8 * 8 if config.use_swiglu_ffn else f


def dinov2_plan(config, tp_size, *, sequence_parallel, head_split_weights, split_weights) -> ShardingPlan:
    _check(sequence_parallel, "dinov2")
    heads = head_layout(config, tp_size, head_split_weights)
    inter = Partition.make(dinov2_intermediate(config), tp_size, weights=split_weights, name="MLP hidden size")
    mlp = GatedMLP(inter) if config.use_swiglu_ffn else MLP(inter, up="fc1", down="fc2")
    e = [Entry("dinov2.embeddings", Replicated(why="patch conv, class/mask tokens, position embeddings")),
         Entry("dinov2.encoder.layer.*.attention", EncoderAttention(heads)),
         Entry("dinov2.encoder.layer.*.mlp", mlp),
         Entry("dinov2.encoder.layer.*.norm*", Replicated()),
         Entry("dinov2.encoder.layer.*.layer_scale*", Replicated(why="per-channel scale")),
         Entry("dinov2.layernorm", Replicated()),
         Entry("classifier", Replicated(why=_HEAD))]
    return ShardingPlan("dinov2", tp_size, False, heads, None, inter, False, config.num_hidden_layers,
                        "dinov2.encoder.layer.*", e)


def siglip_plan(config, tp_size, *, sequence_parallel, head_split_weights, split_weights) -> ShardingPlan:
    _check(sequence_parallel, "siglip")
    vc = config.vision_config
    heads = head_layout(vc, tp_size, head_split_weights)
    inter = Partition.make(vc.intermediate_size, tp_size, weights=split_weights, name="intermediate_size")
    p = "vision_model"
    e = [Entry(f"{p}.embeddings", Replicated(why="patch conv, position embeddings")),
         Entry(f"{p}.encoder.layers.*.self_attn", EncoderAttention(heads, o_name="out_proj")),
         Entry(f"{p}.encoder.layers.*.mlp", MLP(inter, up="fc1", down="fc2")),
         Entry(f"{p}.encoder.layers.*.layer_norm*", Replicated()),
         Entry(f"{p}.post_layernorm", Replicated())]
    if getattr(vc, "vision_use_head", True):
        e.append(Entry(f"{p}.head", Replicated(why="attention-pooling head (not used by the classifier)")))
    e.append(Entry("classifier", Replicated(why=_HEAD)))
    return ShardingPlan("siglip", tp_size, False, heads, None, inter, False, vc.num_hidden_layers,
                        f"{p}.encoder.layers.*", e)


from tensorpar.hf.families.record import Family  # noqa: E402

_CLASSIFIER = "AutoModelForImageClassification"
RECORDS = (Family("vit", vit_plan, _CLASSIFIER), Family("dinov2", dinov2_plan, _CLASSIFIER),
           Family("siglip", siglip_plan, _CLASSIFIER))
