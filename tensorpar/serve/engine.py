"""The decode engine: a per-slot KV cache and one batched model step, run by every tp rank. It is the one decode
loop of tensorpar: ``tensorpar serve`` drives it from rank 0's scheduler, ``tensorpar generate``
(:func:`tensorpar.generate.generate_tokens`) steps it directly, as vLLM's offline ``LLM.generate`` shares
``LLMEngine`` with its server.

Continuous batching (iteration-level scheduling, Yu et al. 2022 "Orca", OSDI; Kwon et al. 2023 "vLLM", SOSP)
needs a KV cache in which requests of different lengths live side by side and come and go between steps. Here
each of ``max_batch`` *slots* owns a static region of every layer's cache, ``[kv_local, max_model_len, d]``,
preallocated at start (only this rank's KV heads, so the cache memory per rank falls with tp). A step is one
forward (on the lean path, :meth:`~tensorpar.decode.lean.LeanDecoder.forward_segments`) of

* the newly admitted requests' prompts, in padded groups (:func:`prefill_groups` splits a burst into a few groups
  when the prompt lengths differ a lot or a group would exceed :data:`PREFILL_TOKENS`), and
* every running request's next token (``[b, 1]``): each row writes its new K/V at its own position in its own
  slot and attends to the first ``pos + 1`` entries of that slot (a padded boolean mask, ``[b, 1, 1, L]`` with
  ``L`` the longest row this step).

The matmuls, norms and all-reduces run once over all the step's tokens; attention runs per group (a decode row
padded to a prompt's length would cost that many tokens of attention; there is no variable-length attention
kernel here). The module path (families without the lean decoder) runs one forward per group.

Which path runs is decided in one place, :func:`tensorpar.decode.prepare.lean_unsupported` (the family record's
``fast_decode`` and the config's window, :func:`tensorpar.hf.families.why_not`): the lean decoder for every family
whose record says so, the model's own modules with a :class:`SlotKVCache` otherwise.

Sliding-window attention (Mistral, StarCoder2, Phi-3 with a window, Gemma 2/3 and Qwen2 on their windowed layers)
runs on the module path: the slots keep every position and the mask lets a query at position ``p`` of a layer with
window ``w`` attend to positions ``(p - w, p]`` only (transformers' sliding-window mask), per kind of layer
(:func:`tensorpar.hf.families.attention_windows`; a dict of masks by ``layer_types`` name when a model mixes them).

A batched prefill pads the prompts to the longest, ``s``, *on the left of the sequence* but not in the cache
(:func:`prefill_layout`): a row of ``n`` tokens is ``[pad] * (s - n) + prompt``, its real tokens go to cache
positions (and rotary positions) ``0 .. n-1`` and its pads to ``n .. s-1``. Each query attends to the cache
entries at or before its own position, so a real token sees only real tokens (the pads sit after it), every
pad's output is finite (it sees real tokens and earlier pads), and the last position of every row is its last
prompt token, whose logits are the ones kept. The pads' K/V are overwritten by the row's first decode (at
position ``n``) and later ones before any query reads them (a decode at position ``p`` writes ``p`` and reads
``[0, p]``).

Tokens are chosen by :func:`tensorpar.serve.tokens.choose_tokens`: greedy rows by the vocab-parallel argmax (no
gathered logits), sampled rows by gathering their logits to rank 0, which samples each with its row's sampler
(serve: the request's own seeded generator, so a seed gives the same tokens wherever the request sits in the
batch) and broadcasts the tokens. Log-probabilities are computed vocab-parallel
(:func:`~tensorpar.layers.log_softmax.vocab_parallel_logprobs`, ``vocab_parallel_topk_logprobs``).

Every rank runs :meth:`Engine.step` with the same :class:`StepPlan`. Under serve, rank 0 makes the plans (the
scheduler) and broadcasts each one as a small int64 tensor (:meth:`Engine.exchange`, :func:`encode_plan`), one
broadcast of :data:`PLAN_WORDS` words per step when the plan fits (a second one for the rest of a longer plan),
over the group's shared-memory communicator when it has one, else its process group; the other ranks run
:func:`follow`. Under generate every rank computes the same plan from the same tokens, so nothing is broadcast.
With pipeline stages serve runs :meth:`Engine.tick` instead: one batch of requests per stage in flight, each stage
on another batch's plan in the same tick (:mod:`tensorpar.serve.ticks`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tensorpar import comm
from tensorpar.comm import Group
from tensorpar.decode.lean import LeanDecoder, Segment
from tensorpar.decode.prepare import lean_unsupported
from tensorpar.decode.rope import per_row_rope
from tensorpar.decode.slot_cache import SlotKVCache
from tensorpar.hf.families import attention_windows
from tensorpar.serve.plan import PLAN_MAGIC, PLAN_WORDS, Row, StepPlan, decode_plan, encode_plan
from tensorpar.serve.prefill import PREFILL_TOKENS, prefill_groups, prefill_layout  # noqa: F401  (re-exported)
from tensorpar.serve.ticks import PipelineStats, step_batches
from tensorpar.serve.tokens import choose_stage_tokens, choose_tokens, row_logprobs


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
        max_batch: rows a step runs at most (and, by default, the number of blocks).
        max_len: positions per request (prompt + generated tokens).
        block_size, num_blocks: the KV pool (:class:`~tensorpar.decode.kv_cache.LeanKVCache`): ``num_blocks`` blocks
            of ``block_size`` positions of this rank's KV heads; default ``max_batch`` blocks of ``max_len`` (one
            static block per row, what ``generate`` uses). The module path keeps one slot of ``max_len`` per block
            (:class:`SlotKVCache`): ``block_size`` must then be ``max_len``.
        path: ``"auto"`` runs the lean decode path (:class:`~tensorpar.decode.lean.LeanDecoder`: fused projections, a
            static cache of this rank's KV heads) when :func:`tensorpar.decode.prepare.lean_unsupported` allows it (the
            family record) and the model's modules with a :class:`SlotKVCache` otherwise; ``"lean"`` requires
            the lean path; ``"hf"`` forces the module path.
        warm_up: run one 1-token prefill at construction (allocates the cache, warms every kernel).
        plans: the ranks that run rank 0's plans (:meth:`exchange`): ``None`` for ``tp``; every rank when ep
            replicas of the tp ranks hold the experts (``serve --ep``: they run the same steps).
        pp: the pipeline group when the model is one pipeline stage (``model.tensorpar_stage``, loaded by
            :func:`tensorpar.job.load_model` at ``pp > 1``): a step receives the residual stream from the stage
            before, runs this stage's layers (its KV cache holds only those) and sends it on; the last stage picks
            the tokens and broadcasts them to every stage (:mod:`tensorpar.pipeline.inference`).
        deterministic: batch-invariant results (``serve --deterministic``): a row's logits, greedy token and
            log-probabilities are bitwise those of the same request run alone, whatever else the step runs
            (the lean decoder's deterministic mode, :meth:`~tensorpar.decode.lean.LeanDecoder.forward_segments`;
            log-probabilities row by row). Needs the lean path, the whole model on each rank (pp=1), no MoE block.
        block: the lean decoder's (:class:`~tensorpar.decode.lean.LeanDecoder`): fp32 weights in our GEMV's layout.

    Raises:
        ValueError: ``max_len`` above the model's ``max_position_embeddings``; ``path`` not one of
            auto/lean/hf, or ``"lean"`` for a model the lean path does not run (naming why); ``deterministic``
            on the module path, a pipeline stage or a mixture-of-experts model; a stage model
            without a pipeline group of its size, or a pipeline group without a stage model; a ``block_size``
            other than ``max_len`` on the module path.
    """

    def __init__(self, model, tp: Group, *, max_batch: int, max_len: int, path: str = "auto", warm_up: bool = True,
                 plans: Group | None = None, pp: Group | None = None, block_size: int | None = None,
                 num_blocks: int | None = None, deterministic: bool = False, block: bool = True):
        cfg = model.config
        if path not in ("auto", "lean", "hf"):
            raise ValueError(f"path must be 'auto', 'lean' or 'hf', got {path!r}")
        limit = getattr(cfg, "max_position_embeddings", None)
        if limit is not None and max_len > limit:
            raise ValueError(f"--max-model-len {max_len} exceeds the model's max_position_embeddings={limit}")
        self.model, self.tp = model, tp
        self.vocab = model.tensorpar_plan.vocab
        self.device = next(model.parameters()).device
        self.pp = pp or Group.single("pp")
        if plans is None and self.pp.size > 1:      # every stage runs rank 0's plans and gets its sampled tokens
            import torch.distributed as dist
            plans = Group.from_pg(dist.group.WORLD, name="world")
        self.plans = plans or tp     # the ranks that run rank 0's plans: tp, or every rank (ep replicas, stages)
        self.stage = getattr(model, "tensorpar_stage", None)
        if (self.stage.size if self.stage is not None else 1) != self.pp.size:
            have = f"stage {self.stage.rank} of {self.stage.size}" if self.stage is not None else "the whole model"
            raise ValueError(f"the model is {have} but the pipeline group has {self.pp.size} ranks; load it with "
                             f"pp={self.pp.size}")
        self.first = self.stage is None or self.stage.first
        self.last = self.stage is None or self.stage.last
        self.hidden = (cfg.hidden_size, next(model.parameters()).dtype)      # what travels between stages

        # the one decision of which path runs: the lean decoder when the family record (and the config) allow it
        why = None if path == "hf" else lean_unsupported(model)
        if path == "lean" and why is not None:
            raise ValueError(f"path='lean' cannot run this model: {why}; use path='auto' or 'hf'")
        block_size, num_blocks = block_size or max_len, num_blocks or max_batch
        lean = path != "hf" and why is None
        if deterministic and not lean:
            raise ValueError(f"deterministic (batch-invariant) decoding needs the lean decode path; this model runs "
                             f"the module path ({why or 'path=hf'})")
        if not lean and block_size != max_len:
            raise ValueError(f"this model runs the module path ({why or 'path=hf'}), whose KV cache keeps one slot "
                             f"of max_len={max_len} positions per request: block_size must be {max_len}, got "
                             f"{block_size}")
        self.lean = LeanDecoder(model, tp, max_batch=max_batch, max_len=max_len, block_size=block_size,
                                num_blocks=num_blocks, deterministic=deterministic, block=block) if lean else None
        self.deterministic = deterministic
        self.cache = self.lean if self.lean is not None else SlotKVCache(num_blocks, max_len)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.windows = attention_windows(cfg)           # module path: the mask per kind of attention layer
        self.eager = getattr(cfg, "_attn_implementation", None) == "eager"   # additive float masks
        self.max_batch, self.max_len = max_batch, max_len
        self.stats = PipelineStats()            # ticks, and those in which this stage computed (serve --pp)
        self._flight: list = [None] * self.pp.size   # per stage: (plan, samplers) it runs this tick (:meth:`tick`)
        self._sending = None                    # this stage's send of the residual stream still in progress
        if warm_up:
            self.step(StepPlan("step", [Row(0, [0], 0)]), samplers=None)          # allocate the cache, warm up

    def _segment(self, tables: list[list[int]], ids: list[list[int]], pos: list[list[int]],
                 write: list[list[bool]] | None = None):
        """Tensors of rows with block tables ``tables`` and tokens ``ids`` at positions ``pos`` (``[b, s]`` lists;
        ``write``: which tokens are stored, ``None`` all): ``(ids_t, pos_t, blocks_t, mask, length, write_t)``.
        Each query attends to its row's positions ``<=`` its own (``[b, 1, s, L]`` bool mask, ``L = max(pos) + 1``;
        no mask for a decode in which every row is at ``L - 1``); ``blocks_t`` ``[b, ceil(L / block_size)]``, the
        tables padded with block 0 (read only under the mask)."""
        dev = self.device
        s = len(ids[0])
        ids_t = torch.tensor(ids, dtype=torch.long, device=dev)                               # [b, s]
        pos_t = torch.tensor(pos, dtype=torch.long, device=dev)                               # [b, s]
        length = max(max(p) for p in pos) + 1
        nb = -(-length // self.block_size)
        blocks_t = torch.tensor([(t + [0] * nb)[:nb] for t in tables], dtype=torch.long, device=dev)
        mask = None
        if not (s == 1 and min(p[0] for p in pos) == length - 1):   # else every row attends to all of [0, L)
            mask = pos_t[:, None, :, None] >= torch.arange(length, device=dev)              # [b, 1, s, L]
        write_t = None
        if write is not None and not all(all(w) for w in write):
            write_t = torch.tensor(write, dtype=torch.bool, device=dev)
        return ids_t, pos_t, blocks_t, mask, length, write_t

    def _layer_masks(self, pos_t: torch.Tensor, mask: torch.Tensor | None, length: int):
        """The module path's ``attention_mask``: ``[b, 1, s, L]`` (``mask``, or all True when ``None``), and for a
        layer of window ``w`` also ``key_pos > query_pos - w``; one tensor when every layer has the same window,
        else a dict by ``layer_types`` name (:func:`~tensorpar.hf.families.attention_windows`). Boolean for sdpa,
        additive (0 / dtype min) for the eager kernel, as transformers' own mask builders make them."""
        b, s = pos_t.shape
        if mask is None:
            mask = torch.ones(b, 1, s, length, dtype=torch.bool, device=self.device)
        out = {}
        for kind, w in self.windows.items():
            m = mask if w is None else mask & (torch.arange(length, device=self.device)
                                               > pos_t[:, None, :, None] - w)                 # [b, 1, s, L]
            if self.eager:
                dt = self.model.dtype
                m = torch.zeros(m.shape, dtype=dt, device=self.device).masked_fill(~m, torch.finfo(dt).min)
            out[kind] = m
        return next(iter(out.values())) if len(out) == 1 else out

    @torch.no_grad()
    def _forward(self, batches: list[tuple[list[int], list[list[int]], list[list[int]]]]) -> torch.Tensor:
        """Logits of the last column of each row of each batch ``(tables, ids, pos, write)``, ``[sum(b), V_r]``.

        The lean path runs all the batches as one forward (:meth:`~tensorpar.decode.lean.LeanDecoder.forward_segments`:
        the matmuls once over every token, attention per batch); the module path one forward per batch.
        """
        parts = [self._segment(*bt) for bt in batches]
        if self.stage is not None:
            return self._stage_forward(parts)
        if self.lean is not None:
            segs = [Segment(i.shape[0], i.shape[1], m, n, blocks=bl, cache_pos=p, write=w)
                    for i, p, bl, m, n, w in parts]
            if len(parts) == 1:
                ids, pos = parts[0][0].reshape(-1), parts[0][1].reshape(-1)
            else:
                ids = torch.cat([i.reshape(-1) for i, *_ in parts])
                pos = torch.cat([p.reshape(-1) for _, p, *_ in parts])
            return self.lean.forward_segments(ids, pos, segs)
        out = []
        for ids_t, pos_t, blocks_t, mask, length, _ in parts:    # one block (slot) per row; pads written
            self.cache.bind(blocks_t[:, 0], pos_t, length)
            with per_row_rope(self.model):      # longrope: each row the factors of its own length
                lg = self.model(input_ids=ids_t, attention_mask=self._layer_masks(pos_t, mask, length),
                                position_ids=pos_t, cache=self.cache,
                                use_cache=False, logits_to_keep=1)
            out.append(lg.logits[:, -1])
        return out[0] if len(out) == 1 else torch.cat(out)

    @torch.no_grad()
    def _stage_forward(self, parts) -> torch.Tensor | None:
        """:meth:`_forward` of one pipeline stage: the residual stream ``[T, h]`` of the step's ``T`` tokens
        (every batch's ``[b, s]`` row by row, batch after batch) comes from the stage before (stage 0: the
        embedding of the token ids), runs through this stage's layers and goes to the next stage; the last returns
        the logits ``[sum(b), V_r]``, the others ``None``. The lean path runs all the batches as one forward, the
        module path one forward per batch through the stage's layers (the masks and rotary tables of
        :meth:`_forward`). Collectives: a recv and an asynchronous send of ``[T, h]`` on the pipeline group (the
        send is waited at this stage's next one: the next stage receives it at the next :meth:`tick`), the
        stage's tp ones.
        """
        from tensorpar.pipeline.inference import module_stage_forward, recv_hidden, send_hidden

        T = sum(i.numel() for i, *_ in parts)
        x = None if self.first else recv_hidden((T, self.hidden[0]), self.hidden[1], self.device, self.pp)
        t0 = time.perf_counter()
        if self.lean is not None:
            segs = [Segment(i.shape[0], i.shape[1], m, n, blocks=bl, cache_pos=p, write=w)
                    for i, p, bl, m, n, w in parts]
            ids = torch.cat([i.reshape(-1) for i, *_ in parts]) if x is None else x
            out = self.lean.forward_segments(ids, torch.cat([p.reshape(-1) for _, p, *_ in parts]), segs)
        else:
            out = module_stage_forward(self.model, self.stage, self.cache, parts, x, self._layer_masks)
        self.stats.busy_s += time.perf_counter() - t0
        if self.last:
            return out
        self._sending = send_hidden(out, self.pp, self._sending)    # waited at the next send (the next tick)
        return None

    @torch.no_grad()
    def step(self, plan: StepPlan, samplers) -> StepResult:
        """Run ``plan`` (identical on every rank) to its tokens; return them (the same on every rank).

        One forward (:meth:`_forward`) of the batches of :func:`~tensorpar.serve.ticks.step_batches` (the prefill
        rows in padded groups, then the other rows by token count; attention per group). With pipeline stages:
        the plan's :meth:`tick`, then ``pp - 1`` empty ticks that carry it through the later stages (nothing may
        be in flight before: ``generate`` and the warm-up; serve's scheduler drives :meth:`tick` itself).

        ``samplers`` (rank 0 only, ``None`` elsewhere): per row, ``None`` for greedy or a callable
        ``f(logits [1, V]) -> token`` (the request's seeded sampler). Collectives: per forward two all-reduces
        per block and one for the embedding; then one all-gather ``[b, 2]`` (argmax), plus for sampled rows an
        all-gather of their logits and a broadcast of the tokens, plus for log-probabilities all-reduces of
        ``[b]`` and an all-gather of ``[b, tp*k]``. With pipeline stages: the stage's layers' collectives, a
        recv and a send of the residual stream, the broadcasts of :func:`choose_stage_tokens` (and
        :func:`~tensorpar.pipeline.inference.logprobs_from_last`). Raises ValueError for a row outside the cache or
        with no tokens, or two rows writing one block; RuntimeError at pp > 1 with plans in flight.
        """
        if self.pp.size == 1:
            self.stats.tick([plan], True)
            return self._result(plan, self._compute(plan), samplers)
        if any(w is not None for w in self._flight):
            raise RuntimeError("Engine.step with pipelined plans in flight: drain them with tick(None, None)")
        res = self.tick(plan, samplers)
        for _ in range(self.pp.size - 1):
            res = self.tick(None, None)
        from tensorpar.pipeline.inference import wait_send
        wait_send(self._sending, self.pp)       # the next stage has received it (it ran the plan since)
        self._sending = None
        return res

    @torch.no_grad()
    def tick(self, plan: StepPlan | None, samplers) -> StepResult | None:
        """One lockstep tick of the pipelined schedule (``serve --pp``; at pp 1 :meth:`step` of ``plan``).

        The plan made at this tick (``None`` or no rows: nothing new) enters stage 0; stage ``s`` runs the plan
        of ``s`` ticks ago (the residual stream it receives is the one stage ``s - 1`` sent at the tick before;
        the send is asynchronous and waited one tick later, as the next stage receives it only then); the last
        stage's plan (``pp - 1`` ticks old) gets its tokens, returned on every rank (``None`` when that slot was
        empty). Every rank keeps the plans in flight (``pp`` slots) and rank 0 their ``samplers``. So ``pp``
        plans are in flight and, with work in every slot, every stage computes in every tick. Collectives: those
        of :meth:`step` for the stage's plan and, when a plan completes, the token broadcasts.
        """
        if self.pp.size == 1:
            return self.step(plan, samplers) if plan is not None and plan.rows else None
        self._flight = [(plan, samplers) if plan is not None and plan.rows else None] + self._flight[:-1]
        mine = self._flight[self.pp.rank]
        self.stats.tick(self._flight, mine is not None)
        logits = self._compute(mine[0]) if mine is not None else None
        done, self._flight[-1] = self._flight[-1], None            # complete after this tick
        return None if done is None else self._result(done[0], logits, done[1])

    def _compute(self, plan: StepPlan) -> torch.Tensor | None:
        """This stage's forward of ``plan``: the logits ``[n, V_r]`` in row order on the last stage, else ``None``."""
        batches, order = step_batches(plan.rows, block_size=self.block_size, num_blocks=self.num_blocks,
                                      max_len=self.max_len)
        lg = self._forward(batches)                                # [n, V_r], in order (None: not the last stage)
        if lg is None or order == sorted(order):                   # already in row order (a decode of one batch)
            return lg
        return lg[sorted(range(len(order)), key=order.__getitem__)]

    def _result(self, plan: StepPlan, logits: torch.Tensor | None, samplers) -> StepResult:
        """The tokens of ``plan``'s rows from the (last stage's) ``logits``, and the log-probabilities asked for."""
        rows = plan.rows
        sampled = [i for i, r in enumerate(rows) if r.sampled]
        if self.pp.size == 1:
            tokens = choose_tokens(logits, self.tp, partition=self.vocab, sampled=sampled, samplers=samplers)  # [n]
        else:       # the last stage's logits, rank 0's samplers (tensorpar.pipeline.inference)
            tokens = choose_stage_tokens(logits, len(rows), self.tp, self.pp, self.plans, partition=self.vocab,
                                         sampled=sampled, samplers=samplers, dtype=self.hidden[1],
                                         device=self.device)
        want = [r.logprobs for r in rows]
        lps: list[float | None] = [None] * len(rows)
        top: list[list[tuple[int, float]] | None] = [None] * len(rows)
        if max(want, default=-1) >= 0:
            if logits is not None:
                lps, top = row_logprobs(logits, tokens, want, self.tp, partition=self.vocab,
                                        deterministic=self.deterministic)
            if self.pp.size > 1:
                from tensorpar.pipeline.inference import logprobs_from_last
                lps, top = logprobs_from_last(want, lps, top, self.pp, last=self.last, device=self.device)
        return StepResult(tokens.tolist(), lps, top)

    def exchange(self, plan: StepPlan | None) -> StepPlan:
        """Rank 0 sends ``plan`` to every rank of ``plans`` (default: tp); every rank returns it (rank 0: the same
        object).

        The plan travels as :func:`encode_plan`'s int64 words in a fixed :data:`PLAN_WORDS`-word message (the
        same shape every step, so the shared-memory communicator reuses its buffers and a decode step costs one
        small broadcast); a plan longer than that sends its remaining words in a second broadcast whose length
        the first message's header gives. Collectives: one or two :func:`tensorpar.comm.broadcast` on the
        ``plans`` group: the tp group, or every rank when ep replicas of the tp ranks serve (only rank 0's tokens
        are used: the plans carry them). Shared memory when the group has the fast path and the tensor is on the
        CPU; on CUDA the message is a device tensor for NCCL. Raises :class:`~tensorpar.comm.CollectiveError` when a rank is
        gone, ValueError if the message is not a plan (ranks out of step).
        """
        g = self.plans
        if g.size == 1:
            return plan
        dev = self.device if self.device.type == "cuda" else torch.device("cpu")
        msg = torch.zeros(PLAN_WORDS, dtype=torch.int64)
        words = None
        if g.rank == 0:
            words = encode_plan(plan)
            msg[:min(len(words), PLAN_WORDS)] = words[:PLAN_WORDS]
        got = comm.broadcast(msg.to(dev), g, src=0).cpu()
        if int(got[0]) != PLAN_MAGIC:
            decode_plan(got)                        # raises: not a plan message
        total = int(got[4])
        if total > PLAN_WORDS:
            rest = words[PLAN_WORDS:] if words is not None else torch.zeros(total - PLAN_WORDS, dtype=torch.int64)
            got = torch.cat([got, comm.broadcast(rest.to(dev), g, src=0).cpu()])
        if g.rank == 0:
            return plan
        return decode_plan(got)


def follow(engine: Engine) -> None:
    """Loop of the ranks other than 0: receive each plan, run it (:meth:`Engine.tick`), until a ``"stop"`` plan
    arrives.

    A collective that fails (rank 0 died, or the collective timeout) raises out of here, so the rank exits
    non-zero within the collective timeout instead of hanging.
    """
    while True:
        plan = engine.exchange(None)
        if plan.op == "stop":
            return
        if plan.op == "step":
            engine.tick(plan, samplers=None)        # pp 1: the plan's step; pp > 1: one tick of the pipeline
