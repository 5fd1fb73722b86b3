"""Discovered sharding plans: the plan of an architecture without a table, found from its module graph and shapes,
then proven on a small random-weight instance before it is used (``--discover-plan``, ``make_plan(discover=True)``).

:func:`discover_plan` reads the meta-device model (no weights) and the config's head counts, never a list of
module names: the token embedding and the LM head are the model's input/output embeddings (tied or not); the
decoder blocks are the ``nn.ModuleList`` of ``num_hidden_layers`` blocks, all of the same structure; in a block

* attention is the child whose linears take the hidden size to ``heads x head_dim`` (query) and
  ``kv_heads x head_dim`` (key, value), or to ``(heads + 2 kv_heads) x head_dim`` (one fused projection), with
  an output projection ``heads x head_dim -> hidden``; per-head norms (``[head_dim]``) and sinks (``[heads]``)
  are kept with it; the head counts come from the config and are verified against these shapes;
* the MLP is the child whose linears take the hidden size to ``f`` (one projection: ``mlp``; two, or one of
  ``2 f`` rows: ``gated_mlp``) and back;
* a child whose tensors are all 1-D of at most the hidden size (norms, scales) is replicated;
* a sparse mixture-of-experts block (:func:`~tensorpar.hf.discover_block._discover_moe`) is the child holding
  ``[E, ...]`` 3-D experts (``E`` the config's expert count): its router (one ``[E, h]`` weight) replicated, its
  stacked experts ``moe_experts``, shared experts as MLPs, a ``[1, h]`` shared-expert gate replicated (Qwen2-MoE's
  block whole: ``moe_block``); blocks that are dense in some layers and sparse in others are placed by block index.

Each child is recognised by :mod:`tensorpar.hf.discover_block`; this module walks the model and makes the plan.

The result is a :class:`~tensorpar.hf.user_plan.UserPlan`, the object ``--plan-file`` reads, so a discovered plan
saved with :func:`save_plan` is a plan file (one path). Anything it cannot place (experts the ``moe_experts``
style cannot split, a module with unknown parameters, linear attention, a block unlike the others, remote code)
is a ValueError naming the module and the way out (``--plan-file``). :func:`tensorpar.verify.prove.prove_plan`
then runs the plan at tp = 2 and 3 against the unsharded model
(:func:`~tensorpar.verify.compare.compare_to_reference`: every watched module, the logits, with ``train`` the loss
and every gradient) on :func:`tiny_config` (few blocks, the same head structure) and refuses a plan that fails,
naming the first module over tolerance.
"""
from __future__ import annotations

import copy
import json

import torch.nn as nn

from tensorpar.hf.discover_block import (_attention, _block_mlp, _discover_moe, _fail, _mlp, _num_experts,
                                         _small, _tensors)
from tensorpar.hf.user_plan import DEFAULT_REPLICATE_THRESHOLD, UserEntry, UserPlan

SOURCE = "discovered plan"
#: model types without a table whose discovered plan CI proves at tp = 2 and 3 (tests/hf/test_discover.py); the
#: table families llama, qwen3 and phi3 are proven there too (docs/discover.md).
PROVEN = ("arcee", "cohere", "ernie4_5_moe", "glm", "glm4_moe", "gpt_bigcode", "granite", "granitemoe", "helium",
          "olmo", "olmo3", "phi")


def _blocks(model: nn.Module, n: int, config=None) -> tuple[str, nn.ModuleList, dict[str, dict]]:
    """The block list's name, the blocks, and the entries by block index of the children that are dense in some
    blocks and mixture-of-experts in others (:func:`_mixed_moe`; ``config`` given)."""
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n]
    if not lists:
        raise _fail(f"no list of {n} blocks (num_hidden_layers) in {type(model).__name__}")
    name, blocks = lists[0]
    mixed = _mixed_moe(name, blocks, config) if config is not None else {}

    def sig(b):
        return [(k, tuple(t.shape)) for k, t in _tensors(b) if k.split(".")[0] not in mixed]
    sig0 = sig(blocks[0])
    for i, b in enumerate(blocks):
        if sig(b) != sig0:
            raise _fail(f"block {name}.{i} ({type(b).__name__}) differs from block 0 (a hybrid or mixed-layer "
                        f"model: linear attention, experts in some layers)")
    return name, blocks, {k: v for c in mixed.values() for k, v in c.items()}


