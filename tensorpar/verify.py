"""``tensorpar verify``: run the unsharded model and each sharded layout on the same inputs, module by module.

For every tp degree asked for, ranks are started (:func:`tensorpar.launch.run_ranks`, like ``generate``); each
rank builds the unsharded reference model and the sharded one from the same weights, runs both on the same
token ids with forward hooks, and compares, in execution order:

* the input embedding's output,
* per decoder block: its norms, its attention output, its MLP (or MoE) output, and the block output,
* the final norm, and the logits (gathered over the vocabulary);
* for the families of :mod:`tensorpar.lean`, the lean decode path that ``generate`` and ``serve`` run: the logits
  of a prefill of the first ``s - 1`` tokens and of one decode step of the last one;

with ``--train`` also the loss, every parameter's gradient (each rank's slice against the same slice of the
reference gradient), the global grad norm, and that every tp-replicated parameter (norm weights, replicated
biases) has a bit-identical gradient on every rank. Sequence-parallel activations are gathered along the
sequence before they are compared. Each rank compares what it holds; the reported difference is the maximum
over ranks.

Tolerance rule (:func:`tolerance`). Sharding changes only the order in which floating-point sums are added
(row-parallel all-reduce, the vocabulary-parallel log-sum-exp, matmuls of other shapes), never the math. A
reordered sum of ``K`` terms accumulated in fp32 errs by about ``u32 * sqrt(K)`` relative to its largest term
(random-walk rounding, Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., sec. 3.1 / 4.2;
``u32 = 2^-24``); a partial sum rounded to the compute dtype before the all-reduce adds ``u * sqrt(tp)``
(``u``: the dtype's unit roundoff, ``2^-24`` for float32, ``2^-8`` for bfloat16). Each block passed feeds that
error into the next, so the bound grows with the depth ``d`` (blocks passed, +1; twice that for gradients,
which go forward and back). With a safety factor ``C = 8``::

    tol = C * (u32 * sqrt(K) + u * sqrt(tp)) * (d + 1) * max(1, max|reference|)

The loss is held to what the logits allow: ``|d loss| <= 2 * max|d logits|`` (the log-sum-exp and the target
logit each move by at most the largest logit difference) plus the fp32 rule above with ``K = V`` and ``d = 0``
for the vocabulary-parallel log-sum-exp. ``K`` is the longest reduction of the model (the largest ``in_features`` of its linear layers). A real
sharding bug (a bias counted ``tp`` times, a missing all-reduce, a wrong slice) is off by the size of the
weights themselves, orders of magnitude above this bound.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn

from tensorpar import comm
from tensorpar.comm import Group

SAFETY = 8.0
U_ACC = 2.0 ** -24  # fp32 accumulation (CPU and CUDA matmuls accumulate low-precision inputs in fp32)


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the machine epsilon of ``dtype`` (``2^-24`` for float32, ``2^-8`` for bfloat16)."""
    return torch.finfo(dtype).eps / 2


def tolerance(dtype: torch.dtype, reduction_len: int, depth: int, tp_size: int, scale: float) -> float:
    """The largest difference sharding may cause (the rule of the module docstring).

    Args:
        dtype: compute dtype. reduction_len: ``K``, the longest sum of the model. depth: blocks passed before
        the compared value (0 for the embedding). tp_size: ranks. scale: ``max|reference|`` of the value.
    """
    per = U_ACC * math.sqrt(max(reduction_len, 1)) + unit_roundoff(dtype) * math.sqrt(tp_size)
    return SAFETY * per * (depth + 1) * max(1.0, scale)


@dataclass
class ModuleDiff:
    """One compared value: module (or ``loss``, ``grad <param>``, ...), its block (None outside blocks), kind,
    the largest absolute difference over ranks, and the tolerance."""

    name: str
    layer: int | None
    kind: str
    max_abs: float
    tol: float

    @property
    def ok(self) -> bool:
        return self.max_abs <= self.tol  # NaN is never ok


