"""Apply a :class:`~tensorpar.hf.plan.ShardingPlan` to a Hugging Face model, in place, generically.

:func:`parallelize` walks ``model.named_modules()`` once, top down; a module whose name matches a plan entry is
handed to that entry's style, which returns its replacement (a module it owns; its children are not visited
again) or shards it in place. Nothing here knows an architecture: the plan is the whole description.

Dropout is made tp-invariant here, whatever the entry point (training loop or a user's own loop): every
``nn.Dropout`` left in the model becomes a :class:`~tensorpar.layers.dropout.KeyedDropout` keyed by its module
name, and attention modules with attention dropout get the head-keyed kernel, so masks are the same on every
rank for replicated activations and gather to the tp = 1 masks for sharded ones. Each training-mode forward of
the root model draws new masks (:meth:`~tensorpar.layers.dropout.DropoutRNG.next_forward`); the seed is
``dropout_seed`` or rank 0's ``torch.initial_seed()`` (broadcast once, only when the model has dropout).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from tensorpar.comm import Group
from tensorpar.hf.plan import ShardingPlan
from tensorpar.hf.styles import ApplyContext


def parallelize(model: nn.Module, plan: ShardingPlan, tp: Group, *, dropout_seed: int | None = None) -> nn.Module:
    """Replace the modules of ``model`` (a ``*ForCausalLM``) by their tensor-parallel versions, as ``plan`` says.

    Weights are sliced from the modules being replaced (which may live on the meta device, for a sharded
    load afterwards). Parameter names are unchanged. A PEFT LoRA model (a ``PeftModel``, or the model PEFT
    injected adapters into) is sharded with its adapters (:mod:`tensorpar.layers.lora`: each adapter follows its
    base projection's split; the base weights keep their checkpoint names, ``q_proj.weight``); a ``PeftModel``
    is returned as such, its inner model sharded in place. Returns ``model``, with ``model.tensorpar_plan``,
    ``model.tp_group`` and ``model.tensorpar_dropout_rng`` set.

    After this, ``model(input_ids).logits`` holds this rank's vocabulary slice ``[b, s, V_r]``
    (``V_r = plan.vocab.sizes[tp_rank]``); use :func:`~tensorpar.layers.vocab_parallel_cross_entropy` with
    ``partition=model`` (or ``plan.vocab``) for the loss, or gather the logits.

    Under sequence parallelism a forward whose sequence length tp does not divide is refused before any
    computation (ValueError naming the length, tp and the nearest lengths that work).

    Raises:
        ValueError: ``plan.tp_size`` differs from the group's size, the model's type from the plan's, or the
            plan leaves a parameter or buffer of the model unclaimed (names listed).
    """
    from tensorpar.layers.dropout import DropoutRNG, HeadKeyedAttention, KeyedDropout

    if type(model).__module__.startswith("peft.") and hasattr(model, "get_base_model"):
        parallelize(model.get_base_model(), plan, tp, dropout_seed=dropout_seed)  # PeftModel: its model, in place
        return model
    if plan.tp_size != tp.size:
        raise ValueError(f"plan was made for tp_size={plan.tp_size} but the tp group has {tp.size} ranks")
    if model.config.model_type != plan.model_type:
        raise ValueError(f"plan is for {plan.model_type!r} but the model is {model.config.model_type!r}")
    plan.check(model)
    ctx = ApplyContext(tp, model, plan)
    replaced: list[str] = []
    todo = list(model.named_modules())
    for i in range(len(todo)):
        name, module = todo[i]
        todo[i] = None   # visited: a replaced module's real weights are freed now, not after the walk
        if any(name.startswith(r + ".") for r in replaced):
            continue
        entry = plan.match(name)
        if entry is None:
            continue
        new = entry.style.apply(module, name, ctx)
        if new is not module:
            _set_submodule(model, name, new)
            replaced.append(name)
    model.tensorpar_plan, model.tp_group = plan, tp
    # ---- dropout: keyed masks, whichever loop trains the model
    blocks = [n for n, _ in plan.block_modules(model)]
    dropouts = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Dropout) and m.p > 0]
    attn = [m for _, m in model.named_modules() if getattr(m, "attention_dropout", 0) > 0 and hasattr(m, "attention_fn")]
    rng = DropoutRNG(dropout_seed if dropout_seed is not None else
                     (_rank0_seed(tp) if (dropouts or attn) else 0))
    for n, m in dropouts:
        in_block = any(n.startswith(b + ".") for b in blocks)
        keyed = getattr(m, "keyed", None)   # a dropout that knows its input's layout (a LoRA adapter's)
        _set_submodule(model, n, keyed(rng, n, tp) if keyed is not None else
                       KeyedDropout(m.p, rng, n, tp, sequence_parallel=plan.sequence_parallel and in_block))
    for m in attn:
        m.attention_fn = HeadKeyedAttention(rng)
    model.tensorpar_dropout_rng = rng
    model.tensorpar_sequence_parallel = plan.sequence_parallel
    model.register_forward_pre_hook(_before_forward, with_kwargs=True)
    return model


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, new)


def _rank0_seed(tp: Group) -> int:
    """Rank 0's ``torch.initial_seed()``, the same on every rank (one broadcast; none at tp = 1)."""
    seed = torch.initial_seed() & ((1 << 62) - 1)
    if tp.size == 1 or tp.pg is None:  # one process (or a group handle without a process group: nothing to ask)
        return seed
    import torch.distributed as dist

    from tensorpar.comm.group import _run
    box = torch.tensor([seed], dtype=torch.int64)
    if dist.get_backend(tp.pg) == "nccl":
        box = box.cuda()
    # through comm's wrapper: a peer lost here (another host's link down) is named like in any other collective
    _run("broadcast", tp, box, lambda: dist.broadcast(box, src=dist.get_global_rank(tp.pg, 0), group=tp.pg))
    return int(box[0])


def _before_forward(model: nn.Module, args, kwargs):
    """Root pre-hook: new dropout masks for each training forward; refuse a sequence that SP cannot split."""
    if model.training and torch.is_grad_enabled():
        model.tensorpar_dropout_rng.next_forward()
    if model.tensorpar_sequence_parallel:
        x = kwargs.get("input_ids", args[0] if args else None)
        if x is None:
            x = kwargs.get("inputs_embeds")
        tp = model.tp_group.size
        if x is not None and x.dim() >= 2 and x.shape[1] % tp:
            s = x.shape[1]
            lo, hi = s - s % tp, s + tp - s % tp
            raise ValueError(f"sequence length {s} is not divisible by tp={tp} under sequence parallelism; pad or "
                             f"cut the batch to {hi}" + (f" or {lo}" if lo else "") + " tokens, or shard the model "
                             f"with sequence_parallel=False")


@contextlib.contextmanager
def sequence_parallel_off(model: nn.Module):
    """Run a sequence-parallel model as plain tensor parallelism inside the block (generation, decode steps).

    Every module that splits or gathers along the sequence is switched to the replicated path and restored on
    exit; the math is the same, only where the activations live changes. A no-op for other models.
    """
    if not getattr(model, "tensorpar_sequence_parallel", False):
        yield model
        return
    mods = [m for m in model.modules() if getattr(m, "sequence_parallel", False) is True]
    for m in mods:
        m.sequence_parallel = False
    model.tensorpar_sequence_parallel = False
    try:
        yield model
    finally:
        for m in mods:
            m.sequence_parallel = True
        model.tensorpar_sequence_parallel = True
