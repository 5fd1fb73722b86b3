"""The model side of ``tensorpar serve``: a per-slot KV cache and one batched model step, run by every tp rank.

Continuous batching (iteration-level scheduling, Yu et al. 2022 "Orca", OSDI; Kwon et al. 2023 "vLLM", SOSP)
needs a KV cache in which requests of different lengths live side by side and come and go between steps. Here
each of ``max_batch`` *slots* owns a static region of every layer's cache, ``[kv_local, max_model_len, d]``,
preallocated at start (only this rank's KV heads, so the cache memory per rank falls with tp). A step is

* a prefill of every newly admitted request, one request per forward (``[1, s_prompt]``, causal mask), and
* one decode forward of every running request together (``[b, 1]``): each row writes its new K/V at its own
  position in its own slot and attends to the first ``pos + 1`` entries of that slot (a padded boolean mask,
  ``[b, 1, 1, L]`` with ``L`` the longest row this step).

Tokens are chosen as :func:`tensorpar.generate.generate_tokens` chooses them: greedy rows by the vocab-parallel
argmax (no gathered logits), sampled rows by gathering their logits to rank 0, which samples with the
request's own seeded generator (so a seed gives the same tokens wherever the request sits in the batch) and
broadcasts the tokens. Log-probabilities are computed vocab-parallel
(:func:`~tensorpar.layers.log_softmax.vocab_parallel_logprobs`, ``vocab_parallel_topk_logprobs``).

Every rank runs :meth:`Engine.step` with the same :class:`StepPlan`; rank 0 makes the plans (the scheduler) and
broadcasts each one in a single message (:meth:`Engine.exchange`); the other ranks run :func:`follow`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tensorpar import comm
from tensorpar.comm import Group


class SlotKVCache:
    """Static per-slot KV cache holding this rank's KV heads, plugged into the model as its ``cache``.

    Storage per layer: ``k``, ``v`` of shape ``[max_batch, kv_local, max_len, head_dim]`` (``kv_local``: the KV
    heads this rank holds; allocated on the first :meth:`update` of each layer, i.e. at the engine's warm-up,
    in the dtype and on the device of the model's keys). Before each forward :meth:`bind` says which slots the
    batch rows are and at which positions their tokens go; the attention modules of
    :mod:`tensorpar.hf.modules` then call :meth:`update`, which writes the new K/V there and returns each row's
    first ``length`` cache entries. No collectives.
    """

    def __init__(self, max_batch: int, max_len: int):
        self.max_batch, self.max_len = max_batch, max_len
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self._slots = self._pos = None
        self._length = 0

    def bind(self, slots: torch.Tensor, positions: torch.Tensor, length: int) -> None:
        """Rows ``i`` of the next forward are slot ``slots[i]`` (``[b]`` int64) with tokens at ``positions[i]``
        (``[b, s]`` int64); attention reads cache entries ``[0, length)``."""
        self._slots, self._pos, self._length = slots, positions, length

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store ``k``, ``v`` ``[b, kv_local, s, d]`` at the bound slots/positions; return ``[b, kv_local, L, d]``."""
        if layer_idx not in self.k:
            shape = (self.max_batch, k.shape[1], self.max_len, k.shape[3])
            self.k[layer_idx] = torch.zeros(shape, dtype=k.dtype, device=k.device)
            self.v[layer_idx] = torch.zeros(shape, dtype=v.dtype, device=v.device)
        kc, vc = self.k[layer_idx], self.v[layer_idx]
        slots, pos, L = self._slots, self._pos, self._length
        kc[slots[:, None], :, pos] = k.transpose(1, 2)                     # [b, s, kv, d] into the slots
        vc[slots[:, None], :, pos] = v.transpose(1, 2)
        if slots.numel() == 1:
            i = int(slots[0])
            return kc[i:i + 1, :, :L], vc[i:i + 1, :, :L]
        return kc[:, :, :L].index_select(0, slots), vc[:, :, :L].index_select(0, slots)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.k, self.v) for t in d.values())