@dataclass
class LayoutReport:
    """Every comparison of one sharded layout, in execution order (forward, then gradients).

    ``replicated_mismatch``: tp-replicated parameters whose gradient is not bit-identical on every rank."""

    tp_size: int
    sequence_parallel: bool
    dtype: str
    diffs: list[ModuleDiff] = field(default_factory=list)
    replicated_mismatch: list[str] = field(default_factory=list)

    @property
    def first_failure(self) -> ModuleDiff | None:
        return next((d for d in self.diffs if not d.ok), None)

    @property
    def ok(self) -> bool:
        return self.first_failure is None and not self.replicated_mismatch

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        for x, y in zip(d["diffs"], self.diffs):
            x["ok"] = y.ok
        return d


def watched_modules(model: nn.Module, plan) -> list[tuple[str, str, int | None]]:
    """``(name, kind, layer)`` of the modules whose outputs are compared, found in the unsharded ``model``.

    Kinds: ``embedding`` (the input embedding), per block (``plan.blocks``) its direct children that are norms,
    attention or MLP/MoE, and the block itself (``block``); ``final norm`` (a norm outside every block).
    Outputs that sharding leaves split (q/k/v projections, intermediate activations) are not listed.
    """
    out: list[tuple[str, str, int | None]] = []
    emb = model.get_input_embeddings()
    emb_name = next(n for n, m in model.named_modules() if m is emb)
    out.append((emb_name, "embedding", None))
    blocks = [n for n, _ in plan.block_modules(model)]
    for i, b in enumerate(blocks):
        for child, m in model.get_submodule(b).named_children():
            kind = _kind(child, m)
            if kind is not None:
                out.append((f"{b}.{child}", kind, i))
        out.append((b, "block", i))
    for n, m in model.named_modules():
        if n and "norm" in type(m).__name__.lower() and not any(n == b or n.startswith(b + ".") for b in blocks):
            out.append((n, "final norm", None))
    return out


def _kind(child: str, m: nn.Module) -> str | None:
    low = child.lower()
    if "norm" in type(m).__name__.lower() or low.startswith("ln") or "norm" in low:
        return "norm"
    if "attn" in low or "attention" in low:
        return "attention"
    if "mlp" in low or "moe" in low or "feed_forward" in low or "experts" in low:
        return "mlp"
    return None


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return next((o for o in out if isinstance(o, torch.Tensor)), None)
    return getattr(out, "last_hidden_state", None)


def _to_full(x: torch.Tensor, like_shape: torch.Size, tp: Group, vocab=None) -> torch.Tensor:
    """Gather a sharded activation to the reference's shape: the sequence (dim 1, sequence parallelism), then the
    last dim (the vocabulary of the logits). Collectives: one all-gather per split dim (none if already full)."""
    x = x.detach()
    if x.dim() >= 2 and len(like_shape) == x.dim() and x.shape[1] != like_shape[1] and tp.size > 1:
        x = comm.all_gather(x.contiguous(), tp, 1)
    if x.shape[-1] != like_shape[-1] and tp.size > 1:
        x = comm.all_gather(x.contiguous(), tp, -1, vocab)
    return x


def _reduction_len(model: nn.Module) -> int:
    k = 1
    for m in model.modules():
        if isinstance(m, nn.Linear):
            k = max(k, m.in_features)
        elif type(m).__name__ == "Conv1D":  # GPT-2's transposed linear
            k = max(k, m.weight.shape[0])
    return k


