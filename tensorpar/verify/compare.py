"""The comparison of a sharded model with its unsharded reference, module by module (:func:`compare_to_reference`).

Forward hooks on the watched modules (:func:`watched_modules`: the embedding, each block's norms, attention, MLP
and output, the final norm) record the reference's outputs and the sharded model's, gathered to the reference's
shape; the logits, the lean decode path's logits, and with ``train`` the loss, every gradient and the grad norm
(against :func:`reference_grad_norm`) are compared too, each against :func:`~tensorpar.verify.policy.tolerance`.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from tensorpar import comm
from tensorpar.comm import Group
from tensorpar.decode.int8 import int8_weights
from tensorpar.verify.policy import LayoutReport, ModuleDiff, q8_tolerance, tolerance

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


def _input_tensor(args, kwargs):
    """The module's main input: its first positional tensor, else ``hidden_states`` / ``input_ids``."""
    x = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if x is None:
        x = kwargs.get("hidden_states", kwargs.get("input_ids"))
    return x if isinstance(x, torch.Tensor) else None


def _own_diff(ref_module: nn.Module, args, kwargs, ref_in_shape, full: torch.Tensor, tp: Group, name, layer, kind,
              tol_of, noise: float = 0.0) -> ModuleDiff:
    """The sharded module's own error: its output (gathered, ``full``) against the unsharded module run on the
    same input the sharded one received (gathered along the sequence under sequence parallelism), held to the
    rule at depth 0 relative to that output's ``max|.|``.

    The propagated comparison (the same module fed by the reference's own upstream activations) grows its bound
    with the depth, and in bf16 that bound passes a missing all-reduce in a deep block; this one does not: a
    sharding fault inside the module is off by about its own output, ``~1/(SAFETY u sqrt(tp))`` times the bound.
    ``noise``: ``--quantize int8``'s noise of the module's output in the whole forward (:func:`q8_tolerance`; the
    module alone on the same input re-rounds no more than that). Collectives: one all-gather of the input under
    sequence parallelism. A reference that cannot run on the sharded module's input is a failure (``inf``), never
    a skip."""
    x = _input_tensor(args, kwargs)
    try:
        if x is not None and ref_in_shape is not None and x.shape != ref_in_shape:
            fx = _to_full(x, ref_in_shape, tp)
            args = tuple(fx if a is x else a for a in args)
            kwargs = {k: (fx if v is x else v) for k, v in kwargs.items()}
        # a KV cache filled by the sharded run holds the rank's heads only: the reference recomputes without it
        args = tuple(None if _is_cache(a) else a for a in args)
        kwargs = {k: (None if _is_cache(v) else v) for k, v in kwargs.items()}
        with torch.no_grad():
            own = _first_tensor(ref_module(*args, **kwargs))
    except Exception:   # noqa: BLE001 - reported as a failure of this module
        own = None
    if own is None or own.shape != full.shape:
        return ModuleDiff(name, layer, f"{kind} (own)", math.inf, 0.0)
    return _diff(name, layer, f"{kind} (own)", full, own, tol_of, 0, relative=True, noise=noise)


