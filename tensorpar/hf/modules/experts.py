"""Mixture-of-experts modules: experts split inside each expert over tp (:class:`TPExperts`), whole experts over an
ep group with all-to-all (:class:`EPExperts`, :func:`expert_parallelize`), and Qwen2-MoE's block with its shared
expert (:class:`TPSharedExpertMoE`).
"""
from __future__ import annotations

import sys

import torch
import torch.nn as nn

from tensorpar import comm
from tensorpar.comm import Group
from tensorpar.hf.modules.mlp import TPGatedMLP
from tensorpar.shard import Partition, UnitSelection

def _check_expert_layout(experts: nn.Module) -> None:
    for attr, bad in (("has_bias", True), ("is_transposed", True), ("is_concatenated", False),
                      ("has_post_expert_norm", True), ("has_gate", False)):
        if getattr(experts, attr, not bad) == bad:
            raise ValueError(f"{type(experts).__name__}.{attr}={bad} is not supported by tensorpar's sharded experts "
                             f"(they shard stacked, concatenated [gate | up] weights without biases or post-expert "
                             f"norms)")


def _take_expert_attrs(new: nn.Module, experts: nn.Module) -> None:
    """Give ``new`` what transformers' experts kernels read from ``self``: the plain attributes of ``experts``
    (config, sizes, layout flags), its ``act_fn``, its ``_apply_gate``, and its class's forward
    (``_hf_forward``: the dispatching one; ``_hf_eager``: the class's own loop). ``experts`` may itself be one of
    ours (a :class:`TPExperts` wrapped again by :class:`EPExperts`): the transformers class (``_hf_class``) is
    then the one it was built from."""
    cls = getattr(experts, "_hf_class", type(experts))
    new._hf_class = cls
    new._hf_forward = cls.forward
    new._hf_eager = getattr(new._hf_forward, "__wrapped__", new._hf_forward)
    for k, v in vars(experts).items():
        if not k.startswith("_") and k != "training":
            setattr(new, k, v)
    if hasattr(experts, "_is_expert_parallel"):
        new._is_expert_parallel = experts._is_expert_parallel
    for k, m in experts.named_children():
        setattr(new, k, m)
    if hasattr(cls, "_apply_gate"):            # grouped_mm / batched_mm call self._apply_gate
        new._apply_gate = cls._apply_gate.__get__(new)


def _experts_fn(mod: nn.Module, rows: int):
    """The kernel to run: the config's, unless it is ``grouped_mm`` and ``rows`` (elements) are not 16 bytes."""
    if getattr(mod.config, "_experts_implementation", None) == "grouped_mm" and \
            (rows * mod.down_proj.element_size()) % 16:
        return mod._hf_eager
    return mod._hf_forward