def _mixed_moe(bname: str, blocks: nn.ModuleList, config) -> dict[str, dict[str, dict]]:
    """``{child: {"{bname}.{i}.{child}[.sub]": style}}`` for each child of the blocks that is a dense MLP in some
    blocks and a sparse mixture-of-experts block in others (Qwen-MoE's ``mlp_only_layers``, GLM-4-MoE's first
    dense layers), placed block by block (as the MoE table does); ``{}`` when there is none, or when a differing
    child is neither (the caller then refuses the blocks as unlike block 0)."""
    h = config.hidden_size
    if _num_experts(config) is None:
        return {}
    kids = [[n for n, c in b.named_children() if _tensors(c)] for b in blocks]
    if any(k != kids[0] for k in kids):
        return {}
    out: dict[str, dict[str, dict]] = {}
    for child in kids[0]:
        sigs = {tuple((k, tuple(t.shape)) for k, t in _tensors(getattr(b, child))) for b in blocks}
        if len(sigs) == 1:
            continue
        placed: dict[str, dict] = {}
        for i, b in enumerate(blocks):
            where, m = f"{bname}.{i}.{child}", getattr(b, child)
            style = _discover_moe(where, m, config, h)
            if style is None:
                dense = _mlp(where, m, h)
                if dense is None:
                    return {}
                style = {"": dense}
            placed.update({f"{where}{sub}": st for sub, st in style.items()})
        out[child] = placed
    return out


def discover_plan(config, model: nn.Module | None = None) -> UserPlan:
    """The :class:`UserPlan` of ``config``'s causal LM, found on its meta-device ``model`` (built when None).

    Raises:
        DiscoveryError: remote code, a model without a token embedding / LM head of ``vocab_size`` rows, blocks
            of different structure, or a module it cannot place (named, with the way out: ``--plan-file``).
    """
    from tensorpar.hf.plan import meta_model

    mt = getattr(config, "model_type", None)
    if getattr(config, "auto_map", None):
        raise _fail(f"{mt} runs remote code (config.auto_map): its modules are not transformers' own")
    if model is None:
        model = meta_model(config)
    h, vocab = config.hidden_size, config.vocab_size
    names = {id(m): n for n, m in model.named_modules()}
    entries: dict[str, dict] = {}
    emb = model.get_input_embeddings()
    if not isinstance(emb, nn.Embedding) or emb.num_embeddings != vocab:
        raise _fail(f"{type(model).__name__}: no token embedding of {vocab} rows (vocab_size)")
    entries[names[id(emb)]] = {"style": "vocab_embedding"}
    head = model.get_output_embeddings()
    if isinstance(head, nn.Linear) and head.out_features == vocab:
        entries[names[id(head)]] = {"style": "lm_head"}
    elif head is not None:
        raise _fail(f"LM head {names[id(head)]} ({type(head).__name__}) is not a linear of {vocab} rows")
    bname, blocks, by_index = _blocks(model, config.num_hidden_layers, config)
    entries.update(by_index)
    entries.update(_block_mlp(bname, blocks[0], h))
    for child, m in blocks[0].named_children():
        if not _tensors(m) or f"{bname}.*.{child}" in entries or \
                any(k == f"{bname}.0.{child}" or k.startswith(f"{bname}.0.{child}.") for k in by_index):
            continue
        where = f"{bname}.0.{child}"
        style = _attention(where, m, config, h) or _mlp(where, m, h)
        if style is None and _small(m, h):
            style = {"style": "replicated", "why": "per-hidden (norm, scale)"}
        if style is None:
            moe = _discover_moe(where, m, config, h)
            if moe is not None:
                entries.update({f"{bname}.*.{child}{sub}": st for sub, st in moe.items()})
                continue
            shapes = ", ".join(f"{n} {list(t.shape)}" for n, t in _tensors(m)[:4])
            raise _fail(f"cannot place {where} ({type(m).__name__}: {shapes}) as attention (heads x head_dim "
                        f"projections), MLP or a per-hidden module (linear attention, a state-space layer?)")
        entries[f"{bname}.*.{child}"] = style
    claimed = [n for n in entries if "*" not in n] + [bname]
    for n, t in _tensors(model):
        if any(n.startswith(c + ".") for c in claimed):
            continue
        owner = n.rsplit(".", 1)[0]
        if t.numel() > DEFAULT_REPLICATE_THRESHOLD:
            raise _fail(f"cannot place {n} {list(t.shape)} (outside the blocks, larger than the replicate "
                        f"threshold {DEFAULT_REPLICATE_THRESHOLD:,})")
        if t.dim() <= 1 and t.numel() <= h and owner not in entries and "." in n:
            entries[owner] = {"style": "replicated", "why": "per-hidden (norm, scale)"}
    return UserPlan([UserEntry(p, v["style"], {k: x for k, x in v.items() if k != "style"})
                     for p, v in entries.items()], f"{bname}.*", DEFAULT_REPLICATE_THRESHOLD, SOURCE)


