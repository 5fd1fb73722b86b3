"""What the planner needs to know about a decoder-only transformer: its dimensions and the few
architectural choices that change parameter counts, FLOPs or stored activations.

A :class:`ModelSpec` comes from a preset name, a Hugging Face ``config.json`` or explicit dimensions.
All sizes here are *global* (whole model); per-rank sizes come from :mod:`tensorpar.planner.partition`.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import MappingProxyType

MLP_KINDS = ("gelu", "swiglu")
NORM_KINDS = ("layernorm", "rmsnorm")
KERNEL_KINDS = ("megatron", "hf")
# Hugging Face model types whose MLP has two matrices (up, down); the other Llama-like configs
# (llama, mistral, qwen2, gemma, ...) use a gated MLP with three, whatever the activation.
UNGATED_MODEL_TYPES = frozenset({"gpt_neox", "gptj", "phi", "falcon", "opt", "bloom", "starcoder2", "gpt_bigcode"})
# ... and those whose norms are LayerNorm (weight and bias) rather than RMSNorm.
LAYERNORM_MODEL_TYPES = frozenset({"gpt_neox", "gptj", "phi", "falcon", "opt", "bloom", "starcoder2", "gpt_bigcode",
                                   "stablelm"})


@dataclass(frozen=True)
class ModelSpec:
    """Global dimensions of a decoder-only transformer.

    ``mlp``: "gelu" has two matrices (h->ffn->h), "swiglu" is a gated MLP with three (gate, up, down;
    also stands for GeGLU, which has the same shapes).
    ``kernels``: whose code runs the model, which decides what autograd stores and which collectives run:
    "megatron" (Megatron-LM's fused LayerNorm/softmax kernels; activations exactly as Korthikanti et al.
    2022, Table 2) or "hf" (Hugging Face modeling code sharded by tensorpar.hf: RMSNorm upcast to fp32,
    fp32 softmax, KV heads expanded per rank, tensorpar's collectives).
    ``learned_positions``: rows of a learned absolute position table (GPT); 0 for rotary.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    mlp: str = "swiglu"
    norm: str = "rmsnorm"
    bias: bool = False
    dropout: bool = False
    tied_embeddings: bool = False
    learned_positions: int = 0
    kernels: str = "hf"
    max_positions: int = 0  # longest sequence the model has positions for; 0: unknown (not checked)
    # Mixture of experts: ``num_experts`` MLPs of ``ffn_hidden_size`` each, ``experts_per_token`` of them
    # run per token (top-k), plus an always-on shared expert of ``shared_ffn`` (0: none). 0 experts: dense.
    num_experts: int = 0
    experts_per_token: int = 0
    shared_ffn: int = 0

    def __post_init__(self) -> None:
        for knob in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size"):
            value = getattr(self, knob)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model {knob} ({value!r}) must be a positive integer")
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"model hidden_size ({self.hidden_size}) is not divisible by num_heads ({self.num_heads}); "
                    "give head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_kv_heads > self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads}) "
                "(grouped-query attention needs whole groups)"
            )
        for knob in ("max_positions", "num_experts", "experts_per_token", "shared_ffn"):
            if not isinstance(getattr(self, knob), int) or getattr(self, knob) < 0:
                raise ValueError(f"model {knob} ({getattr(self, knob)!r}) must be an integer >= 0")
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"model experts_per_token ({self.experts_per_token}) must be in 1..num_experts "
                             f"({self.num_experts})")
        for knob, allowed in (("mlp", MLP_KINDS), ("norm", NORM_KINDS), ("kernels", KERNEL_KINDS)):
            if getattr(self, knob) not in allowed:
                raise ValueError(f"model {knob} ({getattr(self, knob)!r}) must be one of {', '.join(allowed)}")

    def check_seq_len(self, seq_len: int, what: str = "--seq") -> None:
        """Raises ValueError when ``seq_len`` exceeds the positions the model was built for; ``what`` names the
        setting(s) it came from (e.g. ``"--prompt-len + --max-new-tokens (8000 + 512)"``)."""
        if self.max_positions and seq_len > self.max_positions:
            shown = f"{what} ({seq_len})" if what == "--seq" else f"{what} = {seq_len}"
            raise ValueError(f"{shown} is longer than the {self.max_positions} positions of {self.name}; "
                             f"use {'--seq' if what == '--seq' else 'a total'} <= {self.max_positions}")

    # ---- parameter counts (elements) -------------------------------------------------------------
    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of size hidden x ffn in one MLP: 2 for GeLU, 3 for SwiGLU."""
        return 3 if self.mlp == "swiglu" else 2

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def _shared_columns(self, ffn: float) -> float:
        """Shared-expert columns on a rank holding ``ffn`` columns of each expert (split like them)."""
        return self.shared_ffn * ffn / self.ffn_hidden_size

    def held_ffn(self, ffn: float, ep: int = 1) -> float:
        """MLP columns whose weights a rank holds: ``ffn`` of each of its ``num_experts / ep`` experts (of
        the one MLP when dense), plus its share of the shared expert."""
        return ffn * (self.num_experts / ep if self.is_moe else 1) + self._shared_columns(ffn)

    def expert_params(self, ffn: float, ep: int = 1) -> float:
        """Parameters of the routed experts of one layer on a rank holding ``ffn`` columns of each of its
        ``num_experts / ep`` experts (0 for a dense model): these are data-parallel over ``dp / ep`` ranks."""
        if not self.is_moe:
            return 0.0
        per_expert = self.mlp_matrices * self.hidden_size * ffn + (self.mlp_matrices - 1) * ffn * self.bias
        return self.num_experts / ep * per_expert

    def active_ffn(self, ffn: float) -> float:
        """MLP columns one token passes through on a rank holding ``ffn`` columns per expert: top-k
        experts (balanced routing, no capacity padding) plus the shared expert."""
        return ffn * (self.experts_per_token if self.is_moe else 1) + self._shared_columns(ffn)

    def norm_params(self) -> int:
        """Parameters of one norm layer: weight and bias for LayerNorm, weight for RMSNorm."""
        return 2 * self.hidden_size if self.norm == "layernorm" else self.hidden_size

    def layer_params(self, q_heads: int | None = None, kv_heads: int | None = None, ffn: int | None = None,
                     ep: int = 1) -> int:
        """Parameters of one transformer layer as held by one tensor-parallel rank.

        With no arguments: the whole layer. A rank holds ``q_heads`` query heads, ``kv_heads`` key/value
        heads and ``ffn`` columns of the MLP; norms and the biases of the two row-parallel linears
        (attention output, MLP down projection) are replicated on every rank.
        """
        h, d = self.hidden_size, self.head_dim
        q = self.num_heads if q_heads is None else q_heads
        kv = self.num_kv_heads if kv_heads is None else kv_heads
        f = self.ffn_hidden_size if ffn is None else ffn
        qkv = h * d * (q + 2 * kv)  # column-parallel
        out = q * d * h  # row-parallel
        mlp = self.mlp_matrices * h * self.held_ffn(f, ep) + h * self.num_experts  # experts, shared expert, router
        total = qkv + out + mlp + 2 * self.norm_params()
        if self.bias:
            gate_up = (self.mlp_matrices - 1) * self.held_ffn(f, ep)
            total += d * (q + 2 * kv) + h + gate_up + h
        return int(total)

    def embedding_params(self, vocab_rows: int | None = None) -> int:
        """Word-embedding parameters for ``vocab_rows`` rows (all rows by default)."""
        return (self.vocab_size if vocab_rows is None else vocab_rows) * self.hidden_size

    def total_params(self) -> int:
        """Whole-model parameter count: layers, embeddings (twice when untied), positions, final norm."""
        heads = self.num_layers * self.layer_params()
        emb = self.embedding_params() * (1 if self.tied_embeddings else 2)
        return heads + emb + self.learned_positions * self.hidden_size + self.norm_params()

    def to_dict(self) -> dict:
        return asdict(self)


def _megatron_gpt(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    """A GPT as Megatron-LM trains it in Narayanan et al. 2021 and Korthikanti et al. 2022: GeLU MLP of 4h,
    LayerNorm, biases, dropout, tied embeddings, learned positions for s = 2048, vocabulary padded to
    51200, Megatron kernels."""
    return ModelSpec(
        name=name, num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=heads,
        ffn_hidden_size=4 * hidden, vocab_size=51200, mlp="gelu", norm="layernorm", bias=True,
        dropout=True, tied_embeddings=True, learned_positions=2048, kernels="megatron", max_positions=2048,
    )


def _llama3(name: str, layers: int, hidden: int, heads: int, ffn: int) -> ModelSpec:
    # Llama 3 herd paper (Dubey et al. 2024), Table 3: 8 KV heads, vocabulary 128256, untied.
    return ModelSpec(
        name=name, num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=8,
        ffn_hidden_size=ffn, vocab_size=128256, max_positions=8192,
    )


def _smollm2(name: str, layers: int, hidden: int, heads: int, kv: int, ffn: int) -> ModelSpec:
    # HuggingFaceTB/SmolLM2-* config.json: Llama architecture, vocabulary 49152, tied embeddings.
    return ModelSpec(
        name=name, num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv,
        ffn_hidden_size=ffn, vocab_size=49152, tied_embeddings=True, max_positions=8192,
    )


PRESETS = MappingProxyType({
    # Brown et al. 2020, Table 2.1 (GPT-3 175B); the other three: Korthikanti et al. 2022, Table 3.
    "gpt3-175b": _megatron_gpt("gpt3-175b", 96, 12288, 96),
    "gpt-22b": _megatron_gpt("gpt-22b", 48, 6144, 64),
    "gpt-530b": _megatron_gpt("gpt-530b", 105, 20480, 128),
    "gpt-1t": _megatron_gpt("gpt-1t", 128, 25600, 160),
    "llama3-8b": _llama3("llama3-8b", 32, 4096, 32, 14336),
    "llama3-70b": _llama3("llama3-70b", 80, 8192, 64, 28672),
    "llama3-405b": _llama3("llama3-405b", 126, 16384, 128, 53248),
    "smollm2-135m": _smollm2("smollm2-135m", 30, 576, 9, 3, 1536),
    "smollm2-360m": _smollm2("smollm2-360m", 32, 960, 15, 5, 2560),
    "smollm2-1.7b": _smollm2("smollm2-1.7b", 24, 2048, 32, 32, 8192),
})
# "smollm2" names the smallest member, the one the library's tests shard (9 heads, 3 KV heads).
ALIASES = MappingProxyType({"smollm2": "smollm2-135m"})


def preset(name: str) -> ModelSpec:
    key = ALIASES.get(name, name)
    if key not in PRESETS:
        known = ", ".join(sorted([*PRESETS, *ALIASES]))
        raise ValueError(f"--model {name!r} is not a preset; use one of {known}, or a path to a config.json")
    return PRESETS[key]


def from_hf_config(config: dict | str | Path, name: str | None = None) -> ModelSpec:
    """Read a Hugging Face ``config.json`` (a dict or a path) of a Llama-like or GPT-2-like model."""
    where = None                    # what error messages name: the path given, else the model's name
    if not isinstance(config, dict):
        path = where = Path(config)
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"--model {path}: cannot read a config.json ({err})") from None
        name = name or (path.parent.name if path.name == "config.json" and path.parent.name else path.stem)
    name = name or config.get("_name_or_path") or config.get("model_type", "hf-model")
    _refuse_non_decoder(config, str(where or name))
    if "n_embd" in config:  # GPT-2 family naming
        hidden = config["n_embd"]
        return ModelSpec(
            name=name, num_layers=config["n_layer"], hidden_size=hidden, num_heads=config["n_head"],
            num_kv_heads=1 if config.get("multi_query") else config["n_head"],  # gpt_bigcode: multi-query
            ffn_hidden_size=config.get("n_inner") or 4 * hidden,
            vocab_size=config["vocab_size"], mlp="gelu", norm="layernorm", bias=True,
            dropout=any(config.get(k, 0) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")),
            tied_embeddings=config.get("tie_word_embeddings", True),
            learned_positions=config.get("n_positions", 0), max_positions=config.get("n_positions", 0),
        )
    required = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [key for key in required if key not in config and not (key == "intermediate_size" and
                                                                      "moe_intermediate_size" in config)]
    if missing:
        raise ValueError(
            f"config.json of {str(where or name)!r} lacks {', '.join(missing)}; the planner reads Llama-like configs "
            f"({', '.join(required)}) or GPT-2-like ones (n_layer, n_embd, n_head, vocab_size)"
        )
    kind = config.get("model_type", "")
    heads = config["num_attention_heads"]
    experts = int(config.get("num_local_experts") or config.get("num_experts") or 0)  # mixtral / qwen*_moe, olmoe
    moe = dict(
        num_experts=experts, experts_per_token=int(config.get("num_experts_per_tok") or 0) if experts else 0,
        shared_ffn=int(config.get("shared_expert_intermediate_size") or 0) if experts else 0,
    )
    ffn = config.get("moe_intermediate_size") if experts and config.get("moe_intermediate_size") else None
    return ModelSpec(
        name=name, num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
        num_heads=heads, num_kv_heads=config.get("num_key_value_heads") or heads,
        ffn_hidden_size=ffn or config["intermediate_size"], vocab_size=config["vocab_size"],
        head_dim=config.get("head_dim") or 0,
        mlp="gelu" if kind in UNGATED_MODEL_TYPES else "swiglu",
        norm="layernorm" if kind in LAYERNORM_MODEL_TYPES else "rmsnorm",
        bias=bool(config.get("attention_bias", False) or config.get("use_bias", False)),
        dropout=bool(config.get("attention_dropout", 0.0)),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_positions=int(config.get("max_position_embeddings") or 0),
        **moe,
    )


# Hugging Face model types whose config.json the planner reads correctly: each checked against the parameter count of
# the model transformers builds from it (tests/planner/test_planner_hf_configs.py). Others are refused rather than guessed:
# e.g. deepseek_v3 (MLA attention, routed experts in n_routed_experts), falcon, opt, bloom (other key names).
READ_MODEL_TYPES = frozenset({
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "starcoder2", "gpt_neox",
    "stablelm", "gpt2", "gpt_bigcode", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe",
})
# Hugging Face model types that are encoder-only (bidirectional, no causal LM head) or encoder-decoder.
ENCODER_MODEL_TYPES = frozenset({
    "bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2", "camembert",
    "mpnet", "ernie", "nomic_bert", "modernbert", "megatron-bert", "mobilebert", "layoutlm", "layoutlmv2",
    "layoutlmv3", "vit", "dinov2", "siglip_vision_model", "clip_vision_model",
    "t5", "mt5", "umt5", "bart", "mbart", "pegasus", "marian", "whisper", "longt5",
})
# ``architectures`` entries that are a causal LM head (what the planner models).
CAUSAL_HEADS = ("ForCausalLM", "LMHeadModel")


def _refuse_non_decoder(config: dict, name: str) -> None:
    """The planner models decoder-only (causal) transformers of the families in :data:`READ_MODEL_TYPES`.

    Raises ValueError (one line, naming the supported families) when the config is encoder-only or
    encoder-decoder (``is_encoder_decoder``, a known encoder model_type, or ``architectures`` naming no causal
    LM head: ``*ForMaskedLM``, ``*ForSequenceClassification``, a bare ``*Model`` ...), or when its model_type is
    not one the planner reads. A config without model_type is read by its key names (Llama-like or GPT-2-like)."""
    kind = config.get("model_type", "")
    archs = [str(a) for a in config.get("architectures") or []]
    causal = any(a.endswith(CAUSAL_HEADS) for a in archs)
    supported = ", ".join(sorted(READ_MODEL_TYPES))
    if (config.get("is_encoder_decoder") or kind in ENCODER_MODEL_TYPES or "bert" in kind
            or (archs and not causal)):
        raise ValueError(
            f"--model {name}: model_type {kind!r} ({', '.join(archs) or 'no architectures'}) is encoder-only or "
            f"encoder-decoder (no *ForCausalLM head); the planner plans decoder-only causal LMs of the families "
            f"{supported}"
        )
    if kind and kind not in READ_MODEL_TYPES:
        raise ValueError(
            f"--model {name}: model_type {kind!r} is not a family the planner reads (its config keys or attention "
            f"differ); supported: {supported}; or give --layers --hidden --heads --kv-heads --ffn --vocab"
        )


def from_dims(*, layers: int, hidden: int, heads: int, kv_heads: int | None = None, ffn: int | None = None,
              vocab: int, name: str = "custom", head_dim: int | None = None, **options) -> ModelSpec:
    """A Llama-like model from explicit dimensions; ``ffn`` defaults to 4 x hidden (GPT convention)."""
    return ModelSpec(
        name=name, num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads or heads,
        ffn_hidden_size=ffn or 4 * hidden, vocab_size=vocab, head_dim=head_dim or 0, **options,
    )


def with_kernels(model: ModelSpec, kernels: str) -> ModelSpec:
    return replace(model, kernels=kernels)