@dataclass
class Row:
    """One request's part of a step: feed ``tokens`` into ``slot`` at positions ``start ..``.

    ``start == 0`` is a prefill (run as its own forward); otherwise ``tokens`` is the one last token (decode).
    ``sampled``: the token is sampled on rank 0 (else greedy). ``logprobs``: -1 none, 0 the chosen token's
    log-probability, k > 0 also the top-k.
    """

    slot: int
    tokens: list[int]
    start: int
    sampled: bool = False
    logprobs: int = -1


@dataclass
class StepPlan:
    """What every rank does next: ``op`` is ``"step"`` (run ``rows``), ``"noop"`` (heartbeat) or ``"stop"``."""

    op: str
    rows: list[Row] = field(default_factory=list)


@dataclass
class StepResult:
    """Per row of the plan: the chosen token, and (if asked) its log-probability and the top-k ``(id, lp)``."""

    tokens: list[int]
    logprobs: list[float | None]
    top: list[list[tuple[int, float]] | None]


class Engine:
    """One tp rank's model, cache and step (the same on every rank).

    Args:
        model: a causal LM sharded by :func:`tensorpar.hf.apply.parallelize` (logits ``[b, s, V_r]``).
        tp: its tensor-parallel group.
        max_batch: number of slots.
        max_len: cache length per slot (prompt + generated tokens).

    The cache is allocated and every kernel warmed by one 1-token prefill at construction. Families that
    :mod:`tensorpar.lean` supports run its :class:`~tensorpar.lean.LeanDecoder` (fused projections, a static
    cache of this rank's KV heads); the others the model's modules with a :class:`SlotKVCache`.

    Raises:
        ValueError: a sliding-window attention model (the slot mask does not implement windows), or
            ``max_len`` above the model's ``max_position_embeddings``.
    """

    def __init__(self, model, tp: Group, *, max_batch: int, max_len: int):
        cfg = model.config
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True) is not False \
                and cfg.sliding_window < max_len:
            raise ValueError(f"sliding_window={cfg.sliding_window} is not supported by tensorpar serve yet; "
                             f"use --max-model-len {cfg.sliding_window} or less")
        limit = getattr(cfg, "max_position_embeddings", None)
        if limit is not None and max_len > limit:
            raise ValueError(f"--max-model-len {max_len} exceeds the model's max_position_embeddings={limit}")
        self.model, self.tp = model, tp
        self.vocab = model.tensorpar_plan.vocab
        self.device = next(model.parameters()).device
        from tensorpar.lean import LeanDecoder, lean_unsupported

        # the lean decode path (fused projections, static cache) when the family has one; else the module path
        self.lean = (LeanDecoder(model, tp, max_batch=max_batch, max_len=max_len)
                     if lean_unsupported(model) is None else None)
        self.cache = self.lean if self.lean is not None else SlotKVCache(max_batch, max_len)
        self.max_batch, self.max_len = max_batch, max_len
        self.step(StepPlan("step", [Row(0, [0], 0)]), samplers=None)          # allocate the cache, warm up

    @torch.no_grad()
    def _forward(self, slots: list[int], ids: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Logits of the last position of each row, ``[b, V_r]`` (rows of equal token counts)."""
        dev = self.device
        s = len(ids[0])
        slot_t = torch.tensor(slots, dtype=torch.long, device=dev)
        ids_t = torch.tensor(ids, dtype=torch.long, device=dev)                               # [b, s]
        pos = torch.tensor(starts, dtype=torch.long, device=dev)[:, None] + torch.arange(s, device=dev)
        length = int(pos.max()) + 1
        mask = pos[:, None, :, None] >= torch.arange(length, device=dev)                    # [b, 1, s, L]
        if self.lean is not None:
            if s == 1 and min(starts) == length - 1:     # every row attends to all of [0, length): no mask
                mask = None
            return self.lean.forward(ids_t, pos, mask, length=length, slots=slot_t, cache_pos=pos)
        self.cache.bind(slot_t, pos, length)
        out = self.model(input_ids=ids_t, attention_mask=mask, position_ids=pos, cache=self.cache,
                         use_cache=False, logits_to_keep=1)
        return out.logits[:, -1]

    @torch.no_grad()
    def step(self, plan: StepPlan, samplers) -> StepResult:
        """Run ``plan`` (identical on every rank); return the tokens (the same on every rank).

        ``samplers`` (rank 0 only, ``None`` elsewhere): per row, ``None`` for greedy or a callable
        ``f(logits [1, V]) -> token`` (the request's seeded sampler). Collectives: per forward two all-reduces
        per block and one for the embedding; then one all-gather ``[b, 2]`` (argmax), plus for sampled rows an
        all-gather of their logits and a broadcast of the tokens, plus for log-probabilities all-reduces of
        ``[b]`` and an all-gather of ``[b, tp*k]``.
        """
        rows = plan.rows
        for r in rows:
            if not 0 <= r.slot < self.max_batch or r.start + len(r.tokens) > self.max_len:
                raise ValueError(f"row {r} does not fit the cache ({self.max_batch} slots x {self.max_len})")
        parts: dict[int, torch.Tensor] = {}
        decode = [i for i, r in enumerate(rows) if r.start > 0]
        for i, r in enumerate(rows):
            if r.start == 0:
                parts[i] = self._forward([r.slot], [r.tokens], [0])
        if decode:
            lg = self._forward([rows[i].slot for i in decode], [rows[i].tokens for i in decode],
                               [rows[i].start for i in decode])
            for j, i in enumerate(decode):
                parts[i] = lg[j:j + 1]
        logits = torch.cat([parts[i] for i in range(len(rows))])                           # [n, V_r]
        from tensorpar.generate import vocab_parallel_argmax
        tokens = vocab_parallel_argmax(logits, self.tp, partition=self.vocab).cpu()          # [n]
        sampled = [i for i, r in enumerate(rows) if r.sampled]
        if sampled:
            idx = torch.tensor(sampled, device=logits.device)
            full = comm.all_gather(logits.index_select(0, idx).contiguous(), self.tp, -1, self.vocab)   # [m, V]
            if self.tp.rank == 0:
                for j, i in enumerate(sampled):
                    tokens[i] = int(samplers[i](full[j:j + 1]))
            if self.tp.size > 1:
                tokens = comm.broadcast(tokens.to(logits.device), self.tp, src=0).cpu()
        lps: list[float | None] = [None] * len(rows)
        top: list[list[tuple[int, float]] | None] = [None] * len(rows)
        want = [r.logprobs for r in rows]
        if max(want, default=-1) >= 0:
            from tensorpar.layers.log_softmax import vocab_parallel_logprobs, vocab_parallel_topk_logprobs
            chosen = vocab_parallel_logprobs(logits.float(), tokens.to(logits.device), self.tp,
                                             partition=self.vocab).cpu()
            k = max(want)
            if k > 0:
                tv, ti = vocab_parallel_topk_logprobs(logits, k, self.tp, partition=self.vocab)
                tv, ti = tv.cpu(), ti.cpu()
            for i, w in enumerate(want):
                if w >= 0:
                    lps[i] = float(chosen[i])
                if w > 0:
                    top[i] = [(int(ti[i, j]), float(tv[i, j])) for j in range(w)]
        return StepResult([int(t) for t in tokens], lps, top)

    def exchange(self, plan: StepPlan | None) -> StepPlan:
        """Rank 0 sends ``plan`` to every tp rank (one object broadcast); every rank returns it."""
        if self.tp.size == 1:
            return plan
        import torch.distributed as dist
        box = [plan]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.tp.pg, 0), group=self.tp.pg,
                                   device=self.device if self.device.type == "cuda" else None)
        return box[0]


def follow(engine: Engine) -> None:
    """Loop of the ranks other than 0: receive each plan, run it, until a ``"stop"`` plan arrives.

    A collective that fails (rank 0 died, or the collective timeout) raises out of here, so the rank exits
    non-zero within the collective timeout instead of hanging.
    """
    while True:
        plan = engine.exchange(None)
        if plan.op == "stop":
            return
        if plan.op == "step":
            engine.step(plan, samplers=None)
