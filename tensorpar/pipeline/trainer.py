"""Training steps on the (dp, pp, tp) grid: tensor parallelism inside a stage, torch's pipeline schedules across
stages, data-parallel gradient averaging across replicas.

One optimiser step, on every rank:

1. the global batch ``[B, s]`` (the same on every rank: same seed) is cut into ``dp`` slices by rows; replica
   ``d`` takes rows ``[d B/dp, (d+1) B/dp)``, and cuts them into ``M`` micro-batches;
2. ``pp == 1``: each micro-batch's mean loss / ``M`` is back-propagated (gradient accumulation);
   ``pp > 1``: ``torch.distributed.pipelining``'s schedule (GPipe, 1F1B or interleaved 1F1B) runs the
   micro-batches through the stages with the vocab-parallel cross-entropy on the last stage; its
   ``scale_grads`` divides the accumulated gradients by ``M``. With equal tokens per micro-batch the mean of
   the micro-batch means is the whole batch's mean, so the gradients equal one step on the whole batch;
3. gradients are completed: summed over tp for sequence-parallel norms and duplicated KV rows
   (:mod:`tensorpar.grads`), summed between the first and last stage for a tied embedding/LM head (Megatron's
   embedding group), and averaged over dp: by torch's ``DistributedDataParallel`` on the dp group when
   ``pp == 1`` (overlapped with backward; earlier micro-batches under ``no_sync``), by one bucketed all-reduce
   per step for pipeline stages; or, with ``dp_mode="fsdp"``, reduce-scattered by FSDP2 (``fully_shard`` on the
   dp axis of the DeviceMesh, per decoder block and each stage's root), so that each dp rank holds 1/dp of every
   gradient (torch.chunk's rows), of every parameter between steps and of the AdamW state;
4. the grad norm is the single-device one: the tp-aware norm of each stage's parameters, squares summed over
   pp (the tied LM head counted once) and, under FSDP, over dp; clip; AdamW on each rank's own slices.

The reported loss is the last stage's mean over micro-batches, broadcast over pp and averaged over dp.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn

from tensorpar import comm
from tensorpar.grads import grad_norm, is_dtensor, local_tensor, sync_duplicated_grads, sync_sequence_parallel_grads
from tensorpar.layers import vocab_parallel_cross_entropy
from tensorpar.pipeline.stages import cut_stages
from tensorpar.layers.dropout import DropoutRNG, install_dropout
from tensorpar.train.loop import StepResult, lr_at, make_optimizer

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


def public_attrs(p: torch.Tensor) -> dict:
    """A tensor's own attributes that carry meaning for us (``tp_dim``, ``tp_partition``, ``sequence_parallel``,
    ``ep_dim``, ...): the public entries of its ``__dict__`` (torch's private ones, e.g. ``_is_param``, left out)."""
    return {k: v for k, v in vars(p).items() if not k.startswith("_")}


def fully_shard_dp(module: nn.Module, mesh) -> nn.Module:
    """Apply FSDP2 (``torch.distributed.fsdp.fully_shard``) over the 1-D dp ``mesh``: each decoder block
    (``module.model.layers``, a list or a pipeline stage's dict) is one unit, the rest (embedding, final norm, LM
    head) the root's. Returns ``module`` (now an ``FSDPModule``).

    Shapes: every parameter becomes a DTensor of its tp-local shape, ``Shard(0)`` over dp (each dp rank holds
    ``ceil(rows / dp)`` rows, the last fewer); the tp attributes (``tp_dim``, ``tp_partition``,
    ``sequence_parallel``, ...) are copied onto the new parameters by name, so :mod:`tensorpar.grads` and the
    checkpoint code still see them. Collectives (FSDP's): all-gather over dp before each unit's forward and
    backward, reduce-scatter (average) of its gradients after backward.
    """
    from torch.distributed.fsdp import fully_shard

    attrs = {n: public_attrs(p) for n, p in module.named_parameters()}
    layers = module.model.layers
    for block in (layers.values() if isinstance(layers, nn.ModuleDict) else layers):
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    for n, p in module.named_parameters():
        for k, v in attrs.get(n, {}).items():
            if not hasattr(p, k):
                setattr(p, k, v)
    return module


class ParallelTrainer:
    """Holds this rank's stage(s), optimizer and batch iterator for a (tp, pp, dp) run.

    Args:
        cfg: the run's :class:`~tensorpar.train.config.TrainConfig` (``micro_batches``, ``schedule`` used here).
        ctx: the :class:`~tensorpar.parallel.ParallelContext` (its tp, pp and dp groups and rank grid).
        model, plan: the whole model, sharded over tp (:func:`tensorpar.train.model.build_model`); only this
            rank's stages are kept.
        data: the token streams.

    Raises:
        ValueError: ``batch_size`` not divisible by ``dp * micro_batches``; an unknown schedule; a family or
            layer count that the pipeline cannot cut (:func:`tensorpar.pipeline.stages.cut_stages`).

    ``cfg.dp_mode == "fsdp"`` with ``dp > 1``: every stage module is sharded over dp by :func:`fully_shard_dp`
    (instead of DDP or the per-step all-reduce); at ``dp == 1`` it changes nothing.
    """

    def __init__(self, cfg, ctx, model: nn.Module, plan, data):
        self.cfg, self.ctx, self.plan, self.data = cfg, ctx, plan, data
        tp, pp, dp = ctx.tp, ctx.pp, ctx.dp
        m = cfg.micro_batches
        if cfg.schedule not in SCHEDULES:
            raise ValueError(f"schedule={cfg.schedule!r}: use one of {', '.join(SCHEDULES)}")
        if cfg.batch_size % (dp.size * m):
            raise ValueError(f"batch_size={cfg.batch_size} is not divisible by dp x micro_batches = {dp.size} x {m}; "
                             f"use a batch size that is a multiple of {dp.size * m}")
        self.rng = DropoutRNG(cfg.seed)
        install_dropout(model, self.rng, attention_dropout=cfg.attention_dropout, hidden_dropout=cfg.hidden_dropout)
        self.tied = plan.tie_word_embeddings and pp.size > 1
        self.fsdp = cfg.dp_mode == "fsdp" and dp.size > 1
        dp_mesh = ctx.mesh["dp"] if self.fsdp else None
        if pp.size > 1:
            virtual = 2 if cfg.schedule == "interleaved-1f1b" else 1
            self.modules = cut_stages(model, pp.rank, pp.size, virtual)
            if self.fsdp:
                self.modules = [fully_shard_dp(mod, dp_mesh) for mod in self.modules]
            self.schedule = self._schedule(virtual)
        else:
            self.modules, self.schedule = [fully_shard_dp(model, dp_mesh) if self.fsdp else model], None
        self.ddp = None
        if pp.size == 1 and dp.size > 1 and not self.fsdp:
            # torch's DDP averages the gradients over the dp group (bucketed, overlapped with backward); the
            # micro-batches before the last run under no_sync, so only the accumulated gradient is reduced
            from torch.nn.parallel import DistributedDataParallel
            self.ddp = DistributedDataParallel(model, process_group=dp.pg,
                                               **_no_forward_buffer_sync(DistributedDataParallel))
        for mod in self.modules:
            mod.train()
        seen: dict[int, tuple[str, nn.Parameter]] = {}
        for mod in self.modules:
            for n, p in mod.named_parameters():
                seen.setdefault(id(p), (n, p))
        self.named_params = list(seen.values())
        self.params = [p for _, p in self.named_params]
        self.optimizer = make_optimizer(cfg, self.named_params)
        self.embed_group = self._embedding_group() if self.tied else None
        self._leaders = None
        if pp.size > 1:
            self._pp_leaders()  # created now, in the same order on every rank
        self.batches = data.train_batches(batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed)
        self.step = 0
        self.device = ctx.device

    # ------------------------------------------------------------ set-up

    def _loss_fn(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, target, self.ctx.tp, partition=self.plan.vocab,
                                            label_smoothing=self.cfg.label_smoothing)

    def _schedule(self, virtual: int):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        pp = self.ctx.pp
        n = pp.size * virtual
        stages = [PipelineStage(mod, pp.rank + k * pp.size, n, self.ctx.device, group=pp.pg)
                  for k, mod in enumerate(self.modules)]
        m = self.cfg.micro_batches
        if self.cfg.schedule == "interleaved-1f1b":
            if m % pp.size:
                raise ValueError(f"micro_batches={m} must be a multiple of pp={pp.size} for the interleaved 1F1B "
                                 f"schedule; use micro_batches={m + pp.size - m % pp.size}")
            return ScheduleInterleaved1F1B(stages, m, loss_fn=self._loss_fn)
        cls = ScheduleGPipe if self.cfg.schedule == "gpipe" else Schedule1F1B
        return cls(stages[0], m, loss_fn=self._loss_fn)

    def _embedding_group(self):
        """The 2-rank group of (first stage, last stage) for this rank's (dp, tp) position; every rank creates all."""
        grid, mine = self.ctx.grid, None
        for d in range(grid.shape[0]):
            for t in range(grid.shape[2]):
                ranks = [int(grid[d, 0, t]), int(grid[d, -1, t])]
                g = dist.new_group(ranks)
                if self.ctx.rank in ranks:
                    mine = g
        return mine

    # ------------------------------------------------------------ one step

    def _local_batch(self):
        ids, labels = next(self.batches)
        dp = self.ctx.dp
        rows = ids.shape[0] // dp.size
        sl = slice(dp.rank * rows, (dp.rank + 1) * rows)
        return ids[sl].to(self.device), labels[sl].to(self.device)

    def forward_backward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Loss of this replica's rows (mean over its micro-batches) and accumulated gradients."""
        m = self.cfg.micro_batches
        self.rng.set_step(self.step)
        if self.schedule is None:
            import contextlib

            net = self.ddp or self.modules[0]
            total = torch.zeros((), device=self.device)
            pairs = list(zip(ids.chunk(m), labels.chunk(m)))
            for i, (x, y) in enumerate(pairs):
                sync = self.ddp is None or i == len(pairs) - 1
                if self.fsdp:  # as DDP's no_sync: FSDP reduce-scatters the accumulated gradient once, at the last
                    net.set_requires_gradient_sync(i == len(pairs) - 1)
                with contextlib.nullcontext() if sync else self.ddp.no_sync():
                    loss = self._loss_fn(net(input_ids=x, use_cache=False).logits, y) / m
                    loss.backward()
                total = total + loss.detach()
            return total
        pp = self.ctx.pp
        first, last = pp.rank == 0, pp.rank == pp.size - 1
        losses: list[torch.Tensor] = []
        args = (ids,) if first else ()
        kw = {"target": labels, "losses": losses} if last else {}
        self.schedule.step(*args, **kw)
        mean = torch.stack(losses).mean().detach() if last else torch.zeros((), device=self.device)
        return comm.broadcast(mean.reshape(1), pp, src=pp.size - 1)[0]

    def complete_grads(self) -> None:
        """Steps 3 of the module docstring: tp sums, tied first/last stage sum, dp average."""
        tp, dp = self.ctx.tp, self.ctx.dp
        sync_sequence_parallel_grads(self.params, tp)
        sync_duplicated_grads(self.params, tp)
        if self.embed_group is not None:
            p = self._tied_param()
            if p is not None:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(local_tensor(p.grad), group=self.embed_group)  # FSDP: same dp rows on both stages
        if dp.size > 1 and self.ddp is None and not self.fsdp:  # pipeline stages: one bucket, replicas' average
            ps = [p for p in self.params if p.grad is not None]
            flat = comm.all_reduce(torch.cat([p.grad.reshape(-1) for p in ps]), dp) / dp.size
            off = 0
            for p in ps:
                p.grad.copy_(flat[off:off + p.numel()].view_as(p.grad))
                off += p.numel()

    def _tied_param(self):
        names = dict(self.named_params)
        return names.get("model.embed_tokens.weight", names.get("lm_head.weight"))

    def global_grad_norm(self) -> torch.Tensor:
        """The single-device grad norm: tp-aware within the stage, squares summed over pp, tied weight once."""
        params = self.params
        if self.tied and self.ctx.pp.rank == self.ctx.pp.size - 1 and self.ctx.pp.rank != 0:
            tied = self._tied_param()
            params = [p for p in params if p is not tied]
        return grad_norm(params, self.ctx.tp, self.ctx.dp if self.fsdp else None, pp=self.ctx.pp)

    # ------------------------------------------------------------ evaluation

    @torch.no_grad()
    def _forward_loss(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward only, chunk by chunk in model order; activations go to the next chunk's rank point-to-point.

        Returns the loss (mean over this replica's rows), the same on every rank of the pipeline.
        """
        if self.schedule is None:
            return self._loss_fn(self.modules[0](input_ids=ids, use_cache=False).logits, labels)
        pp, grid = self.ctx.pp, self.ctx.grid
        d, t = self.ctx.dp.rank, self.ctx.tp.rank
        n = pp.size * len(self.modules)
        h, loss = None, torch.zeros((), device=self.device)
        for c in range(n):
            owner = c % pp.size
            if pp.rank == owner:
                mod = self.modules[c // pp.size]
                if c > 0 and owner != (c - 1) % pp.size:
                    h = torch.empty(self._hidden_shape(ids), device=self.device)
                    dist.recv(h, src=int(grid[d, (c - 1) % pp.size, t]), group=pp.pg)
                out = mod(ids if c == 0 else h)
                if c == n - 1:
                    loss = self._loss_fn(out, labels)
                else:
                    h = out
                    if (c + 1) % pp.size != owner:
                        dist.send(h.contiguous(), dst=int(grid[d, (c + 1) % pp.size, t]), group=pp.pg)
        return comm.broadcast(loss.reshape(1), pp, src=(n - 1) % pp.size)[0]

    def _hidden_shape(self, ids: torch.Tensor) -> tuple[int, int, int]:
        s = ids.shape[1] // self.ctx.tp.size if self.plan.sequence_parallel else ids.shape[1]
        return ids.shape[0], s, self.modules[0].config.hidden_size

    @torch.no_grad()
    def evaluate(self, max_batches: int | None = None) -> float:
        """Mean validation loss over the first ``max_batches`` (default ``cfg.eval_batches``) batches, no dropout;
        each dp replica takes its rows of every batch, and the replicas' means are averaged."""
        n = max_batches or self.cfg.eval_batches
        for mod in self.modules:
            mod.eval()
        try:
            total, count = 0.0, 0
            dp = self.ctx.dp
            for i, (x, y) in enumerate(self.data.val_batches(batch_size=self.cfg.batch_size,
                                                             seq_len=self.cfg.seq_len)):
                if i == n:
                    break
                rows = x.shape[0] // dp.size
                sl = slice(dp.rank * rows, (dp.rank + 1) * rows)
                loss = self._forward_loss(x[sl].to(self.device), y[sl].to(self.device))
                if dp.size > 1:
                    loss = comm.all_reduce(loss.reshape(1), dp)[0] / dp.size
                total += float(loss)
                count += 1
        finally:
            for mod in self.modules:
                mod.train()
        if count == 0:
            raise ValueError("the validation split has no batch of batch_size x seq_len tokens; lower batch_size or "
                             "seq_len, or raise val_fraction")
        return total / count

    # ------------------------------------------------------------ checkpoints

    def save(self, root):
        """Checkpoint in the layout-independent format of :mod:`tensorpar.train.checkpoint` (every rank calls).

        Every rank writes the pieces it owns, in parallel, with ``torch.distributed.checkpoint``: data-parallel
        replica 0 only, each pipeline stage its own layers (a tied embedding / LM head on the first stage), each
        tp rank its rows (:func:`~tensorpar.train.checkpoint.state_pieces`); no rank gathers parameters or
        optimizer state. Rank 0 publishes the folder once all ranks have written. It resumes at any (tp, pp,
        dp), tp = 1 on one process included. Collectives: DCP's plan exchange and three one-element
        all-reduces over all ranks. Raises CheckpointError on every rank if any rank's write failed.
        """
        from tensorpar.train.checkpoint import optimizer_step, save_pieces, state_pieces

        ctx = self.ctx
        mine = self._checkpoint_names()
        if self.tied and ctx.pp.rank != 0:  # the tied LM head is the embedding: stored by the first stage
            mine = [(n, p) for n, p in mine if n != "model.embed_tokens.weight"]
        # every replica asks _tp_local for the same tensors (a dp-sharded mode may gather there); replica 0 writes
        ps = state_pieces(mine, self.optimizer, ctx.tp.rank, local=self._tp_local)
        if ctx.dp.rank != 0:
            ps = []
        state = {"config": self.cfg.to_dict(), "data": self.batches.state_dict(),
                 "tokenizer": self.data.tokenizer, "data_source": self.data.source,
                 "tp_size_at_save": ctx.tp.size, "pp_size_at_save": ctx.pp.size, "dp_size_at_save": ctx.dp.size}
        return save_pieces(root, ps, step=self.step, state=state,
                           optimizer_step=optimizer_step(self.named_params, self.optimizer),
                           config_json=self.modules[0].config.to_json_string(), keep=self.cfg.keep_checkpoints,
                           pg=None, rank=ctx.rank, device=ctx.device)

    def _tp_local(self, param: nn.Parameter, t: torch.Tensor) -> torch.Tensor:
        """The tp-local tensor a checkpoint stores for ``param`` (``t``: its data or an AdamW moment).

        Shape: ``param``'s tp-local shape. With DDP every replica holds it whole, so it is ``t``; under FSDP2 it is
        gathered over dp by :meth:`tp_local` (one all-gather over dp). Called on every rank, for the same
        parameters in the same order.
        """
        return self.tp_local(t)

    def tp_local(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a parameter, gradient or optimizer state of this rank) at its tp-local shape, whole over dp.

        FSDP2 DTensors (``dp_mode="fsdp"``) are gathered: ``t.full_tensor()``, one all-gather over dp, so every dp
        rank must call it for the same tensors in the same order. Anything else is returned as is. This is the one
        place where the checkpoint code learns how dp holds a tensor.
        """
        return t.full_tensor() if is_dtensor(t) else t

    def _tp_local_state(self, *, gather: bool = True):
        """``(named_params, optimizer)`` for the tp-level checkpoint code (:func:`gather_full_state`,
        :func:`load_checkpoint`): without FSDP the parameters and optimizer themselves; under FSDP plain tensors of
        the tp-local shapes carrying the parameters' tp attributes (with ``gather``: their values, via
        :meth:`tp_local`; without: uninitialised, to be read into) and an object whose ``state`` maps them to
        the AdamW state, gathered likewise. :meth:`_set_tp_local_state` copies such tensors back."""
        import types

        named = self._checkpoint_names()
        if not self.fsdp:
            return named, self.optimizer
        out, state = [], {}
        with torch.no_grad():
            for n, p in named:
                t = (self.tp_local(p.detach()) if gather
                     else torch.empty(p.shape, dtype=p.dtype, device=local_tensor(p.detach()).device))
                for k, v in public_attrs(p).items():
                    setattr(t, k, v)
                st = self.optimizer.state.get(p)
                if gather and st:
                    state[t] = {k: self.tp_local(v) if torch.is_tensor(v) else v for k, v in st.items()}
                out.append((n, t))
        return out, types.SimpleNamespace(state=state)

    def _set_tp_local_state(self, named, optim) -> None:
        """Under FSDP, keep this dp rank's rows of tp-local tensors read by :meth:`_tp_local_state` (no collectives):
        into the parameters, and as the AdamW state (DTensors laid out like their parameter)."""
        if not self.fsdp:
            return
        from torch.distributed.tensor import DTensor

        from tensorpar.grads import dp_rows

        with torch.no_grad():
            for (_, p), (_, t) in zip(self._checkpoint_names(), named):
                start, n = dp_rows(p)
                local_tensor(p.detach()).copy_(t.narrow(0, start, n))
                st = optim.state.get(t)
                if st:
                    self.optimizer.state[p] = {
                        k: (DTensor.from_local(v.narrow(0, start, n).clone(), p.device_mesh, p.placements,
                                               shape=p.shape, stride=p.stride())
                            if torch.is_tensor(v) and v.shape == t.shape else v) for k, v in st.items()}

    def _checkpoint_names(self):
        """Parameters under their checkpoint names: a tied LM head on the last stage is the embedding (stored once)."""
        if not self.tied:
            return self.named_params
        return [("model.embed_tokens.weight" if n == "lm_head.weight" else n, p) for n, p in self.named_params]

    def _pp_leaders(self):
        """The group of pipeline ranks at (dp 0, tp 0); every rank creates it (once)."""
        if getattr(self, "_leaders", None) is None:
            self._leaders = dist.new_group([int(r) for r in self.ctx.grid[0, :, 0]])
        return self._leaders

    def resume(self, path) -> dict:
        """Continue from a checkpoint saved at any (tp, pp, dp): each rank reads the stored pieces that overlap its
        stage's rows (no collective). Raises the ValueErrors of :func:`tensorpar.train.checkpoint.load_checkpoint`
        (e.g. a checkpoint of another model shape, naming the tensor and both shapes)."""
        from tensorpar.train.checkpoint import latest_checkpoint, load_checkpoint

        ckpt = latest_checkpoint(path)
        named, optim = self._tp_local_state(gather=False)
        state = load_checkpoint(ckpt, named_params=named, optimizer=optim, tp=self.ctx.tp, part=self.ctx.pp.size > 1)
        self._set_tp_local_state(named, optim)
        self.batches.load_state_dict(state["data"])
        self.step = int(state["step"])
        return state

    def optimizer_state_bytes(self) -> int:
        """Bytes of the AdamW moments (``exp_avg``, ``exp_avg_sq``; the scalar step counts left out) that this rank
        holds: its dp rows under FSDP (the dp ranks' parts add up to DDP's, ~1/dp each), every tensor whole under
        DDP. 0 before the first step (the state is created lazily)."""
        return sum(local_tensor(v).numel() * v.element_size() for st in self.optimizer.state.values()
                   for k, v in st.items() if k != "step" and torch.is_tensor(v))

    def train_step(self, inspect=None) -> StepResult:
        """Take the next global batch and do one optimiser step; ``inspect(trainer)`` sees the complete grads."""
        t0 = time.perf_counter()
        ids, labels = self._local_batch()
        loss = self.forward_backward(ids, labels)
        if self.ctx.dp.size > 1:
            loss = comm.all_reduce(loss.reshape(1), self.ctx.dp)[0] / self.ctx.dp.size
        self.complete_grads()
        norm = self.global_grad_norm()
        if self.cfg.grad_clip > 0:
            scale = (self.cfg.grad_clip / (norm + 1e-6)).clamp(max=1.0)
            for p in self.params:
                if p.grad is not None:
                    local_tensor(p.grad).mul_(scale)
        if inspect is not None:
            inspect(self)
        lr = lr_at(self.cfg, self.step)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return StepResult(self.step, float(loss), float(norm), lr, self.cfg.batch_size * self.cfg.seq_len,
                          time.perf_counter() - t0)


def _no_forward_buffer_sync(ddp_cls) -> dict:
    """DDP's keyword that turns off the buffer broadcast before every forward (the model's buffers, RoPE
    frequencies and constants such as an expert-owner map, are the same on every replica):
    ``forward_sync_buffers=False`` since torch 2.13, where ``broadcast_buffers`` is deprecated (a FutureWarning
    on every rank), ``broadcast_buffers=False`` before. The new keyword still broadcasts the buffers once at
    construction, which changes nothing for equal buffers."""
    import inspect

    if "forward_sync_buffers" in inspect.signature(ddp_cls.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}