def variants(plan: UserPlan) -> list[UserPlan]:
    """Plans with the same shapes that the proof tells apart: a fused projection of one KV head per query head has
    the shape of ``[q heads | k heads | v heads]`` and of GPT-NeoX's per-head ``[h0: q, k, v | h1: ...]`` rows
    alike; each such attention entry gets ``fused_layout: per_head`` in one further plan (where its names are the
    ones that layout's style takes). The first is ``plan`` itself."""
    out = [plan]
    for i, e in enumerate(plan.entries):
        a = e.args
        if e.style == "attention" and a.get("fused") == "query_key_value" and a.get("o_name") == "dense" and \
                a.get("kv_heads") == a.get("heads"):
            entries = list(plan.entries)
            entries[i] = UserEntry(e.pattern, e.style, {**a, "fused_layout": "per_head"})
            out.append(UserPlan(entries, plan.blocks, plan.replicate_threshold, plan.source))
    return out


def plan_dict(plan: UserPlan) -> dict:
    """The plan-file form of ``plan`` (what ``--plan-file`` reads back into the same :class:`UserPlan`)."""
    return {"blocks": plan.blocks, "replicate_threshold": plan.replicate_threshold,
            "entries": {e.pattern: {"style": e.style, **e.args} for e in plan.entries}}


def save_plan(plan: UserPlan, path: str) -> None:
    """Write ``plan`` as a JSON plan file (``--save-plan``), read back by ``--plan-file``."""
    with open(path, "w") as f:
        json.dump(plan_dict(plan), f, indent=1)
        f.write("\n")


def proof_layers(config, least: int = 2, most: int = 8) -> int:
    """Blocks of the proof's instance: ``least``, or as many as it takes for every value of each per-layer list
    of the config (``layer_types``, ``no_rope_layers``, ...: lists of ``num_hidden_layers`` items) to occur once,
    at most ``most``; never more than the model has."""
    n = config.num_hidden_layers
    k = least
    for v in vars(config).values():
        if isinstance(v, (list, tuple)) and len(v) == n:
            firsts = {}
            for i, x in enumerate(v):
                firsts.setdefault(repr(x), i)
            k = max(k, max(firsts.values(), default=0) + 1)
    return min(k, most, n)


def tiny_config(config, layers: int | None = None, vocab: int = 96, intermediate: int = 48):
    """A copy of ``config`` with ``layers`` blocks (default :func:`proof_layers`), a ``vocab``-row vocabulary and
    MLP width ``intermediate`` (the proof's instance): the same hidden size, head counts and head dim; per-layer
    lists cut to ``layers``; token ids outside the new vocabulary dropped."""
    c = copy.deepcopy(config)
    n = c.num_hidden_layers
    c.num_hidden_layers = min(layers or proof_layers(config), n)
    for k, v in list(vars(c).items()):
        if isinstance(v, (list, tuple)) and len(v) == n and n > c.num_hidden_layers:
            setattr(c, k, type(v)(v[:c.num_hidden_layers]))
    c.vocab_size = min(vocab, c.vocab_size)
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
        v = getattr(c, k, None)
        if isinstance(v, int) and v >= c.vocab_size or isinstance(v, list):
            setattr(c, k, None if k != "pad_token_id" else 0)
    if getattr(c, "intermediate_size", None):
        c.intermediate_size = min(intermediate, c.intermediate_size)
    _tiny_moe(c, intermediate)
    return c


def _tiny_moe(c, intermediate: int, experts: int = 8) -> None:
    """The proof instance's mixture-of-experts sizes, in place: at most ``experts`` routed experts (at least the
    top-k, so routing still chooses), expert and shared-expert widths at most ``intermediate``."""
    e = _num_experts(c)
    if e is not None and e > experts:
        k = getattr(c, "num_experts_per_tok", None) or 1
        for f in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"):
            if isinstance(getattr(c, f, None), int):
                setattr(c, f, max(experts, k))
    for f in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if isinstance(getattr(c, f, None), int):
            setattr(c, f, min(intermediate, getattr(c, f)))