def compare_to_reference(ref: nn.Module, par: nn.Module, tp: Group, input_ids: torch.Tensor, *,
                         train: bool = False) -> LayoutReport:
    """Run ``ref`` (unsharded, the same weights on every rank) and ``par`` (its :func:`~tensorpar.hf.apply.parallelize`
    d copy on this rank) on ``input_ids`` and compare them module by module (see the module docstring).

    Args:
        ref: the unsharded ``*ForCausalLM``. par: the sharded model (``par.tensorpar_plan`` set).
        tp: the tp group of ``par``. input_ids: ``[b, s]`` token ids, the same on every rank (``s`` divisible by
            tp under sequence parallelism).
        train: also compare the loss (next-token cross-entropy), every gradient, the grad norm, and the
            bit-equality of replicated parameters' gradients across ranks.

    Collectives: those of ``par``'s forward (and backward), an all-gather per compared sharded activation and
    per compared gradient-check, and one max all-reduce of all differences. Every rank returns the same report.
    """
    from tensorpar.grads import grad_norm, sync_duplicated_grads, sync_sequence_parallel_grads
    from tensorpar.layers import vocab_parallel_cross_entropy
    from tensorpar.testing import local_slice

    plan = par.tensorpar_plan
    watched = watched_modules(ref, plan)
    dtype = next(ref.parameters()).dtype
    k = _reduction_len(ref)
    nl = plan.num_layers
    ref_out: dict[str, torch.Tensor] = {}
    seen: set[str] = set()
    diffs: list[ModuleDiff] = []

    def depth(kind, layer):
        if kind == "embedding":
            return 0
        return nl + 1 if layer is None else layer + 1

    def tol_of(scale, d):
        return tolerance(dtype, k, d, tp.size, scale)

    def ref_hook(name):
        def hook(_m, _a, out):
            t = _first_tensor(out)
            if t is not None:
                ref_out[name] = t.detach()
        return hook

    def par_hook(name, kind, layer):
        def hook(_m, _a, out):
            t, r = _first_tensor(out), ref_out.get(name)
            if t is None or r is None:
                return
            full = _to_full(t, r.shape, tp, plan.vocab)
            seen.add(name)
            if full.shape != r.shape:   # a layout this check cannot gather: a failure, not a silent skip
                diffs.append(ModuleDiff(name, layer, kind, math.inf, 0.0))
                return
            diffs.append(_diff(name, layer, kind, full, r, tol_of, depth(kind, layer)))
        return hook

    handles = []
    try:
        for name, kind, layer in watched:
            handles.append(ref.get_submodule(name).register_forward_hook(ref_hook(name)))
        ref.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(train):
            logits_ref = ref(input_ids).logits
        for h in handles:
            h.remove()
        handles = []
        # before the sharded forward (whose autograd graph must not see the lean path fuse the projections)
        lean_diffs = _lean_diffs(par, tp, input_ids, logits_ref.detach(), tol_of, nl + 1)
        for name, kind, layer in watched:
            handles.append(par.get_submodule(name).register_forward_hook(par_hook(name, kind, layer)))
        par.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(train):
            logits = par(input_ids).logits
    finally:
        for h in handles:
            h.remove()
    # a watched module that ran in the reference but never in the sharded model (bypassed, replaced by a module
    # that does not call it) is a failure too
    for name, kind, layer in watched:
        if name in ref_out and name not in seen:
            diffs.append(ModuleDiff(name, layer, kind, math.inf, 0.0))
    diffs.extend(lean_diffs)
    full_logits = _to_full(logits, logits_ref.shape, tp, plan.vocab)
    diffs.append(_diff("logits", None, "logits", full_logits, logits_ref, tol_of, nl + 1))
    mismatch: list[str] = []
    if train:
        v = logits_ref.shape[-1]
        loss_ref = nn.functional.cross_entropy(logits_ref[:, :-1].float().reshape(-1, v), input_ids[:, 1:].reshape(-1))
        loss_ref.backward()
        loss = vocab_parallel_cross_entropy(logits[:, :-1], input_ids[:, 1:], tp, partition=par)
        loss.backward()
        sync_sequence_parallel_grads(par.parameters(), tp)
        sync_duplicated_grads(par.parameters(), tp)
        back = 2 * (nl + 1)
        # |d CE| <= 2 max|d logits| (log-sum-exp and the target logit each move by at most max|d logits|), plus
        # the fp32 reordering of the vocabulary-parallel log-sum-exp (a sum of V terms)
        dl = diffs[-1].max_abs
        loss_d = _diff("loss", None, "loss", loss.detach().float(), loss_ref.detach().float(), tol_of, 0)
        loss_d.tol = 2 * dl + tolerance(torch.float32, v, 0, tp.size, abs(loss_ref.item()))
        diffs.append(loss_d)
        refp = dict(ref.named_parameters())
        for n, p in par.named_parameters():
            rp = refp[n]
            if p.grad is None or rp.grad is None:
                diffs.append(ModuleDiff(f"grad {n}", _layer_of(n, plan), "grad", math.inf, 0.0))
                continue
            diffs.append(_diff(f"grad {n}", _layer_of(n, plan), "grad", p.grad, local_slice(rp.grad, p, tp.rank),
                               tol_of, back))
            if getattr(p, "tp_dim", None) is None and tp.size > 1:
                g0 = comm.broadcast(p.grad.detach().contiguous(), tp, src=0)
                if not torch.equal(g0, p.grad):
                    mismatch.append(n)
        diffs.append(_diff("grad norm", None, "grad norm", grad_norm(par.parameters(), tp).float(),
                           reference_grad_norm(ref.parameters()), tol_of, back))
    # the largest difference over ranks (a rank may hold a wrong slice the others do not see)
    dev = input_ids.device
    vals = torch.tensor([d.max_abs if not math.isnan(d.max_abs) else math.inf for d in diffs], dtype=torch.float64,
                        device=dev)
    vals = comm.all_reduce(vals, tp, op="max")
    for d, x in zip(diffs, vals.tolist()):
        d.max_abs = x
    flags = comm.all_reduce(torch.tensor([float(bool(mismatch))], dtype=torch.float64, device=dev), tp, op="max")
    if float(flags) and not mismatch:
        mismatch = ["(on another rank)"]
    return LayoutReport(tp.size, bool(plan.sequence_parallel), str(dtype).replace("torch.", ""), diffs, mismatch)


