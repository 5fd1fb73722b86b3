"""Building a sharded model from a checkpoint folder: on the meta device, sharded by its plan, then filled.

:func:`build_parallel_model` makes the plan, checks the checkpoint, shards the meta model
(:func:`~tensorpar.hf.apply.parallelize`) and fills every parameter with its slice (:func:`load_sharded`);
:func:`stored_untied` and :func:`follow_stored_ties` find the tied weights a checkpoint stores different, and
:func:`resolve_attn_implementation` picks the attention implementation every rank then uses.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn as nn

from tensorpar.comm import Group
from tensorpar.hf.apply import parallelize
from tensorpar.hf.load.check import _check, _checkpoint_names, _Expected, _meta_model
from tensorpar.hf.load.reader import SafetensorsReader, read_shard, weight_map
from tensorpar.hf.plan import ShardingPlan, make_plan


_META_ATTRS = ("tp_dim", "tp_partition", "sequence_parallel", "ep_dim", "ep_partition")


def _moe_handle(handles: dict, f: Path):
    """A ``safe_open`` handle of ``f``, opened once (per-expert MoE tensors are read through its ``get_slice``)."""
    from safetensors import safe_open

    if f not in handles:
        handles[f] = safe_open(str(f), framework="pt").__enter__()
    return handles[f]


def load_sharded(model: nn.Module, folder: str | Path, tp: Group, *, device=None, dtype=torch.float32) -> nn.Module:
    """Fill every parameter of a sharded ``model`` (meta or real) with its slice from ``folder``; LoRA adapters
    (``lora_adapter`` parameters) keep their values and move to ``device``.

    Each parameter becomes a new contiguous tensor of exactly its shard (``dtype`` on ``device``),
    read with plain file reads (:class:`SafetensorsReader`); nothing stays mapped. Tied parameters
    are loaded once (from whichever of their names the checkpoint holds). Buffers keep the values
    the model computed from its config and are moved to ``device``.

    Raises ValueError for a missing tensor or a shape mismatch (naming the tensor) and for
    unreadable files (naming the file).
    """
    device = torch.device(device or "cpu")
    wmap = weight_map(folder)
    expected = _Expected(model)
    readers: dict[Path, SafetensorsReader] = {}
    moe_handles: dict[Path, object] = {}
    new: dict[int, nn.Parameter] = {}
    renamed = None  # checkpoint names under transformers' renamings, looked up only if a name is missing
    try:
        for name, p in model.named_parameters():
            if getattr(p, "lora_adapter", False):  # a LoRA adapter (tensorpar.layers.lora): not in the checkpoint
                q = nn.Parameter(p.detach().to(device=device, dtype=dtype), requires_grad=p.requires_grad)
                for a in _META_ATTRS:
                    if hasattr(p, a):
                        setattr(q, a, getattr(p, a))
                new[id(p)] = q
                continue
            names = expected.groups[id(p)]
            key = next((k for k in (expected.key(n, wmap) for n in names) if k is not None), None)
            if key is None:
                renamed = _checkpoint_names(model, wmap) if renamed is None else renamed
                key = renamed.get(name)
            if key is None:  # MoE experts stacked in the model, one tensor per expert in the checkpoint
                from tensorpar.hf.moe_checkpoint import read_moe_shard
                t = read_moe_shard(getattr(getattr(model, "config", None), "model_type", None), name, p, tp.rank,
                                   wmap, lambda k: _moe_handle(moe_handles, wmap[k]).get_slice(k))
                if t is None:
                    raise ValueError(f"tensor {name!r} is missing from the checkpoint in {folder}")
                t = t.to(device=device, dtype=dtype)
            else:
                f = wmap[key]
                if f not in readers:
                    readers[f] = SafetensorsReader(f)
                t = torch.empty(p.shape, dtype=dtype, device=device)
                read_shard(readers[f], key, p, tp.rank, out=t)
            q = nn.Parameter(t, requires_grad=p.requires_grad)
            for a in _META_ATTRS:
                if hasattr(p, a):
                    setattr(q, a, getattr(p, a))
            new[id(p)] = q
    finally:
        for r in readers.values():
            r.close()
        for h in moe_handles.values():
            h.__exit__(None, None, None)
    for m in model.modules():
        for pn, p in list(m._parameters.items()):
            if p is not None and id(p) in new:
                m._parameters[pn] = new[id(p)]
    for m in model.modules():  # real buffers were kept off meta; move them to the device
        for bn, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[bn] = b.to(device)
    return model


def _stored_equal(wmap: dict[str, Path], a: str, b: str, dtype: torch.dtype, chunk_bytes: int = 1 << 26) -> bool:
    """Whether checkpoint tensors ``a`` and ``b`` hold the same values in ``dtype`` (read in row chunks of at most
    ``chunk_bytes``: never two whole tensors in memory)."""
    with SafetensorsReader(wmap[a]) as ra, SafetensorsReader(wmap[b]) as rb:
        shape = ra.shape(a)
        if shape != rb.shape(b):
            return False
        if not shape:
            return torch.equal(ra.read(a, dtype=dtype), rb.read(b, dtype=dtype))
        row = max(1, math.prod(shape[1:]) * torch.empty((), dtype=dtype).element_size())
        step = max(1, chunk_bytes // row)
        for start in range(0, shape[0], step):
            rows = range(start, min(shape[0], start + step))
            if not torch.equal(ra.read(a, dim=0, indices=rows, dtype=dtype), rb.read(b, dim=0, indices=rows,
                                                                                  dtype=dtype)):
                return False
    return True


def stored_untied(folder: str | Path, config, dtype: torch.dtype = torch.float32) -> list[tuple[str, str]]:
    """Tied pairs ``(source, alias)`` (``model.embed_tokens.weight``, ``lm_head.weight``) that the checkpoint in
    ``folder`` stores under both names with different values in ``dtype``.

    transformers' ``from_pretrained`` (5.24, ``PreTrainedModel.tie_weights``) ties such a pair only when the two
    stored tensors are equal; otherwise it keeps them apart and warns. Empty when the config ties nothing or the
    checkpoint stores one name of each pair. Reads the two tensors in row chunks (bounded memory), only then."""
    import copy

    if not getattr(config, "tie_word_embeddings", False):
        return []
    model = _meta_model(copy.deepcopy(config))  # from_config would set the config's attention implementation
    tied = model.get_expanded_tied_weights_keys(all_submodels=True)  # {alias: source}
    wmap = weight_map(folder)
    expected = _Expected(model)
    out = []
    for alias, source in tied.items():
        ka, ks = expected.key(alias, wmap), expected.key(source, wmap)
        if ka is not None and ks is not None and ka != ks and not _stored_equal(wmap, ks, ka, dtype):
            out.append((ks, ka))
    return out


def follow_stored_ties(folder: str | Path, config, dtype: torch.dtype = torch.float32, *, warn: bool = True) -> None:
    """Apply transformers' loading rule for tied weights to ``config`` (in place): a checkpoint that stores a tied
    pair under both names with different values (:func:`stored_untied`) gets ``tie_word_embeddings = False``, as
    ``from_pretrained`` unties such a model (with the same warning, when ``warn``)."""
    import warnings

    pairs = stored_untied(folder, config, dtype)
    if pairs and warn:
        warnings.warn(f"{folder}: config.json ties {pairs[0][1]} to {pairs[0][0]} but the checkpoint stores both "
                      f"with different values; they are kept apart, as transformers does (set "
                      f"tie_word_embeddings=false to silence this)", stacklevel=2)
    if pairs:
        config.tie_word_embeddings = False


def resolve_attn_implementation(config) -> str:
    """The attention kernel transformers' ``from_pretrained`` gives the model of ``config``: the one the config
    names (the user's), else sdpa where the model class supports it, else eager (gemma2: its soft-capping has no
    sdpa path). Decided by transformers itself, on the meta device (no memory); the launching process and every
    rank get the same answer from the same config.

    Raises:
        ValueError: (one line) the config names an implementation the model class does not support.
    """
    import copy

    try:
        return _meta_model(copy.deepcopy(config)).config._attn_implementation
    except ValueError as e:
        raise ValueError(f"{getattr(config, 'model_type', '?')}: attention implementation "
                         f"{getattr(config, '_attn_implementation', None)!r}: {' '.join(str(e).split())[:300]}") \
            from None


def build_parallel_model(folder: str | Path, tp: Group, *, sequence_parallel: bool = False, dtype=torch.float32,
                         device=None, attn_implementation: str | None = None,
                         dropout_seed: int | None = None, user_plan=None,
                         tp_weights=None, keep=None, config=None, plan: ShardingPlan | None = None,
                         adapt=None) -> tuple[nn.Module, ShardingPlan]:
    """Meta-initialise the model of ``folder``, check the checkpoint, shard it by its plan, load this rank's slices.

    ``attn_implementation`` (``"sdpa"``, ``"eager"``, or any name transformers' attention registry
    knows) is the attention every sharded layer runs; None: the one transformers picks for the folder's config
    (:func:`resolve_attn_implementation`: sdpa, or eager for gemma2). ``tp_weights``: relative speed of each tp rank
    (:mod:`tensorpar.capacity`; ``ctx.tp_weights``), ``None`` for an even split. Returns ``(model, plan)``; the model is in
    eval mode. Raises the ValueErrors of :func:`~tensorpar.hf.plan.make_plan` (at plan time, before
    any weight is read), of :func:`check_checkpoint` (headers only) and of :func:`load_sharded`.

    ``config``: the folder's config as the launching process read it (a copy is used; ``config.json`` is then not
    read again); ``plan``: the plan it made for ``tp.size`` ranks (then ``user_plan`` and ``tp_weights`` are not
    used, and no plan is made here). A :class:`tensorpar.job.Job` carries both.

    ``keep(model)``, if given, runs on the sharded meta model before any weight is read; the modules it removes
    are never read nor materialised (a pipeline rank keeps only its stage:
    :func:`tensorpar.pipeline.stages.keep_stage_modules`).

    ``adapt(model)``, if given, runs on the unsharded meta model once the checkpoint is checked, before sharding:
    LoRA adapters are added there (:func:`tensorpar.hf.lora.add_lora`; real tensors, sharded with their base
    projection and kept by :func:`load_sharded`, which reads the base weights only).
    """
    from transformers import AutoConfig

    import copy

    config = AutoConfig.from_pretrained(folder) if config is None else copy.deepcopy(config)
    follow_stored_ties(folder, config, dtype, warn=tp.rank == 0)  # a stored head unlike the embedding: not tied
    if plan is None:
        plan = make_plan(config, tp.size, sequence_parallel=sequence_parallel, user_plan=user_plan,
                         tp_weights=tp_weights)
    elif plan.tp_size != tp.size or plan.sequence_parallel != sequence_parallel:
        raise ValueError(f"the plan given is for tp_size={plan.tp_size}, sequence_parallel={plan.sequence_parallel}; "
                         f"this model is sharded over {tp.size} ranks with sequence_parallel={sequence_parallel}")
    config._attn_implementation = attn_implementation or resolve_attn_implementation(config)
    model = _meta_model(config, dtype)
    _check(Path(folder), _Expected(model), config, weight_map(folder))  # = check_checkpoint, on this meta model
    if adapt is not None:
        adapt(model)
    parallelize(model, plan, tp, dropout_seed=dropout_seed)
    if keep is not None:
        keep(model)
    load_sharded(model, folder, tp, device=device, dtype=dtype)
    return model.eval(), plan
