"""The trainer: one optimiser step at every layout of the (dp, pp, cp, tp) grid (tp-only, pipeline schedules,
data-parallel replicas by DDP or FSDP2, context parallelism, micro-batches), in the spirit of torchtitan's
``forward_backward_step``.
Autocast, the skip of a batch without targets, clipping, the learning-rate schedule, checkpoints and the
validation loss exist once, here, so a setting cannot hold at one layout and be ignored at another.

One optimiser step, on every rank:

1. the global batch ``[B, s]`` (the same on every rank: same seed) is drawn; if none of its labels is a target
   (every label ``ignore_index``), its mean loss would be NaN (0 / 0, as in torch): the step is reported
   (``StepResult.skipped``, one line on rank 0) and the optimizer is not stepped, so neither momentum nor weight
   decay moves the weights on a batch without data;
2. replica ``d`` of ``dp`` takes rows ``[d B/dp, (d+1) B/dp)`` and cuts them into ``M`` micro-batches; with
   context parallelism cp rank ``c`` keeps its positions ``[b, s/cp]`` of them (two chunks, one early and one late,
   :func:`tensorpar.layers.ring_attention.cp_positions`; rotary tables from those positions), its loss the sum over
   its positions (step 3), the shares summed over cp for the reported loss;
3. forward under the run's autocast (``dtype="bfloat16"``: ``torch.autocast``, fp32 weights and optimizer), the
   logits vocabulary-sharded ``[mb, s, V_r]``, then the vocab-parallel cross-entropy (two all-reduces of per-token
   scalars) outside autocast, and backward:
   the loss is the global batch's mean over its ``N`` target tokens (labels not ``ignore_index``), as one device
   computes it: each micro-batch back-propagates its summed cross-entropy times ``dp / N`` (``pp == 1``,
   gradient accumulation) or ``dp * M / N`` (``pp > 1``: ``torch.distributed.pipelining``'s schedule, GPipe,
   1F1B or interleaved 1F1B, :func:`tensorpar.pipeline.stages.build_schedule`, runs the micro-batches through
   the stages with the cross-entropy on the last stage, and its ``scale_grads`` divides by ``M``); the dp average
   divides by ``dp``. So a micro-batch or replica with fewer (or no) targets weighs what its tokens weigh, never
   NaN, and the gradients equal one step on the whole batch (Megatron-Core's per-token loss, torchtitan's
   global-token normalisation);
   the cp ranks' sums (each over its positions) add up to the sequence's, so a step needs no count over cp;
4. gradients are completed: summed over cp (each cp rank's is that of its positions' share of the loss), summed
   over tp for sequence-parallel norms and duplicated KV rows
   (:mod:`tensorpar.grads`; after this each rank's gradient slice equals the matching slice of the tp = 1
   gradient), summed between the first and last stage for a tied embedding/LM head (Megatron's embedding group),
   and averaged over dp: by torch's ``DistributedDataParallel`` on the dp group when ``pp == 1`` (overlapped
   with backward; earlier micro-batches under ``no_sync``), by one bucketed all-reduce per step for pipeline
   stages; or, with ``dp_mode="fsdp"``, reduce-scattered by FSDP2 (:func:`tensorpar.train.dp.fully_shard_dp`),
   so that each dp rank holds 1/dp of every gradient, of every parameter between steps and of the AdamW state.
   With expert parallelism (``ep == dp > 1``, :func:`tensorpar.hf.modules.expert_parallelize` in
   :func:`~tensorpar.train.model.build_model`) each dp rank holds ``E / ep`` whole experts; the all-to-all's
   backward has already brought them the gradient of every replica's tokens routed to them (the sum over dp of
   the replicas' mean losses), so they are divided by dp and not all-reduced; every other gradient is averaged
   over dp by the one bucketed all-reduce (no DDP wrapper: it would average the experts too);
5. the grad norm is the single-device one (:meth:`Trainer.global_grad_norm`: the tp-aware norm of each stage's
   parameters, squares summed over pp with the tied LM head counted once and, under FSDP or over the experts of
   expert parallelism, over dp); clip to
   ``grad_clip`` (:meth:`Trainer.clip_grads`, the one call site);
6. AdamW on each rank's own slices at the step's learning rate (:func:`lr_at`): element-wise, so it equals
   tp = 1 once the gradients are complete.

The reported loss is the last stage's mean over micro-batches, broadcast over pp and averaged over dp. The
validation loss runs the same forward: the pipeline schedule's ``eval`` at pp > 1.

Saving and resuming (:meth:`Trainer.save`, :meth:`Trainer.resume`) are in :mod:`tensorpar.train.trainer_state`
(:class:`~tensorpar.train.trainer_state.TrainerCheckpoints`, a base class of :class:`Trainer`).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from tensorpar import comm
from tensorpar.grads import (all_reduce_grads, grad_norm, local_tensor, sync_duplicated_grads,
                             sync_sequence_parallel_grads)
from tensorpar.layers import vocab_parallel_cross_entropy
from tensorpar.pipeline.stages import build_schedule, cut_stages
from tensorpar.train.config import TrainConfig
from tensorpar.train.data import TrainData
from tensorpar.train.dp import fully_shard_dp, no_forward_buffer_sync
from tensorpar.train.evaluate import IGNORE_INDEX, validation_loss
from tensorpar.train.model import check_device
from tensorpar.train.optim import lr_at, make_optimizer
from tensorpar.layers.dropout import DropoutRNG, install_dropout
from tensorpar.layers.ring_attention import cp_positions
from tensorpar.train.trainer_state import TrainerCheckpoints



@dataclass(frozen=True)
class StepResult:
    """What one optimiser step did. ``grad_norm`` is before clipping; ``step`` counts from 1.

    ``skipped``: the batch had no target token (every label ``ignore_index``), so no update was made.
    """

    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    time_s: float
    skipped: bool = False

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.time_s if self.time_s > 0 else float("nan")


class Trainer(TrainerCheckpoints):
    """Holds this rank's model or pipeline stage(s), its optimizer, the batch iterator and the step count.

    Args:
        cfg: the run's settings (``micro_batches``, ``schedule``, ``dp_mode``, ``dtype``, ... used here).
        ctx: the :class:`~tensorpar.parallel.ParallelContext` (its tp, pp and dp groups and rank grid;
            ``ParallelContext.single()`` for one process).
        model, plan: from :func:`tensorpar.train.model.build_model` (the model sharded over tp); at pp > 1 only
            this rank's stages are kept.
        data: the token streams.

    Attributes:
        modules: this rank's modules: ``[model]`` at pp = 1, its :class:`~tensorpar.pipeline.stages.DecoderStage`
            chunks at pp > 1 (FSDP2 modules under ``dp_mode="fsdp"`` with dp > 1).
        model: the whole (tp-sharded) model at pp = 1; ``None`` at pp > 1.
        named_params, params: this rank's trainable parameters (``requires_grad``: under LoRA the adapters
            only), each once (a tied one under its first name).
        ep: the expert-parallel group (``ctx.dp``) when ``cfg.ep > 1``, else ``None``.

    Raises:
        ValueError: ``batch_size`` not divisible by ``dp * micro_batches``; an unknown schedule; a family or
            layer count that the pipeline cannot cut (:func:`~tensorpar.pipeline.stages.cut_stages`); parameters
            on another device than ``ctx.device``.
    """

    def __init__(self, cfg: TrainConfig, ctx, model: nn.Module, plan, data: TrainData):
        self.cfg, self.ctx, self.plan, self.data = cfg, ctx, plan, data
        tp, pp, dp = ctx.tp, ctx.pp, ctx.dp
        self.tp = tp
        if cfg.cp != ctx.cp.size:
            raise ValueError(f"cp={cfg.cp} but the parallel context's cp axis has {ctx.cp.size} ranks; build it with "
                             f"ParallelConfig(cp={cfg.cp})")
        m = cfg.micro_batches
        if cfg.batch_size % (dp.size * m):
            raise ValueError(f"batch_size={cfg.batch_size} is not divisible by dp x micro_batches = {dp.size} x {m}; "
                             f"use a batch size that is a multiple of {dp.size * m}")
        self.rng = DropoutRNG(cfg.seed)  # the run's keyed masks (the model's own generator is replaced)
        install_dropout(model, self.rng, attention_dropout=cfg.attention_dropout, hidden_dropout=cfg.hidden_dropout,
                        cp=ctx.cp)
        self.device = ctx.device
        check_device(model, self.device)
        self.tied = plan.tie_word_embeddings and pp.size > 1
        self.fsdp = cfg.dp_mode == "fsdp" and dp.size > 1
        # expert parallelism: the experts were split whole over the dp ranks by build_model (cfg.ep == dp.size)
        self.ep = dp if cfg.ep > 1 else None
        dp_mesh = ctx.mesh["dp"] if self.fsdp else None
        self.schedule = self.eval_schedule = self.ddp = None
        self._token_weight = 1.0  # dp * M / N of the step (or validation batch) being run, see _loss_fn
        if pp.size > 1:
            virtual = 2 if cfg.schedule == "interleaved-1f1b" else 1
            self.modules = cut_stages(model, pp.rank, pp.size, virtual)
            if self.fsdp:
                self.modules = [fully_shard_dp(mod, dp_mesh) for mod in self.modules]
            self.schedule = build_schedule(self.modules, pp, self.device, m, cfg.schedule, self._loss_fn)
            # the validation loss runs the same schedule over the same stage modules, forwards only, as a separate
            # instance: a schedule that switches between eval and train infers its shapes again with a training
            # forward, which would shift the dropout masks of the next step (keyed by the forward count)
            self.eval_schedule = build_schedule(self.modules, pp, self.device, m, cfg.schedule, self._loss_fn)
            self.model = None
        else:
            self.modules = [fully_shard_dp(model, dp_mesh) if self.fsdp else model]
            self.model = self.modules[0]
            if dp.size > 1 and not self.fsdp and self.ep is None:
                # torch's DDP averages the gradients over the dp group (bucketed, overlapped with backward); the
                # micro-batches before the last run under no_sync, so only the accumulated gradient is reduced
                from torch.nn.parallel import DistributedDataParallel
                self.ddp = DistributedDataParallel(model, process_group=dp.pg,
                                                   **no_forward_buffer_sync(DistributedDataParallel))
        for mod in self.modules:
            mod.train()
        seen: dict[int, tuple[str, nn.Parameter]] = {}
        for mod in self.modules:
            for n, p in mod.named_parameters():
                if p.requires_grad:   # frozen weights (the base under LoRA) get no optimizer state, no checkpoint
                    seen.setdefault(id(p), (n, p))
        self.named_params = list(seen.values())
        self.params = [p for _, p in self.named_params]
        self.optimizer = make_optimizer(cfg, self.named_params)
        self.embed_group = self._embedding_group() if self.tied else None
        self._leaders = None
        if pp.size > 1:
            self._pp_leaders()  # created now, in the same order on every rank
        self.batches = data.train_batches(batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed)
        self.step = 0  # optimiser steps done

    # ------------------------------------------------------------ set-up

    def autocast(self):
        """The forward's autocast: bf16 for ``dtype="bfloat16"`` (fp32 weights, gradients and AdamW state)."""
        if self.cfg.dtype == "bfloat16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _ce(self, logits: torch.Tensor, target: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        """Vocab-parallel cross-entropy of ``logits [mb, s, V_r]`` against ``target [mb, s]`` (``"sum"``: over the
        target tokens, 0 when there is none), outside autocast (the pipeline schedule calls it inside the
        forward's autocast; at pp = 1 it runs after it), so the loss is the same function of the logits at every
        layout."""
        with torch.autocast(self.device.type, enabled=False):
            return vocab_parallel_cross_entropy(logits, target, self.tp, partition=self.plan.vocab,
                                                label_smoothing=self.cfg.label_smoothing, reduction=reduction)

    def _loss_fn(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The pipeline schedule's loss of one micro-batch: its summed cross-entropy times ``_token_weight``
        (``dp * M / N``, set per step: the schedule divides by ``M``, the dp average by ``dp``, leaving the sum
        over the global batch's ``N`` target tokens / ``N``, step 3 of the module docstring)."""
        return self._ce(logits, target) * self._token_weight

    def _embedding_group(self):
        """The 2-rank group of (first stage, last stage) for this rank's (dp, cp, tp) position; every rank creates
        all."""
        grid, mine = self.ctx.grid, None       # [dp, pp, cp, tp]
        for d in range(grid.shape[0]):
            for c in range(grid.shape[2]):
                for t in range(grid.shape[3]):
                    ranks = [int(grid[d, 0, c, t]), int(grid[d, -1, c, t])]
                    g = dist.new_group(ranks)
                    if self.ctx.rank in ranks:
                        mine = g
        return mine

    def _pp_leaders(self):
        """The group of pipeline ranks at (dp 0, cp 0, tp 0); every rank creates it (once)."""
        if getattr(self, "_leaders", None) is None:
            self._leaders = dist.new_group([int(r) for r in self.ctx.grid[0, :, 0, 0]])
        return self._leaders

    # ------------------------------------------------------------ one step

    def _replica_rows(self, ids: torch.Tensor, labels: torch.Tensor):
        """This dp replica's rows ``[B/dp, s]`` of a global batch ``[B, s]``, on the device."""
        dp = self.ctx.dp
        rows = ids.shape[0] // dp.size
        sl = slice(dp.rank * rows, (dp.rank + 1) * rows)
        return ids[sl].to(self.device), labels[sl].to(self.device)

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over the target tokens of a batch ``[b, s]`` (pp = 1; the same value on every tp and
        cp rank), forward under autocast. Its autograd graph is this rank's share at cp > 1: train through
        :meth:`forward_backward`.

        Collectives: the model's, the two all-reduces of the vocab-parallel cross-entropy, one scalar over cp.
        """
        n = int((labels != IGNORE_INDEX).sum())
        return self._sum_over_cp(self._ce(*self._logits(input_ids, labels))) / n

    def _logits(self, input_ids: torch.Tensor, labels: torch.Tensor):
        """pp = 1: the vocab-sharded logits ``[b, s, V_r]`` of ``input_ids [b, s]`` (forward under autocast) and
        the labels they answer, both at this rank's positions at cp > 1 (``[b, s/cp, V_r]``, ``[b, s/cp]``)."""
        net = self.ddp or self.modules[0]
        ids, labels = input_ids.to(self.device), labels.to(self.device)
        extra = {}
        if self.ctx.cp.size > 1:
            ids, labels, pos = self._cp_shard(ids, labels)
            extra["position_ids"] = pos.expand(ids.shape[0], -1)                  # the rotary tables' positions
        with self.autocast():
            return net(input_ids=ids, use_cache=False, **extra).logits, labels  # [b, s(/cp), V_r]

    def _cp_shard(self, ids: torch.Tensor, labels: torch.Tensor):
        """This cp rank's positions ``pos [s/cp]`` (:func:`~tensorpar.layers.ring_attention.cp_positions`) of
        ``ids`` and ``labels`` ``[b, s]``: ``(ids [b, s/cp], labels [b, s/cp], pos)``. The labels are the next
        tokens of the whole sequence (shifted before the split), so the last position of a chunk keeps its target."""
        cp = self.ctx.cp
        pos = cp_positions(ids.shape[1], cp.size, cp.rank, device=ids.device)
        return ids.index_select(1, pos), labels.index_select(1, pos), pos

    def _sum_over_cp(self, x: torch.Tensor) -> torch.Tensor:
        """A scalar summed over the cp ranks (their shares of a mean loss); ``x`` itself at cp = 1."""
        return comm.all_reduce(x.reshape(1), self.ctx.cp)[0] if self.ctx.cp.size > 1 else x

    def forward_backward(self, ids: torch.Tensor, labels: torch.Tensor, targets: int | None = None) -> torch.Tensor:
        """This replica's share of the global batch's mean loss and the accumulated gradients (step 3 of the
        module docstring): ``ids, labels [B/dp, s]`` its rows, ``targets`` the global batch's target tokens ``N``
        (default: this replica's times dp). Returns ``dp * (this replica's summed loss) / N``, whose dp average
        is the global mean."""
        m, dp = self.cfg.micro_batches, self.ctx.dp.size
        targets = targets or int((labels != IGNORE_INDEX).sum()) * dp
        self.rng.set_step(self.step)
        if self.schedule is None:
            total = torch.zeros((), device=self.device)
            pairs = list(zip(ids.chunk(m), labels.chunk(m)))
            for i, (x, y) in enumerate(pairs):
                last = i == len(pairs) - 1
                if self.fsdp:  # as DDP's no_sync: FSDP reduce-scatters the accumulated gradient once, at the last
                    self.modules[0].set_requires_gradient_sync(last)
                with contextlib.nullcontext() if self.ddp is None or last else self.ddp.no_sync():
                    loss = self._ce(*self._logits(x, y)) * (dp / targets)
                    loss.backward()
                total = total + loss.detach()
            return self._sum_over_cp(total)
        pp = self.ctx.pp
        first, last = pp.rank == 0, pp.rank == pp.size - 1
        if self.ctx.cp.size > 1:   # the stages compute their positions from the cp group (DecoderStage)
            ids, labels, _ = self._cp_shard(ids, labels)
        losses: list[torch.Tensor] = []
        self._token_weight = dp * m / targets
        with self.autocast():
            self.schedule.step(*((ids,) if first else ()), **({"target": labels, "losses": losses} if last else {}))
        return self._sum_over_cp(self._pipeline_mean(losses))

    def _pipeline_mean(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The last stage's mean of its micro-batch losses, broadcast to every stage of the pipeline."""
        pp = self.ctx.pp
        last = pp.rank == pp.size - 1
        mean = torch.stack(losses).mean().detach() if last else torch.zeros((), device=self.device)
        return comm.broadcast(mean.reshape(1), pp, src=pp.size - 1)[0]

    def complete_grads(self) -> None:
        """Step 4 of the module docstring: cp and tp sums, tied first/last stage sum, dp average (experts of ep:
        / dp)."""
        tp, dp = self.ctx.tp, self.ctx.dp
        if self.ctx.cp.size > 1:  # each cp rank's gradient is that of its positions' share of the loss: summed
            all_reduce_grads([p for p in self.params if p.grad is not None], self.ctx.cp)
        sync_sequence_parallel_grads(self.params, tp)
        sync_duplicated_grads(self.params, tp)
        if self.embed_group is not None:
            p = self._tied_param()
            if p is not None:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(local_tensor(p.grad), group=self.embed_group)  # FSDP: same dp rows on both stages
        if self.ep is not None:
            # each rank's experts already hold the gradient of every replica's tokens routed to them (the
            # all-to-all's backward), i.e. the sum over dp of the replicas' mean losses: / dp, as for the rest
            for p in self.params:
                if getattr(p, "ep_dim", None) is not None and p.grad is not None:
                    p.grad.div_(dp.size)
        if dp.size > 1 and self.ddp is None and not self.fsdp:  # pipeline stages, ep: one bucket, replicas' average
            all_reduce_grads([p for p in self.params if p.grad is not None and getattr(p, "ep_dim", None) is None],
                              dp, divide=dp.size)

    def _tied_param(self):
        names = dict(self.named_params)
        return names.get("model.embed_tokens.weight", names.get("lm_head.weight"))

    def global_grad_norm(self) -> torch.Tensor:
        """The single-device grad norm (:func:`tensorpar.grads.grad_norm`: every parameter counted once over tp, dp
        under FSDP, ep (each rank's experts) and pp, the same bits on every rank); the tied LM head copy on the last
        stage left out."""
        params = self.params
        if self.tied and self.ctx.pp.rank == self.ctx.pp.size - 1 and self.ctx.pp.rank != 0:
            tied = self._tied_param()
            params = [p for p in params if p is not tied]
        return grad_norm(params, self.ctx.tp, self.ctx.dp if self.fsdp else None, ep=self.ep, pp=self.ctx.pp)

    def clip_grads(self) -> torch.Tensor:
        """The grad norm before clipping (:meth:`global_grad_norm`); with ``grad_clip > 0`` every gradient is
        scaled by ``min(1, grad_clip / (norm + 1e-6))`` (the same scale on every rank). The one place where the
        trainer computes the norm and clips."""
        norm = self.global_grad_norm()
        if self.cfg.grad_clip > 0:
            scale = (self.cfg.grad_clip / (norm + 1e-6)).clamp(max=1.0)
            for p in self.params:
                if p.grad is not None:
                    local_tensor(p.grad).mul_(scale)
        return norm

    def train_step(self, inspect: Callable[["Trainer"], None] | None = None) -> StepResult:
        """Take the next global batch and do one optimiser step.

        ``inspect(trainer)``, if given, is called once the gradients are complete and clipped, just before
        the optimizer uses them (tests compare them there).
        """
        t0 = time.perf_counter()
        ids, labels = next(self.batches)
        targets = int((labels != IGNORE_INDEX).sum())
        if not targets:  # the same global batch on every rank: all skip together
            return self._skip(ids, t0)
        loss = self.forward_backward(*self._replica_rows(ids, labels), targets)
        if self.ctx.dp.size > 1:
            loss = comm.all_reduce(loss.reshape(1), self.ctx.dp)[0] / self.ctx.dp.size
        self.complete_grads()
        norm = self.clip_grads()
        if inspect is not None:
            inspect(self)
        lr = lr_at(self.cfg, self.step)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return StepResult(self.step, float(loss), float(norm), lr, int(ids.numel()), time.perf_counter() - t0)

    def _skip(self, input_ids: torch.Tensor, t0: float) -> StepResult:
        """Account for a batch without any target token: no forward, no update; reported once on rank 0."""
        from tensorpar.launch import rank0_print

        lr = lr_at(self.cfg, self.step)
        self.step += 1
        rank0_print(f"tensorpar: warning: step {self.step}: every label is ignore_index (no target token); "
                    f"optimizer step skipped")
        return StepResult(self.step, float("nan"), 0.0, lr, int(input_ids.numel()), time.perf_counter() - t0,
                          skipped=True)

    def evaluate(self, max_batches: int | None = None) -> float:
        """Mean validation loss over the first ``max_batches`` (default ``cfg.eval_batches``) batches, no dropout
        (:func:`tensorpar.train.evaluate.validation_loss`)."""
        return validation_loss(self, max_batches)
