"""Training configuration: one frozen dataclass, model presets, and the checks made before any rank starts.

Every check raises ``ValueError`` naming the setting, its value and what would work. The checks that need
the model (heads, vocabulary, context length) are in :func:`check_against_model`, run once the model's
config is known; :meth:`TrainConfig.__post_init__` checks everything that does not.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

DTYPES = ("float32", "bfloat16")
#: data-parallel modes: torch's DDP, or FSDP2 (fully_shard) on the dp mesh axis
DP_MODES = ("ddp", "fsdp")
#: context-parallel attention (tensorpar.layers.ring_attention): ring (key/value blocks passed around) or all2all
CP_MODES = ("ring", "all2all")
#: transports of the tp group's collectives (see TrainConfig.fast_collectives)
FAST_COLLECTIVES = ("auto", "on", "off")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything that defines a training run. Saved in every checkpoint (``state.json``).

    Model and data:
        model: a preset name (:data:`tensorpar.hf.presets.PRESETS`), a Hugging Face ``config.json`` path (trained from scratch),
            a model folder, or ``"smollm2"`` (fine-tuned from its weights unless ``init="scratch"``).
        init: ``"auto"`` (pretrained weights when ``model`` has them), ``"scratch"`` or ``"pretrained"``.
        data: ``"shakespeare"`` or the path of a UTF-8 text file.
        tokenizer: ``"auto"`` (the model folder's tokenizer if it has one, else bytes), ``"bytes"``,
            ``"smollm2"`` or a model folder.
        val_fraction: share of the text held out for the validation loss.
    Parallelism:
        tp, pp, dp: tensor-, pipeline- and data-parallel degrees (world size = tp x pp x cp x dp; rank order tp
            fastest, then cp, then pp, then dp). sequence_parallel: split activations between blocks along the
            sequence.
        cp, cp_mode: context-parallel degree: every sequence split over cp ranks (two chunks each, one early and
            one late, :mod:`tensorpar.layers.ring_attention`), attention by ``"ring"`` (key/value blocks passed
            around) or ``"all2all"`` (Ulysses: heads and sequence exchanged). 1 = off; ``seq_len`` must divide by
            ``2 cp``; composes with tp, sequence parallelism, pp, dp (ddp, fsdp) and hidden dropout (masks the same at
            every cp), not (yet) with ep or attention dropout.
        ep: expert-parallel degree: the experts of a mixture-of-experts model split whole over this many ranks
            (:func:`tensorpar.hf.modules.expert_parallelize`), which are the dp replicas (Megatron-Core /
            DeepSpeed-MoE): each takes its own rows of the batch, the non-expert gradients are averaged over dp,
            each rank's experts keep their own gradient (their tokens from every replica arrive by all-to-all).
            1 = off; otherwise ``ep == dp`` with ``dp_mode="ddp"`` and ``pp == 1``, and ``ep`` must divide the
            number of experts (:func:`check_against_model`).
        tp_weights: relative speed of each tp rank (its share of heads, MLP columns and vocabulary), ``"auto"``
            (measured at start-up) or ``None`` (even); :mod:`tensorpar.capacity`.
        micro_batches: each data-parallel replica's rows are cut into this many micro-batches (gradient
            accumulation; the pipeline's micro-batches). schedule: the pipeline schedule, ``gpipe``, ``1f1b`` or
            ``interleaved-1f1b`` (two chunks per stage; micro_batches a multiple of pp).
        dp_mode: how the dp replicas hold the model: ``"ddp"`` (torch's DistributedDataParallel without pp: every
            replica keeps whole parameters and AdamW state, gradients all-reduced) or ``"fsdp"`` (FSDP2's
            ``fully_shard`` on the dp axis, per decoder block and the root: parameters, gradients and AdamW state
            sharded 1/dp; the planner's "distributed optimizer"). At dp = 1 both are the same (nothing to shard).
        fast_collectives: the transport of the tp group's collectives for CPU tensors: ``"auto"`` (shared memory,
            :mod:`tensorpar.shm`, when all tp ranks share an x86 host, else torch.distributed), ``"on"`` (shared
            memory or an error at start-up) or ``"off"`` (torch.distributed: gloo on CPU). CUDA tensors always use
            NCCL. Results are the same bits either way at tp = 2 (one addition per element, as gloo does).
    Optimisation:
        seq_len, batch_size: tokens per step = ``seq_len * batch_size`` (the same at every tp).
        steps: optimiser steps in total (a resumed run continues up to it).
        lr, min_lr_ratio, warmup_steps: linear warm-up to ``lr``, then cosine decay to ``lr * min_lr_ratio``.
        weight_decay, beta1, beta2, eps: AdamW (decoupled decay on matrices only; norms and biases undecayed).
        grad_clip: clip the global gradient norm to this (0 = off).
        label_smoothing: of the cross-entropy (Szegedy et al. 2016).
        attention_dropout, hidden_dropout: dropout on attention probabilities and on each block's attention
            and MLP outputs. Off by default: 0 makes the run deterministic and checkable against tp = 1.
        dtype: ``"float32"``, or ``"bfloat16"`` for bf16 autocast (weights and optimizer stay fp32).
        recompute: recompute each block's activations in backward instead of storing them.
        seed: initial weights, data order and dropout masks all derive from it.
    LoRA (PEFT's names; :mod:`tensorpar.hf.lora`):
        lora_r: the adapters' rank (``--lora R``); ``None`` trains every weight (full fine-tuning). With it the
            base weights are frozen, only the adapters train (AdamW state for them only), each adapter is sharded
            with its base projection (:mod:`tensorpar.layers.lora`), and checkpoints hold only the adapters, also
            as PEFT's ``adapter_model.safetensors`` + ``adapter_config.json``.
        lora_alpha: scaling numerator (``s = lora_alpha / r``); ``None``: PEFT's default (8).
        lora_dropout: dropout on the adapters' input, in [0, 1) (keyed: the same masks at every tp).
        lora_target_modules: module names the adapters wrap (PEFT's ``target_modules``: a name matches a module
            whose name ends with it); ``None``: PEFT's default for the family (``q_proj``, ``v_proj`` for llama).
    Output:
        out_dir: metrics, plot and checkpoints go here.
        eval_every, eval_batches: validation loss every N steps (0 = only at the end) on this many batches.
        save_every: checkpoint every N steps (0 = only at the end). keep_checkpoints: how many to keep.
        log_every: write a metrics line every N steps.
    """

    model: str = "tiny"
    init: str = "auto"
    data: str = "shakespeare"
    tokenizer: str = "auto"
    val_fraction: float = 0.05
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    cp: int = 1
    cp_mode: str = "ring"
    micro_batches: int = 1
    schedule: str = "1f1b"
    dp_mode: str = "ddp"
    sequence_parallel: bool = False
    tp_weights: tuple | str | None = None  # relative speed per tp rank, or "auto" (tensorpar.capacity)
    fast_collectives: str = "auto"
    seq_len: int = 128
    batch_size: int = 8
    steps: int = 200
    lr: float = 3e-3            # small models tolerate a large rate; use ~3e-4 to fine-tune a pretrained one
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95         # 0.95 rather than 0.999: steadier on short runs (as in GPT-3, LLaMA)
    eps: float = 1e-8
    grad_clip: float = 1.0
    label_smoothing: float = 0.0
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    dtype: str = "float32"
    recompute: bool = False
    seed: int = 0
    out_dir: str = "runs/train"
    eval_every: int = 50
    eval_batches: int = 8
    save_every: int = 0
    keep_checkpoints: int = 2
    log_every: int = 1
    lora_r: int | None = None
    lora_alpha: float | None = None
    lora_dropout: float = 0.0
    lora_target_modules: tuple | None = None

    def __post_init__(self):
        def bad(name, why):
            raise ValueError(f"{name}={getattr(self, name)!r}: {why}")

        for name, f in self.__dataclass_fields__.items():  # nan and inf pass every comparison below
            v = getattr(self, name)
            if isinstance(v, float) and not math.isfinite(v):
                bad(name, "must be a finite number")
            if isinstance(v, str) and not v.strip():
                bad(name, "must not be empty")

        for name in ("tp", "pp", "dp", "ep", "cp", "micro_batches", "seq_len", "batch_size", "steps", "eval_batches",
                     "keep_checkpoints", "log_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                bad(name, "must be a positive integer")
        for name in ("warmup_steps", "eval_every", "save_every", "seed"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                bad(name, "must be a non-negative integer (0 = off where it is a period)")
        if self.tp_weights is not None:  # lists (from JSON) become tuples; "3,1" and "auto" are accepted
            from tensorpar.shard import check_tp_weights
            object.__setattr__(self, "tp_weights", check_tp_weights(self.tp_weights, self.tp))
        if self.schedule not in ("gpipe", "1f1b", "interleaved-1f1b"):
            bad("schedule", "use gpipe, 1f1b or interleaved-1f1b")
        if self.fast_collectives not in FAST_COLLECTIVES:
            bad("fast_collectives", f"use one of {', '.join(FAST_COLLECTIVES)}")
        if self.dp_mode not in DP_MODES:
            bad("dp_mode", f"use one of {', '.join(DP_MODES)}")
        if self.ep > 1:
            check_ep_layout(self.ep, self.dp, self.pp, self.dp_mode)
        if self.pp > 1 and self.schedule != "gpipe" and self.micro_batches < self.pp:
            raise ValueError(f"micro_batches={self.micro_batches} is fewer than pp={self.pp}, which the {self.schedule} "
                             f"schedule needs (every stage must have a micro-batch in flight); use micro_batches >= "
                             f"{self.pp} or schedule='gpipe'")
        if self.batch_size % (self.dp * self.micro_batches):
            raise ValueError(f"batch_size={self.batch_size} is not divisible by dp x micro_batches = {self.dp} x "
                             f"{self.micro_batches}; use a multiple of {self.dp * self.micro_batches}")
        if self.init not in ("auto", "scratch", "pretrained"):
            bad("init", "use 'auto', 'scratch' or 'pretrained'")
        if self.dtype not in DTYPES:
            bad("dtype", f"use one of {', '.join(DTYPES)} (bfloat16 = bf16 autocast, fp32 weights)")
        if not self.lr > 0:
            bad("lr", "must be positive")
        for name in ("min_lr_ratio", "beta1", "beta2"):
            if not 0 <= getattr(self, name) <= 1:
                bad(name, "must be in [0, 1]")
        for name in ("attention_dropout", "hidden_dropout"):
            if not 0 <= getattr(self, name) < 1:
                bad(name, "must be in [0, 1)")
        if not 0 <= self.label_smoothing <= 1:
            bad("label_smoothing", "must be in [0, 1]")
        for name in ("weight_decay", "grad_clip"):
            if not getattr(self, name) >= 0:
                bad(name, "must be >= 0" + (" (0 = off)" if name == "grad_clip" else ""))
        if not self.eps > 0:
            bad("eps", "must be > 0")
        if not 0 < self.val_fraction < 0.5:
            bad("val_fraction", "must be in (0, 0.5): a validation split is always held out")
        from tensorpar.train.lora import check_lora_settings
        check_lora_settings(self)
        if self.cp_mode not in CP_MODES:
            bad("cp_mode", f"use one of {', '.join(CP_MODES)}")
        if self.cp > 1:
            check_cp_layout(self)
        elif self.sequence_parallel and self.seq_len % self.tp:
            ok = self.seq_len - self.seq_len % self.tp
            raise ValueError(f"seq_len={self.seq_len} is not divisible by tp={self.tp}, which sequence parallelism "
                             f"needs (each rank keeps seq_len / tp positions); use seq_len={ok} or "
                             f"{ok + self.tp}, or turn sequence_parallel off")

    @property
    def world_size(self) -> int:
        """Ranks of the run: ``tp x pp x cp x dp``."""
        return self.tp * self.pp * self.cp * self.dp

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.batch_size

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        """Inverse of :meth:`to_dict`; unknown keys raise ValueError naming them."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown training settings {unknown}; known: {sorted(known)}")
        return cls(**d)

    def replace(self, **changes) -> "TrainConfig":
        d = self.to_dict()
        d.update(changes)
        return TrainConfig(**d)


def check_cp_layout(cfg: "TrainConfig") -> None:
    """The layouts context parallelism (``cp > 1``) runs at; ValueError naming the setting and what works.

    ``seq_len`` a multiple of ``2 cp`` (and of ``2 cp tp`` under sequence parallelism: each tp rank keeps
    ``seq_len / (cp tp)`` positions); with tp, sequence parallelism, pp and dp (ddp or fsdp); not with ep or
    attention dropout.
    """
    from tensorpar.layers.ring_attention import check_cp_seq_len
    check_cp_seq_len(cfg.seq_len, cfg.cp)
    works = "cp runs with tp, sequence_parallel, pp and dp (ddp, fsdp)"
    if cfg.ep > 1:
        raise ValueError(f"cp={cfg.cp}: does not run with expert parallelism (ep={cfg.ep}); {works}; use ep=1 or cp=1")
    if cfg.attention_dropout > 0:   # hidden dropout is keyed by global position (tensorpar.layers.dropout)
        raise ValueError(f"cp={cfg.cp}: does not run with attention_dropout={cfg.attention_dropout} (its masks are "
                         f"not split over cp yet); use attention_dropout=0 or cp=1")
    n = 2 * cfg.cp * cfg.tp
    if cfg.sequence_parallel and cfg.seq_len % n:
        lo = cfg.seq_len - cfg.seq_len % n
        raise ValueError(f"seq_len={cfg.seq_len} is not divisible by 2 x cp x tp = {n}, which sequence parallelism "
                         f"with cp={cfg.cp} needs; use seq_len={lo or n} or {lo + n}, or turn sequence_parallel off")


def check_ep_layout(ep: int, dp: int, pp: int, dp_mode: str) -> None:
    """The layouts expert parallelism runs at (``ep > 1``): the ep ranks are the dp replicas, so ``ep == dp``;
    DDP-style replicas (``dp_mode="ddp"``); no pipeline. Raises ValueError naming the setting and what works."""
    if dp % ep:
        raise ValueError(f"ep={ep}: does not divide dp={dp} (the expert-parallel ranks are data-parallel ranks); "
                         f"use ep={dp}" + (" or ep=1" if dp > 1 else ""))
    if ep != dp:
        raise ValueError(f"ep={ep}: with dp={dp} (ep < dp) is not implemented; use ep={dp} (experts split over "
                         f"every dp rank) or ep=1")
    if pp > 1:
        raise ValueError(f"ep={ep}: does not run with pipeline stages (pp={pp}); use pp=1 or ep=1")
    if dp_mode != "ddp":
        raise ValueError(f"ep={ep}: does not run with dp_mode={dp_mode!r} (the experts are split whole over dp, the "
                         f"rest replicated); use dp_mode='ddp' or ep=1")


def num_experts(model_config) -> int | None:
    """The routed experts per MoE layer of a transformers config (``num_local_experts`` or ``num_experts``)."""
    return getattr(model_config, "num_local_experts", None) or getattr(model_config, "num_experts", None)


def check_against_model(cfg: TrainConfig, model_config, vocab_size: int, *, flags: bool = False) -> None:
    """Checks that need the model's config (after :func:`tensorpar.hf.plan.make_plan`'s own).

    Raises ValueError when the sequence is longer than the model's context, when the tokenizer can
    emit ids that the model's embedding does not have, or when ``ep > 1`` on a model without experts
    (:func:`tensorpar.hf.families.why_not`) or with a number of experts that ``ep`` does not divide; at cp > 1
    for a family without context parallelism or (all2all) query heads per tp rank that cp does not divide.
    ``flags``: the cp messages name the command-line flags (``--cp``, ``--cp-mode``), as ``tensorpar train`` shows.
    """
    from tensorpar.hf.modules.experts import expert_parallel_error
    why = expert_parallel_error(cfg.ep, model_config)
    if why:
        raise ValueError(why)
    if cfg.cp > 1:
        from tensorpar.hf.families import why_not
        why = why_not("context_parallel", model_config)
        if why:
            raise ValueError(f"--cp {cfg.cp}: {why}; use --cp 1" if flags else f"cp={cfg.cp}: {why}; use cp=1")
        if cfg.cp_mode == "all2all":
            from tensorpar.layers.attention import HeadLayout
            from tensorpar.layers.ring_attention import check_all2all_heads
            heads = model_config.num_attention_heads
            kv = getattr(model_config, "num_key_value_heads", None) or heads
            d = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
            weights = cfg.tp_weights if isinstance(cfg.tp_weights, tuple) else None
            lay = HeadLayout.make(heads, kv, d, cfg.tp, split_weights=weights)
            for r in range(cfg.tp):
                check_all2all_heads(lay.local_heads(r), cfg.cp, cfg.tp, flags=flags)
    limit = getattr(model_config, "max_position_embeddings", None)
    if limit is not None and cfg.seq_len > limit:
        raise ValueError(f"seq_len={cfg.seq_len} exceeds the model's max_position_embeddings={limit}; use "
                         f"seq_len <= {limit}")
    if vocab_size > model_config.vocab_size:
        raise ValueError(f"the tokenizer has {vocab_size} ids but the model's vocab_size is "
                         f"{model_config.vocab_size}; use the model's own tokenizer (tokenizer='auto')")


def check_data_file(data: str) -> None:
    """Check ``--data`` before anything is tokenised: ``"shakespeare"``, or a non-empty UTF-8 text file.

    Raises ValueError naming the path: a folder, an empty file, a file that is not UTF-8 (with the byte
    offset of the first bad byte), or a path that does not exist (FileNotFoundError).
    """
    if data == "shakespeare":
        return
    import codecs

    path = Path(os.path.expanduser(data))
    if path.is_dir():
        raise ValueError(f"--data {data!r} is a folder; give a UTF-8 .txt file (or 'shakespeare')")
    if not path.exists():
        if path.suffix != ".txt":
            raise ValueError(f"--data {data!r}: use 'shakespeare' or the path of a UTF-8 .txt file")
        raise FileNotFoundError(f"--data {data!r}: no such file")
    if not path.is_file():
        raise ValueError(f"--data {data!r} is not a regular file; give a UTF-8 .txt file")
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, text_seen = 0, False
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            try:
                text = decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                raise ValueError(f"--data {data!r} is not UTF-8 text (byte {offset + e.start}: {e.reason}); "
                                 f"convert it, e.g. iconv -t UTF-8") from None
            text_seen = text_seen or bool(text.strip())
            if not chunk:
                break
            offset += len(chunk)
    if not text_seen:
        raise ValueError(f"--data {data!r} is empty (no text to train on)")


def check_out_dir(out_dir: str, *, resume: str | None) -> None:
    """``--out`` must be a folder we may write: new, empty, or (with ``resume``) a previous run's.

    A fresh run into a folder that already holds files would truncate its ``metrics.jsonl`` and prune its
    checkpoints, so it is refused (ValueError naming ``--out``). An ``--out`` that is a file is refused.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out_dir!r} is a file, not a folder; choose a folder for the run's outputs")
    if resume is None and out.is_dir() and any(p.name != ".lock" for p in out.iterdir()):  # .lock: ours
        ckpts = out / "checkpoints"
        if ckpts.is_dir() and any(ckpts.iterdir()):
            raise ValueError(f"--out {out_dir!r} already holds files (an earlier run?); continue it with --resume, "
                             f"or choose another --out folder")
        raise ValueError(f"--out {out_dir!r} already holds files but no checkpoint (an earlier run that stopped "
                         f"before saving one?), so there is nothing to resume; move its files away or choose "
                         f"another --out folder")


def config_error(source: str, e: Exception) -> ValueError:
    """A one-line ValueError for a model config that transformers rejects (the innermost reason, named)."""
    cause = e
    while cause.__cause__ is not None:
        cause = cause.__cause__
    return ValueError(f"model config {source} is invalid: {' '.join(str(cause).split())}")


def check_model_config(config, source: str) -> None:
    """Build the model on the meta device (no memory, no weights): what transformers rejects fails here.

    Raises ValueError naming ``source`` and transformers' reason.
    """
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(config)
    except Exception as e:  # transformers raises ValueError, KeyError, AttributeError, its own errors, ...
        raise config_error(source, e) from e