def reference_grad_norm(params) -> torch.Tensor:
    """The L2 norm of the gradients of ``params`` (a tied parameter once), summed in float64: the exact value the
    sharded :func:`tensorpar.grads.grad_norm` is held to (0-d float64 tensor on the gradients' device).

    Not ``torch.cat(grads).norm()``: PyTorch's CPU ``norm`` / ``linalg.vector_norm`` of a large float32 tensor
    accumulates in one float32 running sum (no cascade summation, unlike ``sum``), which loses about 1.6 % of a
    135M-element norm (SmolLM2's gradient; pytorch/pytorch#169237, #151761), far above :func:`tolerance`.
    """
    seen: set[int] = set()
    sq = None
    for p in params:
        if p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        s = p.grad.detach().double().pow(2).sum()
        sq = s if sq is None else sq + s
    return torch.zeros((), dtype=torch.float64) if sq is None else sq.sqrt()


def _lean_diffs(par, tp: Group, input_ids: torch.Tensor, logits_ref: torch.Tensor, tol_of, depth) -> list:
    """The lean decode path (:mod:`tensorpar.lean`, what ``generate`` and ``serve`` run) against the reference:
    a prefill of ``input_ids[:, :-1]`` and one decode step of the last token, their logits compared with the
    reference's at positions ``s-2`` and ``s-1``. Empty when the model does not run that path."""
    from tensorpar.lean import LeanDecoder, lean_unsupported

    b, s = input_ids.shape
    if s < 2 or lean_unsupported(par) is not None:
        return []
    lean = LeanDecoder(par, tp, max_batch=b, max_len=s)
    pos = torch.arange(s, device=input_ids.device).expand(b, s)
    with torch.no_grad():
        first = lean.prefill(input_ids[:, :-1], torch.ones_like(input_ids[:, :-1]), pos[:, :-1])
        step = lean.decode(input_ids[:, -1:], pos[:, -1:], s - 1)
    out = []
    for name, got, want in (("lean prefill logits", first, logits_ref[:, -2]), ("lean decode logits", step,
                                                                                 logits_ref[:, -1])):
        full = _to_full(got[:, None], want[:, None].shape, tp, par.tensorpar_plan.vocab)
        out.append(_diff(name, None, "logits", full, want[:, None], tol_of, depth))
    return out


def _diff(name, layer, kind, actual, expected, tol_of, depth) -> ModuleDiff:
    a, b = actual.detach().double(), expected.detach().double()
    if a.shape != b.shape:
        return ModuleDiff(name, layer, kind, math.inf, 0.0)
    m = (a - b).abs().max().item() if a.numel() else 0.0
    if not math.isfinite(m) and torch.equal(a, b):
        m = 0.0
    scale = b.abs().max().item() if b.numel() else 0.0
    return ModuleDiff(name, layer, kind, m, tol_of(scale, depth))


def _layer_of(param_name: str, plan) -> int | None:
    from tensorpar.hf.plan import pattern_regex
    rx = pattern_regex(plan.blocks)
    parts = param_name.split(".")
    for i in range(1, len(parts)):
        if rx.match(".".join(parts[:i])):
            try:
                return int(parts[i - 1])
            except ValueError:
                return None
    return None


