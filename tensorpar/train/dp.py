"""Data parallelism for the trainer: FSDP2 over the dp axis, and DDP's buffer-sync keyword.

With ``dp_mode="ddp"`` the replicas' gradients are averaged by torch's ``DistributedDataParallel`` (pp = 1) or by
one bucketed all-reduce per step (pipeline stages, :meth:`tensorpar.train.loop.Trainer.complete_grads`); with
``dp_mode="fsdp"`` by FSDP2's reduce-scatter (:func:`fully_shard_dp`).
"""
from __future__ import annotations

import torch
import torch.nn as nn


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


def no_forward_buffer_sync(ddp_cls) -> dict:
    """DDP's keyword that turns off the buffer broadcast before every forward (the model's buffers, RoPE
    frequencies and constants such as an expert-owner map, are the same on every replica):
    ``forward_sync_buffers=False`` since torch 2.13, where ``broadcast_buffers`` is deprecated (a FutureWarning
    on every rank), ``broadcast_buffers=False`` before. The new keyword still broadcasts the buffers once at
    construction, which changes nothing for equal buffers."""
    import inspect

    if "forward_sync_buffers" in inspect.signature(ddp_cls.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}
