"""The model being trained: a transformers Llama-style ``*ForCausalLM``, sharded by the inference plan.

From scratch every parameter is drawn from the run's seed and its module's qualified name
(:func:`init_from_seed`), so the model is the same function at every tp, pp and dp; a pipeline rank builds the
model on the meta device and materialises only its stage's modules, a tp rank slices them
(:func:`tensorpar.hf.apply.parallelize`). From pretrained weights every rank reads only its slices
(:func:`tensorpar.hf.load.build_parallel_model`).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from tensorpar.comm import Group
from tensorpar.train.config import TrainConfig, check_against_model
from tensorpar.hf.presets import PRESETS, preset_config


@dataclass(frozen=True)
class ModelSource:
    """Where the model comes from.

    Attributes:
        config: the transformers config (global sizes).
        weights: a folder with safetensors to start from, or ``None`` to initialise from the seed.
        folder: the model folder ``--model`` named (its tokenizer may be used), or ``None``.
    """

    config: object
    weights: Path | None
    folder: Path | None


def resolve_source(cfg: TrainConfig, vocab_size: int | None = None, *, progress: bool = True) -> ModelSource:
    """Turn ``cfg.model``/``cfg.init`` into a :class:`ModelSource`.

    ``vocab_size`` (the tokenizer's) sizes a preset's vocabulary; it is required for presets only.
    Raises ValueError for an unknown preset or a config file that is not a causal-LM config, and
    ``init="pretrained"`` with a model spec that has no weights.
    """
    from transformers import AutoConfig

    spec = cfg.model
    if spec in PRESETS:
        if cfg.init == "pretrained":
            raise ValueError(f"init='pretrained' but model={spec!r} is a preset without weights; use init='scratch' "
                             f"or a model folder / smollm2")
        if vocab_size is None:
            raise ValueError("a preset model needs the tokenizer's vocab_size")
        c = preset_config(spec, vocab_size, cfg.seq_len, attention_dropout=cfg.attention_dropout)
        return ModelSource(c, None, None)
    path = Path(spec).expanduser()
    if path.suffix == ".json" and path.is_file():
        d = json.loads(path.read_text())
        if "model_type" not in d:
            raise ValueError(f"{path} has no 'model_type'; expected a Hugging Face config.json")
        if cfg.init == "pretrained":
            raise ValueError(f"init='pretrained' but {path} is a bare config (no weights); use init='scratch'")
        return ModelSource(AutoConfig.for_model(d.pop("model_type"), **d), None, None)
    from tensorpar.hub import resolve_model

    folder = resolve_model(spec, progress=progress)
    c = AutoConfig.from_pretrained(folder)
    return ModelSource(c, None if cfg.init == "scratch" else folder, folder)


def build_model(cfg: TrainConfig, source: ModelSource, tp: Group, vocab_size: int, *, device=None,
                pp_rank: int | None = None, ep: Group | None = None, cp: Group | None = None, plan=None):
    """Build, shard and prepare the model for training; returns ``(model, plan)``.

    fp32 weights on ``device`` (autocast provides bf16), SDPA attention, no KV cache, per-block
    recomputation when ``cfg.recompute``. Raises the ValueErrors of :func:`tensorpar.hf.plan.make_plan`
    and of :func:`check_against_model` before any weight is made.

    ``pp_rank``: with ``cfg.pp > 1`` the model is cut on the meta device and this pipeline rank reads (pretrained)
    or initialises (from scratch, :func:`init_from_seed`: the values the pp = 1 model has) only its stage's
    weights (:func:`tensorpar.pipeline.stages.keep_stage_modules`; the other layers are ``nn.Identity``).
    ``None``: the whole model (the trainer then keeps the stage of ``ctx.pp.rank``).

    ``ep``: with ``cfg.ep > 1``, the expert-parallel group (the dp axis of the run's ParallelContext: the ranks
    with this tp rank); after the tp split every experts module becomes an
    :class:`~tensorpar.hf.modules.EPExperts` holding this rank's ``E / ep`` experts
    (:func:`~tensorpar.hf.modules.expert_parallelize`). Raises ValueError when ``cfg.ep > 1`` and ``ep`` is not a
    group of that size.

    ``cp``: with ``cfg.cp > 1``, the context-parallel group (the cp axis of the run's ParallelContext); every
    attention module runs over the sequence split across it (:func:`tensorpar.hf.modules.context_parallelize`,
    mode ``cfg.cp_mode``). Raises ValueError when ``cfg.cp > 1`` and ``cp`` is not a group of that size.

    ``cfg.lora_r``: PEFT's LoRA adapters are added to the unsharded model (:func:`add_lora_of`) and sharded with
    their base projections; the base weights are frozen.

    ``plan``: the sharding plan the launching process made for ``tp.size`` ranks from ``source.config``
    (:func:`tensorpar.train.ranks.prepare`); without one it is made here. With pretrained weights the loader shards
    with a copy of ``source.config`` as the folder has it (the changes below are the training's), not config.json
    read again.
    """
    import copy

    from tensorpar.hf.apply import parallelize
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.hf.plan import make_plan

    config = source.config
    loader_config = copy.deepcopy(config)   # before the training's changes: what the loader builds the model from
    config.use_cache = False
    config.attention_dropout = cfg.attention_dropout
    check_against_model(cfg, config, vocab_size)
    if cfg.tp_weights == "auto":
        raise ValueError("tp_weights='auto' must be measured before the model is built: tensorpar.train.cli.run "
                         "does it (cfg.replace(tp_weights=ctx.tp_weights) in a loop of your own)")
    if source.weights is not None:  # build_parallel_model makes the plan (validating before any weight is read)
        keep = None
        if cfg.pp > 1 and pp_rank is not None:
            from tensorpar.pipeline.stages import keep_stage_modules
            virtual = 2 if cfg.schedule == "interleaved-1f1b" else 1

            def keep(m):
                keep_stage_modules(m, pp_rank, cfg.pp, virtual)
        model, plan = build_parallel_model(source.weights, tp, sequence_parallel=cfg.sequence_parallel,
                                           dtype=torch.float32, device=device, dropout_seed=cfg.seed,
                                           tp_weights=cfg.tp_weights, keep=keep, config=loader_config, plan=plan,
                                           adapt=lambda m: add_lora_of(cfg, m, source))
        model.config.use_cache = False
    else:
        if plan is None:
            plan = make_plan(config, tp.size, sequence_parallel=cfg.sequence_parallel,  # validates before any weight
                             tp_weights=cfg.tp_weights)
        config._attn_implementation = "sdpa"
        from tensorpar.hf.load import _meta_model
        model = _meta_model(config, torch.float32)
        model.tie_weights()   # as from_config: a tied head is the embedding's parameter
        dropped = ()
        if cfg.pp > 1 and pp_rank is not None:
            from tensorpar.pipeline.stages import dropped_modules, keep_stage_modules
            virtual = 2 if cfg.schedule == "interleaved-1f1b" else 1
            dropped = dropped_modules(config, pp_rank, cfg.pp, virtual)
        init_from_seed(model, cfg.seed, skip=lambda name: any(name == d or name.startswith(d + ".")
                                                              for d in dropped))
        add_lora_of(cfg, model, source)
        parallelize(model, plan, tp, dropout_seed=cfg.seed)
        if dropped:
            keep_stage_modules(model, pp_rank, cfg.pp, virtual)
        if device is not None:
            model.to(device)
    if cfg.ep > 1:
        if ep is None or ep.size != cfg.ep:
            raise ValueError(f"ep={cfg.ep} needs the expert-parallel group of {cfg.ep} ranks (the dp axis); got {ep}")
        from tensorpar.hf.modules import expert_parallelize
        expert_parallelize(model, ep)
        if device is not None:
            model.to(device)   # the experts' owner table is made on the CPU
    if cfg.cp > 1:
        if cp is None or cp.size != cfg.cp:
            raise ValueError(f"cp={cfg.cp} needs the context-parallel group of {cfg.cp} ranks (the cp axis); got {cp}")
        from tensorpar.hf.modules import context_parallelize
        context_parallelize(model, cp, cfg.cp_mode)
    if cfg.recompute:
        recompute_blocks(model)
    return model.train(), plan


def add_lora_of(cfg: TrainConfig, model: nn.Module, source: ModelSource) -> nn.Module:
    """With ``cfg.lora_r``, PEFT's LoRA adapters added to the unsharded ``model`` (base frozen; drawn from the run's
    seed: :func:`tensorpar.hf.lora.add_lora`) before it is sharded; otherwise ``model`` as it is."""
    if cfg.lora_r is None:
        return model
    from tensorpar.train.lora import add_run_lora
    return add_run_lora(model, cfg, str(source.folder) if source.folder else None)


def module_seed(seed: int, name: str) -> int:
    """The seed of module ``name``'s initialisation in a run of seed ``seed`` (63 bits of SHA-256: the same in
    every process and Python, unlike ``hash``)."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def init_from_seed(model: nn.Module, seed: int, *, skip=None) -> nn.Module:
    """Materialise (on the CPU) and initialise the meta parameters of ``model`` (a transformers model, unsharded,
    as :func:`tensorpar.hf.load._meta_model` builds it), module by module: each module's own parameters are drawn
    by the family's ``_init_weights`` (transformers' rule for that module) from the CPU generator seeded with
    :func:`module_seed` ``(seed, qualified name)``. A parameter's value therefore depends on the seed and its
    module's name only, not on which other modules are materialised: a pipeline rank that initialises only its
    stage gets exactly the values of the pp = 1 model. Modules are visited children first (transformers'
    ``initialize_weights`` order); a parameter shared by several modules (a tied LM head) is drawn once, by the
    first (the embedding, as ``tie_weights`` keeps it). The global RNG state is left as it was.

    ``skip(name)``: modules left on meta (a pipeline rank's other stages), dropped by the caller. Returns
    ``model``. Raises ValueError naming a parameter the family's ``_init_weights`` does not initialise.
    """
    from transformers import PreTrainedModel
    from transformers import initialization as hf_init

    new: dict[int, nn.Parameter] = {}   # id of the meta parameter -> its materialised one
    held: list[nn.Parameter] = []        # the meta parameters, alive until the end (their ids stay unique)
    names: dict[int, str] = {}
    drawn: set[int] = set()              # ids of the materialised ones

    def visit(module: nn.Module, name: str, owner) -> None:
        for n, child in module.named_children():
            visit(child, f"{name}.{n}" if name else n, child if isinstance(child, PreTrainedModel) else owner)
        if skip is not None and skip(name):
            return
        fresh = False
        for pn, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in new:   # NaN until drawn: what _init_weights leaves alone is found below
                q = nn.Parameter(torch.full(p.shape, float("nan"), dtype=p.dtype), requires_grad=p.requires_grad)
                new[id(p)], names[id(p)], fresh = q, f"{name}.{pn}" if name else pn, True
                drawn.add(id(q))
                held.append(p)
            module._parameters[pn] = new[id(p)]
        if fresh:
            torch.default_generator.manual_seed(module_seed(seed, name))
            owner._init_weights(module)
        for p in module._parameters.values():   # drawn: a module sharing it later leaves it as it is
            if p is not None and id(p) in drawn:
                p._is_hf_initialized = True

    with torch.random.fork_rng(devices=[]), torch.no_grad(), hf_init.guard_torch_init_functions():
        visit(model, "", model)
    for name, m in model.named_modules():   # every kept holder of a drawn parameter (a tied LM head) gets it
        if skip is not None and skip(name):
            continue                         # a skipped module keeps its meta parameters (nothing to shard)
        for pn, p in list(m._parameters.items()):
            if p is not None and id(p) in new:
                m._parameters[pn] = new[id(p)]
    for key, q in new.items():
        del q._is_hf_initialized
        if torch.isnan(q).any():
            raise ValueError(f"{model.config.model_type}: {names[key]} is not initialised by transformers' "
                             f"_init_weights of {type(model).__name__}; train it from pretrained weights (--model "
                             f"a folder) instead")
    return model


def recompute_blocks(model: nn.Module) -> None:
    """Recompute each decoder block's activations in backward (``torch.utils.checkpoint``, non-reentrant).

    Only a block's input is kept; its forward, collectives included, runs again during backward, so each
    block costs one extra forward. Dropout masks are keyed by step (:mod:`tensorpar.layers.dropout`), so the
    replay draws the same masks. In eval or under ``no_grad`` the block runs as is.
    """
    from torch.utils.checkpoint import checkpoint

    for _, layer in model.tensorpar_plan.block_modules(model):
        inner = layer.forward  # may be the sequence-parallel entry wrapper of block 0: it is replayed too

        def forward(*args, _inner=inner, _layer=layer, **kwargs):
            if not (_layer.training and torch.is_grad_enabled()):
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        layer.forward = forward
        layer._tensorpar_recompute = True


def named_unique_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` pairs, a tied parameter once under its first name (``model.embed_tokens.weight``)."""
    return list(model.named_parameters(remove_duplicate=True))


def check_device(model: nn.Module, device: torch.device) -> None:
    """Raise ``ValueError`` (one line) when a parameter of ``model`` is on another device than ``device`` (the
    rank's ``ctx.device``); parameters on the meta device (other pipeline stages' modules) are ignored."""
    def name(d: torch.device) -> str:       # "cpu:0" is "cpu"; "cuda" the current GPU
        if d.type == "cpu":
            return "cpu"
        if d.type == "cuda" and d.index is None and torch.cuda.is_available():
            return f"cuda:{torch.cuda.current_device()}"
        return str(d)

    device = torch.device(device)
    if elsewhere := sorted({name(p.device) for p in model.parameters() if not p.is_meta} - {name(device)}):
        raise ValueError(f"the model's parameters are on {', '.join(elsewhere)} but this rank computes on {device} "
                         f"(ctx.device): build it with build_model(..., device=ctx.device)")