# ---------------------------------------------------------------- command line

def add_arguments(p: argparse.ArgumentParser) -> None:
    from tensorpar.cli import add_launch_arguments

    p.add_argument("--model", default="smollm2",
                   help="a training preset (tiny, small, bench; random weights, seed 0), a Hugging Face-format "
                        "folder, or 'smollm2'")
    add_launch_arguments(p, tp_list=True)  # --tp-weights numbers: applied to the --tp degree with as many ranks;
    #                                        auto: to every degree above 1
    p.add_argument("--sequence-parallel", action="store_true", help="shard with sequence parallelism")
    p.add_argument("--train", action="store_true", help="also compare loss, every gradient and the grad norm")
    from tensorpar.generate import add_quantize_argument
    add_quantize_argument(p)  # int8: both the reference (plain PyTorch) and the sharded model are quantized
    p.add_argument("--seq-len", type=int, default=0,
                   help="tokens per row (default: the smallest multiple of every tp that is >= 16)")
    p.add_argument("--batch-size", type=int, default=2, help="rows of random token ids")
    p.add_argument("--json", default=None, help="also write the full report to this file")


def _parse_tp(text: str) -> list[int]:
    try:
        tps = [int(t) for t in str(text).split(",") if t.strip()]
    except ValueError:
        tps = []
    if not tps or any(t < 1 for t in tps):
        raise ValueError(f"--tp {text!r}: give comma-separated positive integers, e.g. --tp 2,3,4")
    return tps


def _model_config(spec: str, seq_len: int):
    """``(config, folder or None)`` of ``--model``."""
    from tensorpar.hf.presets import PRESETS, preset_config

    if spec in PRESETS:
        return preset_config(spec, PRESET_VOCAB, seq_len), None
    from transformers import AutoConfig

    from tensorpar.hub import resolve_model
    folder = str(resolve_model(spec))
    return AutoConfig.from_pretrained(folder), folder


PRESET_VOCAB = 997  # prime: every tp > 1 splits it unevenly


def validate(args: argparse.Namespace):
    """Checks made once, before any rank starts. Returns ``(tps, seq_len, config, folder)``."""
    from tensorpar.hf.families import is_causal_lm
    from tensorpar.hf.plan import make_plan

    tps = _parse_tp(args.tp)
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    lcm = math.lcm(*tps)
    seq = args.seq_len or lcm * math.ceil(16 / lcm)
    if seq < 2:
        raise ValueError(f"--seq-len must be >= 2 (the loss needs a next token), got {seq}")
    if args.sequence_parallel and seq % lcm:
        raise ValueError(f"--seq-len {seq} is not divisible by every tp in {tps} (sequence parallelism needs it); "
                         f"use a multiple of {lcm}")
    from tensorpar.cli import check_launch_arguments
    check_launch_arguments(args)
    config, folder = _model_config(args.model, seq)
    if not is_causal_lm(getattr(config, "model_type", None)):
        raise ValueError(f"{args.model}: model_type={config.model_type!r} is not a causal language model; verify "
                         f"runs decoders")
    from tensorpar.hf.load import resolve_attn_implementation
    args.attn_implementation = resolve_attn_implementation(config)  # decided here; every rank runs this one
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and seq > limit:
        raise ValueError(f"--seq-len {seq} exceeds the model's max_position_embeddings={limit}")
    if getattr(args, "quantize", "none") != "none" and getattr(args, "train", False):
        raise ValueError(f"--quantize {args.quantize} cannot run with --train (a quantized model has no trainable "
                         f"weights: int8 is for inference); drop --train or use --quantize none")
    for t in tps:
        plan = make_plan(config, t, sequence_parallel=args.sequence_parallel)  # unsupported model / tp: ValueError
        from tensorpar.generate import check_quantize
        check_quantize(getattr(args, "quantize", "none"), config, plan)
    w = getattr(args, "tp_weights", None)
    if w is not None and str(w).strip().lower() != "auto":
        from tensorpar.capacity import check_for_model
        n = len(str(w).split(","))
        if n not in tps:
            raise ValueError(f"--tp-weights {w} has {n} entries but no --tp degree in {tps} has {n} ranks; give one "
                             f"weight per rank of one of the degrees (or 'auto')")
        args.tp_weights = check_for_model(w, n, config, sequence_parallel=args.sequence_parallel)
    return tps, seq, config, folder