def _is_cache(v) -> bool:
    return any(c.__name__.endswith("Cache") for c in type(v).__mro__)


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
                         train: bool = False, quantize: str = "none") -> LayoutReport:
    """Run ``ref`` (unsharded, the same weights on every rank) and ``par`` (its :func:`~tensorpar.hf.apply.parallelize`
    d copy on this rank) on ``input_ids`` and compare them module by module (see the module docstring).

    Args:
        ref: the unsharded ``*ForCausalLM``, unquantized. par: the sharded model (``par.tensorpar_plan`` set), with
            ``quantize`` its weights stored so (:func:`tensorpar.decode.quantize.apply_quantize`).
        tp: the tp group of ``par``. input_ids: ``[b, s]`` token ids, the same on every rank (``s`` divisible by
            tp under sequence parallelism).
        train: also compare the loss (next-token cross-entropy), every gradient, the grad norm, and the
            bit-equality of replicated parameters' gradients across ranks.
        quantize: ``--quantize`` of ``par``: ``ref`` is quantized here the same way in plain PyTorch
            (:func:`tensorpar.decode.quantize.quantize_reference`). ``bf16``: both multiply the same bf16 values in
            fp32, held to the fp rule. ``int8``: ``ref`` runs once unquantized first, and each value is held to
            :func:`q8_tolerance` of its int8 noise (the embedding, a lookup, to the fp rule).

    Collectives: those of ``par``'s forward (and backward), an all-gather per compared sharded activation and
    per compared gradient-check, and one max all-reduce of all differences. Every rank returns the same report.
    Raises ValueError for a ``quantize`` other than none with ``train``, or int8 with a ``par`` not stored as int8
    (its tolerance would then excuse the quantization itself).
    """
    from tensorpar.grads import grad_norm, sync_duplicated_grads, sync_sequence_parallel_grads
    from tensorpar.layers import vocab_parallel_cross_entropy
    from tensorpar.testing import local_slice

    from tensorpar.decode.quantize import QUANTIZE_CHOICES, quantize_reference

    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize={quantize!r}: use one of {', '.join(QUANTIZE_CHOICES)}")
    q8 = quantize == "int8"     # bf16: the fp rule (both multiply the same bf16 values in fp32)
    if quantize != "none" and train:
        raise ValueError(f"quantize={quantize!r} with train=True: a quantized model is for inference; use "
                         f"train=False or quantize='none'")
    if q8 and (int8_weights(par) or {}).get("format") != "int8":
        raise ValueError("quantize='int8': the sharded model is not stored as int8; call "
                         "tensorpar.decode.quantize.apply_quantize(par, tp, 'int8') first")
    plan = par.tensorpar_plan
    watched = watched_modules(ref, plan)
    dtype = next(ref.parameters()).dtype
    k = _reduction_len(ref)
    nl = plan.num_layers
    ref_out: dict[str, list[torch.Tensor]] = {}     # per call: a module may run twice (NanoChat's norm)
    fp_out: dict[str, list[torch.Tensor]] = {}      # int8: the unquantized reference's, per call
    seen: set[str] = set()
    diffs: list[ModuleDiff] = []

    def depth(kind, layer):
        if kind == "embedding":
            return 0
        return nl + 1 if layer is None else layer + 1

    def tol_of(scale, d, relative=False, noise=0.0):
        t = tolerance(dtype, k, d, tp.size, scale, relative=relative)
        return q8_tolerance(t, noise) if q8 else t

    def noise_of(name, i, kind):
        """int8: max|Q - F| of call ``i`` of ``name`` (q8_tolerance); 0 for the embedding (a lookup of the same
        stored rows on both sides: nothing upstream re-rounds)."""
        f = fp_out.get(name) or []
        if not q8 or kind == "embedding" or i >= len(f) or f[i].shape != ref_out[name][i].shape:
            return 0.0
        return _max_abs(ref_out[name][i], f[i])

    ref_in: dict[str, list[torch.Size]] = {}
    par_calls: dict[str, int] = {}

    def ref_hook(name, into=ref_out):
        def hook(_m, args, kwargs, out):
            t, x = _first_tensor(out), _input_tensor(args, kwargs)
            if t is not None:
                into.setdefault(name, []).append(t.detach())
                if into is ref_out:
                    ref_in.setdefault(name, []).append(x.shape if x is not None else None)
        return hook

    logits_fp = None
    if q8:      # the unquantized reference first: each value's int8 noise
        handles = [ref.get_submodule(name).register_forward_hook(ref_hook(name, fp_out), with_kwargs=True)
                   for name, _, _ in watched]
        try:
            with torch.no_grad():
                logits_fp = ref(input_ids).logits.detach()
        finally:
            for h in handles:
                h.remove()
    quantize_reference(ref, quantize)

    def par_hook(name, kind, layer):
        def hook(_m, args, kwargs, out):
            i = par_calls[name] = par_calls.get(name, -1) + 1        # the i-th call against the reference's i-th
            t, r = _first_tensor(out), (ref_out.get(name) or [])[i:i + 1]
            if t is None or not r:
                return
            r, x_shape = r[0], ref_in[name][i]
            full = _to_full(t, r.shape, tp, plan.vocab)
            seen.add(name)
            if full.shape != r.shape:   # a layout this check cannot gather: a failure, not a silent skip
                diffs.append(ModuleDiff(name, layer, kind, math.inf, 0.0))
                return
            noise = noise_of(name, i, kind)
            diffs.append(_diff(name, layer, kind, full, r, tol_of, depth(kind, layer), noise=noise))
            diffs.append(_own_diff(ref.get_submodule(name), args, kwargs, x_shape, full, tp, name, layer,
                                   kind, tol_of, noise))
        return hook

    handles = []
    try:
        for name, kind, layer in watched:
            handles.append(ref.get_submodule(name).register_forward_hook(ref_hook(name), with_kwargs=True))
        ref.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(train):
            logits_ref = ref(input_ids).logits
        for h in handles:
            h.remove()
        handles = []
        # before the sharded forward (whose autograd graph must not see the lean path fuse the projections)
        lean_diffs = _lean_diffs(par, tp, input_ids, logits_ref.detach(), tol_of, nl + 1, logits_fp)
        for name, kind, layer in watched:
            handles.append(par.get_submodule(name).register_forward_hook(par_hook(name, kind, layer), with_kwargs=True))
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
    diffs.append(_diff("logits", None, "logits", full_logits, logits_ref, tol_of, nl + 1,
                       noise=0.0 if logits_fp is None else _max_abs(logits_ref, logits_fp)))
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
            if not p.requires_grad and not rp.requires_grad:   # frozen in the model (a router's score correction)
                continue
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


