"""The trainer's checkpoint side: saving, resuming, and the tp-local view of its parameters and optimizer state.

:class:`TrainerCheckpoints` holds the methods of :class:`tensorpar.train.loop.Trainer` that write and read its
checkpoints (:meth:`~TrainerCheckpoints.save`, :meth:`~TrainerCheckpoints.resume`, in the layout-independent
format of :mod:`tensorpar.train.checkpoint`) and that show how dp holds a tensor (:meth:`~TrainerCheckpoints.
tp_local`: DDP keeps it whole, FSDP2 gathers it); the trainer inherits them and they use its attributes
(``ctx``, ``optimizer``, ``named_params``, ``tied``, ``fsdp``, ``ep``, ``batches``, ``step``).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from tensorpar.grads import is_dtensor, local_tensor
from tensorpar.train.dp import public_attrs


class TrainerCheckpoints:
    """The checkpoint methods of :class:`~tensorpar.train.loop.Trainer` (a base class of it, not used alone)."""

    def save(self, root):
        """Checkpoint in the layout-independent format of :mod:`tensorpar.train.checkpoint` (every rank calls).

        Every rank writes the pieces it owns, in parallel, with ``torch.distributed.checkpoint``: data-parallel
        replica 0 only, each pipeline stage its own layers (a tied embedding / LM head on the first stage), each
        tp rank its rows (:func:`~tensorpar.train.checkpoint.state_pieces`); no rank gathers parameters or
        optimizer state. Rank 0 publishes the folder once all ranks have written. It resumes at any (tp, pp,
        dp), tp = 1 on one process included. Collectives: DCP's plan exchange and three one-element
        all-reduces over all ranks. Raises CheckpointError on every rank if any rank's write failed. Under LoRA
        the trainable parameters are the adapters: the checkpoint holds them only, and rank 0 adds them in PEFT's
        format (:meth:`_peft_files`).
        """
        from tensorpar.train.checkpoint import optimizer_step, save_pieces, state_pieces

        ctx = self.ctx
        mine = self._checkpoint_names()
        if self.tied and ctx.pp.rank != 0:  # the tied LM head is the embedding: stored by the first stage
            mine = [(n, p) for n, p in mine if n != "model.embed_tokens.weight"]
        # every replica asks _tp_local for the same tensors (a dp-sharded mode may gather there); replica 0 writes
        ps = state_pieces(mine, self.optimizer, ctx.tp.rank, local=self._tp_local,
                          ep_rank=self.ep.rank if self.ep is not None else 0)
        if ctx.dp.rank != 0:  # experts split over ep (the dp axis): every replica writes its own
            experts = {n for n, p in mine if getattr(p, "ep_dim", None) is not None}
            ps = [pc for pc in ps if pc.key.split("/")[-1] in experts]
        if ctx.cp.rank != 0:  # the cp ranks hold the same parameters and optimizer state: cp rank 0 writes them
            ps = []
        state = {"config": self.cfg.to_dict(), "data": self.batches.state_dict(),
                 "tokenizer": self.data.tokenizer, "data_source": self.data.source,
                 "tp_size_at_save": ctx.tp.size, "pp_size_at_save": ctx.pp.size, "dp_size_at_save": ctx.dp.size,
                 "cp_size_at_save": ctx.cp.size}
        return save_pieces(root, ps, step=self.step, state=state,
                           optimizer_step=optimizer_step(self.named_params, self.optimizer),
                           config_json=self.modules[0].config.to_json_string(), keep=self.cfg.keep_checkpoints,
                           pg=None, rank=ctx.rank, device=ctx.device, before_publish=self._peft_files())

    def _peft_files(self):
        """Under LoRA, the writer of the checkpoint's PEFT files (``adapter_model.safetensors``,
        ``adapter_config.json``: :func:`tensorpar.train.lora.write_peft_files`); otherwise None."""
        if self.cfg.lora_r is None:
            return None
        from tensorpar.train.lora import write_peft_files
        base = getattr(self.modules[0].config, "_name_or_path", None) or None
        return lambda folder: write_peft_files(folder, self.cfg, base)

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

    def resume(self, path) -> dict:
        """Continue from a checkpoint saved at any (tp, pp, dp): each rank reads the stored pieces that overlap its
        stage's rows (no collective). Raises the ValueErrors of :func:`tensorpar.train.checkpoint.load_checkpoint`
        (e.g. a checkpoint of another model shape, naming the tensor and both shapes)."""
        from tensorpar.train.checkpoint import latest_checkpoint, load_checkpoint

        ckpt = latest_checkpoint(path)
        named, optim = self._tp_local_state(gather=False)
        state = load_checkpoint(ckpt, named_params=named, optimizer=optim, tp=self.ctx.tp, part=self.ctx.pp.size > 1,
                                ep=self.ep)
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