def _weights_for(args: argparse.Namespace, tp_size: int):
    """The ``tp_weights`` a verify run at ``tp_size`` shards with (see ``--tp-weights``)."""
    w = getattr(args, "tp_weights", None)
    if w is None or tp_size == 1:
        return None
    if isinstance(w, str) and w.strip().lower() == "auto":
        return "auto"
    return tuple(w) if len(w) == tp_size else None


def _rank_main(spec: str, folder: str | None, tp_size: int, seq: int, args: argparse.Namespace, out_path: str) -> int:
    from tensorpar.parallel import ParallelConfig, init_parallel

    world = int(os.environ.get("WORLD_SIZE", "1"))
    ctx = init_parallel(ParallelConfig(tp=world, tp_weights=_weights_for(args, world)), timeout_s=args.timeout,
                        fast_collectives=args.fast_collectives)
    try:
        from tensorpar.capacity import resolve_for_model
        dtype = getattr(torch, args.dtype)
        weights = resolve_for_model(ctx, _model_config(spec, seq)[0]) if ctx.tp_weights is not None else None
        ref, par = build_pair(spec, folder, ctx.tp, dtype=dtype, device=ctx.device, seq_len=seq,
                              sequence_parallel=args.sequence_parallel, tp_weights=weights,
                              attn_implementation=getattr(args, "attn_implementation", None))
        if getattr(args, "quantize", "none") == "int8":
            from tensorpar.quant import quantize_int8, quantize_reference_int8
            quantize_reference_int8(ref)
            quantize_int8(par, ctx.tp)
        g = torch.Generator().manual_seed(1234)
        ids = torch.randint(0, ref.config.vocab_size, (args.batch_size, seq), generator=g).to(ctx.device)
        from tensorpar import fingerprint
        checking = args.check_collectives or fingerprint.enable_from_env(ctx.tp) is not None
        if checking:   # the sharded model's collectives and the inputs compared, once before and once after
            fingerprint.enable(ctx.tp, timeout_s=min(args.timeout / 2, 60.0), model=par)  # sites: par's modules
            fingerprint.check(ctx.tp, {"input_ids": ids}, force=True)
        rep = compare_to_reference(ref, par, ctx.tp, ids, train=args.train)
        if checking:
            fingerprint.check(ctx.tp, force=True)
        if ctx.rank == 0:
            tmp = out_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(dict(rep.to_dict(), tp_weights=list(weights) if weights else None), f)
            os.replace(tmp, out_path)
    finally:
        ctx.destroy()
    return 0


def build_pair(spec: str, folder: str | None, tp: Group, *, dtype=torch.float32, device=None, seq_len: int = 16,
               sequence_parallel: bool = False, tp_weights=None, attn_implementation: str | None = None):
    """``(reference, sharded)``: the unsharded model and this rank's sharded copy, same weights, eval mode.
    ``tp_weights``: shard by these relative rank speeds (:mod:`tensorpar.capacity`; default even).
    ``attn_implementation``: both models' attention; None: the one transformers picks for the config
    (:func:`~tensorpar.hf.load.resolve_attn_implementation`).

    A folder is loaded twice: whole (transformers) and sharded (:func:`~tensorpar.hf.load.build_parallel_model`,
    the path ``generate`` and ``train`` use, so load bugs show). A preset gets random weights (seed 0, norms
    perturbed too) on every rank."""
    from transformers import AutoModelForCausalLM

    from tensorpar.hf.apply import parallelize
    from tensorpar.hf.plan import make_plan

    if folder is not None:
        from tensorpar.hf.load import build_parallel_model
        ref = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn_implementation)
        par, _ = build_parallel_model(folder, tp, sequence_parallel=sequence_parallel, dtype=dtype, device=device,
                                      tp_weights=tp_weights, attn_implementation=attn_implementation)
    else:
        config, _ = _model_config(spec, seq_len)
        from tensorpar.hf.load import resolve_attn_implementation
        config._attn_implementation = attn_implementation or resolve_attn_implementation(config)
        torch.manual_seed(0)
        ref = AutoModelForCausalLM.from_config(config).float()
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        ref = ref.to(dtype)
        par = parallelize(copy.deepcopy(ref), make_plan(config, tp.size, sequence_parallel=sequence_parallel,
                                                        tp_weights=tp_weights), tp)
    ref = ref.to(device).eval()
    return ref, par.to(device).eval()