def _lean_diffs(par, tp: Group, input_ids: torch.Tensor, logits_ref: torch.Tensor, tol_of, depth,
                logits_fp: torch.Tensor | None = None) -> list:
    """The lean decode path (:mod:`tensorpar.decode.lean`, what ``generate`` and ``serve`` run) against the reference:
    a prefill of ``input_ids[:, :-1]`` and one decode step of the last token, their logits compared with the
    reference's at positions ``s-2`` and ``s-1`` (``logits_fp``: the unquantized reference's ``[b, s, V]``, whose
    difference there is the int8 noise, :func:`q8_tolerance`). Empty when the model does not run that path."""
    from tensorpar.decode.lean import LeanDecoder
    from tensorpar.decode.prepare import lean_unsupported
    from tensorpar.decode.packed import unpack_weights

    b, s = input_ids.shape
    if s < 2 or lean_unsupported(par) is not None:
        return []
    lean = LeanDecoder(par, tp, max_batch=b, max_len=s)
    pos = torch.arange(s, device=input_ids.device).expand(b, s)
    with torch.no_grad():
        first = lean.prefill(input_ids[:, :-1], torch.ones_like(input_ids[:, :-1]), pos[:, :-1])
        step = lean.decode(input_ids[:, -1:], pos[:, -1:], s - 1)
    del lean
    unpack_weights(par)     # the plain parameters again for the module path's forward and backward
    out = []
    for name, pos, got in (("lean prefill logits", -2, first), ("lean decode logits", -1, step)):
        want = logits_ref[:, pos]
        full = _to_full(got[:, None], want[:, None].shape, tp, par.tensorpar_plan.vocab)
        noise = 0.0 if logits_fp is None else _max_abs(want, logits_fp[:, pos])
        out.append(_diff(name, None, "logits", full, want[:, None], tol_of, depth, noise=noise))
    return out


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a - b|`` in float64 (0 for empty tensors)."""
    return (a.detach().double() - b.detach().double()).abs().max().item() if a.numel() else 0.0


def _diff(name, layer, kind, actual, expected, tol_of, depth, relative=False, noise=0.0) -> ModuleDiff:
    a, b = actual.detach().double(), expected.detach().double()
    if a.shape != b.shape:
        return ModuleDiff(name, layer, kind, math.inf, 0.0)
    m = (a - b).abs().max().item() if a.numel() else 0.0
    if not math.isfinite(m) and torch.equal(a, b):
        m = 0.0
    scale = b.abs().max().item() if b.numel() else 0.0
    return ModuleDiff(name, layer, kind, m, tol_of(scale, depth, relative, noise))


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