class TPExperts(nn.Module):
    """Mixture-of-experts experts with tensor parallelism inside every expert (transformers 5 stacked layout).

    Replaces the ``*Experts`` module of a sparse MoE block (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), whose weights
    are stacked over experts: ``gate_up_proj [E, 2f, h]`` (rows ``[gate | up]`` of every expert) and
    ``down_proj [E, h, f]``. Rank ``r`` holds ``gate_up_proj [E, 2 f_r, h]`` (its gate rows, then its up rows:
    column-parallel, never one contiguous block of ``2f``) and ``down_proj [E, h, f_r]`` (row-parallel), with
    ``f_r = partition.sizes[tp_rank]``; the router stays replicated outside this module.

    The expert math is transformers' own: the forward of the original class is called on this module (so the
    experts implementation the config selects, ``eager``, ``grouped_mm`` or ``batched_mm``, runs unchanged on
    the local weights); it yields each token's routing-weighted sum of its experts' partial outputs, and the
    partial sums of all experts are added over tp once, after the combine. ``grouped_mm`` needs rows of a
    multiple of 16 bytes: a rank whose ``f_r`` rows are not (e.g. ``f_r = 5`` in fp32) runs the class's eager
    loop instead (same math; the other ranks are unaffected).

    Shapes: ``hidden_states [T, h]`` (tokens flattened, replicated), ``top_k_index [T, k]`` (int),
    ``top_k_weights [T, k]`` (replicated) -> ``[T, h]`` replicated.

    Collectives: forward one all-reduce of ``[T, h]`` per MoE layer (not one per expert); backward one
    all-reduce of the input gradient ``[T, h]`` and one of the routing-weight gradient ``[T, k]`` (each rank's
    weight gradient is a partial sum over its ``f_r`` intermediate rows, so the router receives the full one).
    A step in which some expert receives no token is the same on every rank (routing is replicated), so no
    rank waits on another.

    Raises:
        ValueError: an experts layout this class does not shard (biases, transposed or interleaved gate/up
            weights, a post-expert norm, ungated experts), naming the attribute.
    """

    def __init__(self, experts: nn.Module, tp: Group, *, partition: Partition, region: bool = True):
        super().__init__()
        from tensorpar.layers.linear import _slice, mark_sharded

        _check_expert_layout(experts)
        #: False inside :class:`TPSharedExpertMoE`, which enters and leaves the tp region once for the whole block
        self.region = region
        e, two_f, h = experts.gate_up_proj.shape
        f = two_f // 2
        if partition.n != f or partition.tp_size != tp.size or tuple(experts.down_proj.shape) != (e, h, f):
            raise ValueError(f"expert partition {list(partition.sizes)} does not split the experts' intermediate "
                             f"size {f} (gate_up_proj {tuple(experts.gate_up_proj.shape)}, down_proj "
                             f"{tuple(experts.down_proj.shape)}) over tp_size={tp.size}")
        self.tp, self.partition = tp, partition
        _take_expert_attrs(self, experts)
        self.intermediate_dim = partition.sizes[tp.rank]
        rows = UnitSelection(2 * f, 1, tuple(tuple(partition.indices(r)) + tuple(f + i for i in partition.indices(r))
                                             for r in range(tp.size)))
        gu = _slice(experts.gate_up_proj.detach(), 1, rows, tp.rank).clone()
        dn = _slice(experts.down_proj.detach(), 2, partition, tp.rank).clone()
        self.gate_up_proj = mark_sharded(nn.Parameter(gu, requires_grad=experts.gate_up_proj.requires_grad), 1, rows)
        self.down_proj = mark_sharded(nn.Parameter(dn, requires_grad=experts.down_proj.requires_grad), 2, partition)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        x = comm.copy_to_tp_region(hidden_states, self.tp) if self.region else hidden_states
        w = comm.copy_to_tp_region(top_k_weights, self.tp) if self.region else top_k_weights
        # torch._grouped_mm needs 16-byte strides; where this rank's f_r rows do not have them, the eager loop
        partial = _experts_fn(self, self.intermediate_dim)(self, x, top_k_index, w)  # [T, h]: this rank's f_r rows
        return comm.reduce_from_tp_region(partial, self.tp) if self.region else partial

    def extra_repr(self) -> str:
        return (f"tp={self.tp.size}, experts={self.num_experts}, intermediate local {self.intermediate_dim} "
                f"of {self.partition.n}")


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` with row splits; backward is the all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, x, group, send: list[int], recv: list[int]):
        import torch.distributed as dist
        ctx.group, ctx.send, ctx.recv = group, send, recv
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group.pg)
        group.counter.record("all_to_all", x.numel(), x.element_size(), group.size)
        return out

    @staticmethod
    def backward(ctx, g):
        return _AllToAll.apply(g.contiguous(), ctx.group, ctx.recv, ctx.send), None, None, None


class EPExperts(nn.Module):
    """Mixture-of-experts experts distributed whole over an expert-parallel group, tokens moved by all-to-all.

    Rank ``r`` of ``ep`` holds experts ``[lo_r, hi_r)`` of ``partition`` (the ``E`` experts split over
    ``ep_size``, unevenly if need be): ``gate_up_proj [E_r, 2f, h]``, ``down_proj [E_r, h, f]``, marked
    ``ep_dim = 0`` over ``partition`` (:func:`tensorpar.grads.grad_norm` with ``ep=`` sums them over ep), and
    also ``tp_dim = 0`` so checkpoint loading given the ``ep`` group as its tp group reads this rank's experts. Each rank brings its own tokens (the batch is split over ``ep``,
    as in data parallelism; the router and everything outside the experts are replicated and their gradients
    must be summed over ``ep`` after backward, as data parallelism does).

    Forward, per MoE layer: each (token, choice) pair is sent to the rank that owns its expert (one all-to-all of
    the send counts, one of the ``[N, h]`` token rows, one of their expert ids), transformers' own experts kernel
    runs on the received rows with weight 1 (each row goes to one local expert), the outputs return by a second
    all-to-all ``[N, h]``, and each rank combines its tokens' ``k`` outputs with its routing weights.
    Backward: the two row all-to-alls in reverse. A rank whose experts receive no token sends and receives
    empty splits and still runs both all-to-alls in backward (its empty output is tied to the received rows and to
    its weights, whatever the kernel); its expert parameters then get zero gradients, not None (so AdamW still
    decays them, as in the unsharded model where the stacked weight always has a gradient).

    Shapes: ``hidden_states [T_r, h]`` (this rank's tokens), ``top_k_index [T_r, k]``, ``top_k_weights
    [T_r, k]`` -> ``[T_r, h]``.

    Combined with tensor parallelism (``ep x tp``): built from a :class:`TPExperts` (the model parallelized over
    ``tp`` first), each expert keeps its tp split (``tp_dim``/``tp_partition`` as before; the ep split is
    recorded as ``ep_dim = 0``/``ep_partition``); ``ep`` is then the group of ranks with the same tp rank, the
    rows travel within it, and the partial outputs are all-reduced over tp once after the combine (backward:
    input and routing-weight gradients all-reduced over tp, as in :class:`TPExperts`). The grad norm is then
    ``grad_norm(params, tp, ep=ep)``.

    Not done: capacity limits / token dropping (none: every token reaches its experts, as in transformers).

    Raises:
        ValueError: fewer experts than ``ep`` ranks, or an unsupported experts layout (as :class:`TPExperts`).
    """

    def __init__(self, experts: nn.Module, ep: Group, *, partition: Partition | None = None):
        super().__init__()
        from tensorpar.layers.linear import mark_sharded

        _check_expert_layout(experts)
        e = experts.gate_up_proj.shape[0]
        _take_expert_attrs(self, experts)
        inner = experts if isinstance(experts, TPExperts) else None
        self.tp = inner.tp if inner is not None else None
        self.region = inner.region if inner is not None else True
        self.ep = ep
        self.partition = partition or Partition.make(e, ep.size, name="num_experts")
        if self.partition.n != e or self.partition.tp_size != ep.size:
            raise ValueError(f"expert partition {list(self.partition.sizes)} does not split num_experts={e} over "
                             f"ep_size={ep.size}")
        self.num_experts_total = e
        lo, hi = self.partition.range(ep.rank)
        self.first_expert = lo
        self.num_experts = hi - lo                       # the kernel sees only this rank's experts
        owner = torch.repeat_interleave(torch.arange(ep.size), torch.tensor(self.partition.sizes))
        self.register_buffer("owner", owner, persistent=False)     # [E] expert -> ep rank
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(experts, name)
            w = p.detach()[lo:hi].clone() if p.device.type != "meta" else p.new_empty((hi - lo,) + tuple(p.shape[1:]))
            q = nn.Parameter(w, requires_grad=p.requires_grad)
            if inner is None:             # ep alone: loading reads the ep split as the tp one (ep passed as tp)
                mark_sharded(q, 0, self.partition)
            else:                         # tp layout as before
                mark_sharded(q, p.tp_dim, p.tp_partition)
            q.ep_dim, q.ep_partition = 0, self.partition    # the ep split: grad_norm sums these over ep
            setattr(self, name, q)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        tp_region = self.tp is not None and self.tp.size > 1 and self.region
        if tp_region:
            hidden_states = comm.copy_to_tp_region(hidden_states, self.tp)
            top_k_weights = comm.copy_to_tp_region(top_k_weights, self.tp)
        t, k = top_k_index.shape
        h = hidden_states.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)                       # grouped by expert, hence by owner rank
        experts_sorted = flat[order]
        rows = hidden_states[order // k]                                # [T_r k, h]
        if self.ep.size == 1:
            got, got_experts = rows, experts_sorted
        else:
            send_counts = torch.bincount(self.owner[experts_sorted], minlength=self.ep.size)
            recv_counts = torch.empty_like(send_counts)
            dist.all_to_all_single(recv_counts, send_counts, group=self.ep.pg)
            send, recv = send_counts.tolist(), recv_counts.tolist()
            got = _AllToAll.apply(rows, self.ep, send, recv)          # [N_r, h] rows for this rank's experts
            got_experts = experts_sorted.new_empty(sum(recv))
            dist.all_to_all_single(got_experts, experts_sorted, recv, send, group=self.ep.pg)
        local = (got_experts - self.first_expert).unsqueeze(1)         # [N_r, 1]
        ones = torch.ones(local.shape, dtype=top_k_weights.dtype, device=local.device)
        out = _experts_fn(self, self.intermediate_dim)(self, got, local, ones)   # [N_r, h]
        if got.shape[0] == 0 and torch.is_grad_enabled():
            # no row reached this rank's experts, and a kernel that loops over the experts hit returns zeros
            # outside the graph: tie the empty output to the received rows and the weights, so backward still runs
            # both all-to-alls here (the other ep ranks wait on them) and the weights get zero gradients, not None
            out = out + (got.sum() + self.gate_up_proj.sum() + self.down_proj.sum()).to(out.dtype)
        if self.ep.size > 1:
            out = _AllToAll.apply(out, self.ep, recv, send)            # back to the tokens' rank, [T_r k, h]
        back = torch.empty_like(out)
        back[order] = out
        y = (back.view(t, k, h) * top_k_weights.unsqueeze(-1).to(out.dtype)).sum(1).to(hidden_states.dtype)
        return comm.reduce_from_tp_region(y, self.tp) if tp_region else y

    def extra_repr(self) -> str:
        lo = self.first_expert
        return f"ep={self.ep.size}, experts [{lo}, {lo + self.num_experts}) of {self.num_experts_total}"


def expert_parallel_error(ep: int, config, flag: str = "ep") -> str | None:
    """Why ``config`` cannot run with its experts split over ``ep`` ranks, as one line naming ``flag`` (``"ep"``:
    ``ep=3: ...``; ``"--ep"``: ``--ep 3: ...``) and what works, or ``None`` when it can (``ep == 1`` always can).
    The one rule of the launching processes (train, generate, serve, verify) and of :func:`expert_parallelize`:
    a mixture-of-experts family with experts in this config (:func:`tensorpar.hf.families.why_not`), and ``ep``
    a divisor of the number of experts ``E`` (each rank holds ``E / ep`` whole experts)."""
    if ep == 1:
        return None
    from tensorpar.hf.families import why_not

    at = f"{flag} {ep}" if flag.startswith("--") else f"{flag}={ep}"
    why = why_not("expert_parallel", config)
    if why:
        return f"{at}: {why}; use {flag}{' ' if flag.startswith('--') else '='}1"
    e = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if ep < 1 or e % ep:
        ok = [d for d in range(1, e + 1) if e % d == 0]
        return f"{at}: does not divide the model's {e} experts; use {flag} in {ok}"
    return None


def expert_parallelize(model: nn.Module, ep: Group) -> list[str]:
    """Replace every stacked-experts module of an unsharded MoE ``*ForCausalLM`` by :class:`EPExperts` over ``ep``.

    The modules are the experts of the MoE blocks of the model's built-in plan (:mod:`tensorpar.hf.families.moe`);
    everything else (routers, Qwen2-MoE's shared expert) is left replicated. Returns their names.
    The ``ep`` ranks split the batch between them, and the gradients of every parameter that is not an expert
    (no ``ep_dim``) must be summed over ``ep`` after backward. On a model
    already parallelized over tp (:func:`tensorpar.hf.apply.parallelize`), ``ep`` must be the group of ranks with
    the same tp rank (the ``dp`` axis of a :class:`~tensorpar.parallel.ParallelContext`), and each expert keeps
    its tp split.

    Raises:
        ValueError: :func:`expert_parallel_error` (no experts; ``ep`` does not divide them), the model has no MoE
            plan, or an experts module cannot be split (see :class:`EPExperts`).
    """
    from tensorpar.hf.plan import make_plan
    from tensorpar.hf.styles import MoEExperts, SharedExpertMoE

    why = expert_parallel_error(ep.size, model.config)
    if why:
        raise ValueError(why)
    plan = make_plan(model.config, 1, check=False)
    names = [n for n, _ in plan.modules(model, MoEExperts)]
    names += [f"{n}.experts" for n, _ in plan.modules(model, SharedExpertMoE)]   # the shared expert stays replicated
    if not names:
        from tensorpar.hf.families import why_not
        raise ValueError(why_not("expert_parallel", model.config)
                         or f"model_type={model.config.model_type!r} has no mixture-of-experts layers in its plan")
    for n in names:
        parent, _, child = n.rpartition(".")
        setattr(model.get_submodule(parent), child, EPExperts(model.get_submodule(n), ep))
    return names


def ep_load_balancing_loss(model: nn.Module, router_logits, ep: Group) -> torch.Tensor:
    """The load-balancing auxiliary loss of the whole batch when the batch is split over ``ep`` ranks.

    ``router_logits``: this rank's per-layer router logits (``output.router_logits``, each ``[T_r, E]``).
    Each layer's logits are all-gathered over ``ep`` (rows of every rank, ``[T, E]``) and passed to the model's
    own ``load_balancing_loss_func`` (transformers; Switch Transformer, Fedus et al. 2021, eq. 4), so the value is
    the one the unsharded model computes on the whole batch (it averages over all rows, so their order does not
    matter; no padding mask). Every rank returns the same value; backward splits the gradient of the gathered
    logits, so each rank's router receives the gradient of its own rows, and summing the router's gradient over
    ``ep`` (as for every replicated parameter) gives the unsharded one.

    Collectives: forward one all-gather of the row counts and one all-gather per layer of ``[T_r, E]``; backward
    none (a split).
    """
    import sys

    cfg = model.config
    fn = sys.modules[type(model).__module__].load_balancing_loss_func
    num_experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    logits = list(router_logits)
    if ep.size > 1:
        rows = torch.tensor([logits[0].shape[0]], device=logits[0].device)
        sizes = comm.all_gather(rows, ep, dim=0).tolist()
        logits = [comm._Gather.apply(x, ep, 0, sizes) for x in logits]
    return fn(tuple(logits), num_experts, cfg.num_experts_per_tok, None)


class TPSharedExpertMoE(nn.Module):
    """Qwen2-MoE's sparse block with one all-reduce: routed experts and the shared expert add their partial sums
    before a single reduction.

    ``y = experts(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)`` (transformers'
    ``Qwen2MoeSparseMoeBlock``). The router ``gate`` ``[E, h]`` and ``shared_expert_gate`` ``[1, h]`` are
    replicated (kept as the original modules, so transformers still records the router logits); the routed
    experts are :class:`TPExperts` over ``expert_partition``; the shared expert's ``gate_proj``/``up_proj`` are
    column-parallel and its ``down_proj`` row-parallel over ``shared_partition``. Both produce partial sums over
    this rank's intermediate rows; the per-token sigmoid gate scales the shared part (linear, so it may act on
    the partial sum), and the sum is all-reduced once.

    Shapes: ``[b, s, h]`` -> ``[b, s, h]``, replicated. Collectives: forward one all-reduce ``[b s, h]``; backward
    one all-reduce of the input gradient ``[b s, h]`` and one of the routing weights' and shared gate's gradients
    together ``[b s, k + 1]`` (they scale partial sums, so each rank's gradient is partial).

    Raises:
        ValueError: a shared expert with biases, or the errors of :class:`TPExperts`.
    """

    def __init__(self, block: nn.Module, tp: Group, *, expert_partition: Partition, shared_partition: Partition):
        super().__init__()
        se = block.shared_expert
        if any(getattr(se, n).bias is not None for n in ("gate_proj", "up_proj", "down_proj")):
            raise ValueError("a shared expert with biases is not supported by tensorpar's one-reduction MoE block")
        self.tp = tp
        self.gate = block.gate
        self.experts = TPExperts(block.experts, tp, partition=expert_partition, region=False)
        self.shared_expert = TPGatedMLP(se, tp, partition=shared_partition)
        self.shared_expert_gate = block.shared_expert_gate

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        b, s, h = hidden_states.shape
        flat = hidden_states.reshape(-1, h)
        _, routing_weights, selected = self.gate(flat)
        g = torch.sigmoid(self.shared_expert_gate(flat))                                # [b s, 1] replicated
        k = routing_weights.shape[-1]
        # the weights multiply partial sums, so their gradients are partial: enter the region (one all-reduce
        # in backward for the routing weights and the shared gate together)
        wg = comm.copy_to_tp_region(torch.cat([routing_weights.to(g.dtype), g], -1), self.tp)
        x = comm.copy_to_tp_region(flat, self.tp)
        routed = self.experts(x, selected, wg[:, :k])                                   # [b s, h] partial
        se = self.shared_expert
        shared = F.linear(se.act_fn(se.gate_proj.forward_local(x)) * se.up_proj.forward_local(x),
                          se.down_proj.weight)                                          # [b s, h] partial
        y = routed + wg[:, k:] * shared
        return comm.reduce_from_tp_region(y, self.tp).reshape(b, s, h)

    def extra_repr(self) -> str:
        return f"tp={self.tp.size}, one all-reduce for routed and shared experts"