def format_table(reports: list[dict]) -> str:
    """One row per compared module kind and tp: the largest difference and its tolerance."""
    lines = [f"{'tp':>3} {'module':<44} {'layer':>5} {'max |diff|':>11} {'tolerance':>11}  ok"]
    for r in reports:
        for d in r["diffs"]:
            if d["kind"] == "grad":
                continue
            layer = "" if d["layer"] is None else str(d["layer"])
            lines.append(f"{r['tp_size']:>3} {d['name'][:44]:<44} {layer:>5} {d['max_abs']:>11.3e} {d['tol']:>11.3e}"
                         f"  {'yes' if d['ok'] else 'NO'}")
        grads = [d for d in r["diffs"] if d["kind"] == "grad"]
        if grads:
            worst = max(grads, key=lambda d: d["max_abs"] / max(d["tol"], 1e-300))
            lines.append(f"{r['tp_size']:>3} {'gradients: ' + str(len(grads)) + ' params, worst ' + worst['name'][5:]:<44}"
                         f" {'':>5} {worst['max_abs']:>11.3e} {worst['tol']:>11.3e}  "
                         f"{'yes' if all(d['ok'] for d in grads) else 'NO'}")
            lines.append(f"{r['tp_size']:>3} {'replicated grads bit-identical across ranks':<44} {'':>5} {'':>11} "
                         f"{'':>11}  {'NO' if r['replicated_mismatch'] else 'yes'}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    import sys
    import tempfile

    from tensorpar.launch import run_ranks

    try:
        tps, seq, config, folder = validate(args)
    except (ValueError, FileNotFoundError, OSError) as e:
        from tensorpar.launch import report_error
        report_error(str(e))
        return 2
    reports = []
    with tempfile.TemporaryDirectory(prefix="tensorpar-verify-") as tmp:
        for t in tps:
            out = os.path.join(tmp, f"tp{t}.json")
            rc = run_ranks(_rank_main, t, args.model, folder, t, seq, args, out, verbose=getattr(args, "verbose", False))
            if rc:
                return rc
            with open(out) as f:
                reports.append(json.load(f))
    if args.json:
        tmpf = args.json + ".tmp"
        with open(tmpf, "w") as f:
            json.dump({"model": args.model, "dtype": args.dtype, "quantize": getattr(args, "quantize", "none"),
                       "seq_len": seq, "batch_size": args.batch_size, "train": args.train, "sequence_parallel": args.sequence_parallel, "layouts": reports}, f,
                      indent=1)
        os.replace(tmpf, args.json)
    for r in reports:
        first = next((d for d in r["diffs"] if not d["ok"]), None)
        if first is not None:
            where = "" if first["layer"] is None else f", layer {first['layer']}"
            print(f"tensorpar verify: FAILED at tp={r['tp_size']}: {first['name']} ({first['kind']}{where}): "
                  f"max |diff| {first['max_abs']:.3e} > tolerance {first['tol']:.3e}", file=sys.stderr)
            return 1
        if r["replicated_mismatch"]:
            print(f"tensorpar verify: FAILED at tp={r['tp_size']}: gradients of tp-replicated parameters differ "
                  f"between ranks: {', '.join(r['replicated_mismatch'][:8])}", file=sys.stderr)
            return 1
    print(format_table(reports))
    wts = "".join(f", tp={r['tp_size']} weights {','.join(f'{v:g}' for v in r['tp_weights'])}" for r in reports
                  if r.get("tp_weights"))
    q8 = ", int8 weights (both models quantized)" if getattr(args, "quantize", "none") == "int8" else ""
    print(f"tensorpar verify: OK: {args.model} at tp {','.join(map(str, tps))} ({args.dtype}{q8}{wts}"
          f"{', sequence parallel' if args.sequence_parallel else ''}{', train' if args.train else ''}) matches the "
          f"unsharded model within tolerance")
    return 0
