"""Cut a decoder into pipeline stages by the planner's rule; each stage keeps Hugging Face parameter names.

Stage balancing (one source of truth with the planner, :func:`tensorpar.planner.partition.stage_layers`):
the ``num_layers`` blocks are cut into ``pp * virtual`` consecutive chunks whose sizes differ by at most one,
the larger chunks last (the first stage also holds the embedding); rank ``i`` of the pipeline holds chunks
``i, i + pp, i + 2 pp, ...`` (the interleaved assignment of Narayanan et al. 2021, Sec. 2.2.2). The first chunk
holds the embedding, the last the final norm and the LM head; a tied LM head is a separate copy on the last
stage whose gradient is summed with the embedding's (:meth:`tensorpar.train.loop.Trainer.complete_grads`).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from tensorpar.hf.families import why_not
from tensorpar.shard import pipeline_chunks

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


def chunk_ranges(num_layers: int, pp: int, virtual: int = 1) -> list[tuple[int, int]]:
    """Half-open layer ranges of the ``pp * virtual`` chunks (:func:`tensorpar.shard.pipeline_chunks`)."""
    return pipeline_chunks(num_layers, pp, virtual)


class _Shell(nn.Module):
    """Holds the inner model's pieces under their original attribute names (``embed_tokens``, ``layers``, ...)."""


class DecoderStage(nn.Module):
    """One pipeline chunk of a (tensor-parallel) Llama-shaped decoder.

    Parameter names are the full model's (``model.layers.5.mlp.down_proj.weight``, ``lm_head.weight``), so
    checkpoints and the loader see the same names at every pp. With context parallelism (``model.tensorpar_cp``,
    :func:`tensorpar.hf.modules.context_parallelize`) ``s`` is this cp rank's ``s / cp`` positions, whose global
    indices feed the rotary tables. Shapes: the first chunk takes token ids ``[mb, s]``, the others hidden states
    ``[mb, s, h]`` (``[mb, s/tp, h]`` under sequence parallelism); the last
    returns this rank's vocabulary slice of the logits ``[mb, s, V_r]``, the others hidden states.
    Collectives: those of the blocks it holds (tp); the pipeline's point-to-point sends are the schedule's.
    """

    def __init__(self, model: nn.Module, layers: range, *, first: bool, last: bool):
        super().__init__()
        inner = model.model
        self.config, self.first, self.last = model.config, first, last
        self.tp = model.tp_group
        self.sequence_parallel = model.tensorpar_plan.sequence_parallel
        self.rng = model.tensorpar_dropout_rng
        self.cp = getattr(model, "tensorpar_cp", None)   # set by context_parallelize
        self.model = _Shell()
        if first:
            self.model.embed_tokens = inner.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): inner.layers[i] for i in layers})
        self.model.rotary_emb = inner.rotary_emb
        if last:
            self.model.norm = inner.norm
            self.lm_head = model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        if self.training and torch.is_grad_enabled():
            self.rng.next_forward()
        h = self.model.embed_tokens(x) if self.first else x
        s = x.shape[1] if self.first or not self.sequence_parallel else x.shape[1] * self.tp.size
        if self.cp is not None and self.cp.size > 1:   # this cp rank's positions of a cp times longer sequence
            from tensorpar.layers.ring_attention import cp_positions
            pos = cp_positions(s * self.cp.size, self.cp.size, self.cp.rank, device=h.device)
        else:
            pos = torch.arange(s, device=h.device)
        pos = pos.unsqueeze(0).expand(h.shape[0], -1)
        cos, sin = self.model.rotary_emb(h, pos)
        probe = h if h.shape[1] == s else h.new_empty(h.shape[0], s, h.shape[-1])
        mask = create_causal_mask(config=self.config, inputs_embeds=probe, attention_mask=None, cache=None,
                                  position_ids=pos)
        for layer in self.model.layers.values():
            h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=(cos, sin))
        if self.last:
            return self.lm_head(self.model.norm(h))
        return h


def check_pipeline(config, pp: int, virtual: int, micro_batches: int, schedule: str) -> None:
    """Checks made in the launching process for ``pp > 1``: a family the stages can run, enough layers for
    ``pp * virtual`` chunks, micro-batches a multiple of pp for the interleaved schedule. Raises ValueError
    naming the setting and what would work."""
    why = why_not("pipeline", config)   # the rule cut_stages applies in the ranks
    if why is not None:
        raise ValueError(f"--pp {pp}: {why}; use --pp 1")
    chunk_ranges(config.num_hidden_layers, pp, virtual)
    if schedule == "interleaved-1f1b" and micro_batches % pp:
        raise ValueError(f"--micro-batches {micro_batches} must be a multiple of --pp {pp} for the interleaved "
                         f"1F1B schedule; use {micro_batches + pp - micro_batches % pp}")


def stage_layers(num_layers: int, pp_rank: int, pp: int, virtual: int = 1) -> tuple[set[int], bool, bool]:
    """The decoder layers that pipeline rank ``pp_rank`` holds, and whether it holds the first chunk (embedding)
    and the last (final norm, LM head)."""
    ranges = chunk_ranges(num_layers, pp, virtual)
    mine = range(pp_rank, len(ranges), pp)
    return {i for c in mine for i in range(*ranges[c])}, 0 in mine, len(ranges) - 1 in mine


def dropped_modules(config, pp_rank: int, pp: int, virtual: int = 1) -> list[str]:
    """The qualified names of the modules of a (Llama-shaped) ``*ForCausalLM`` of ``config`` that pipeline rank
    ``pp_rank`` does not hold: the other chunks' decoder layers (``model.layers.<i>``), the embedding unless it
    holds the first chunk (or the last, when the LM head is tied to the embedding: the head is that tensor), the
    final norm and LM head unless it holds the last. One rule for :func:`keep_stage_modules` (a sharded meta model)
    and for the from-scratch initialisation (:func:`tensorpar.train.model.init_from_seed`, before sharding)."""
    layers, first, last = stage_layers(config.num_hidden_layers, pp_rank, pp, virtual)
    out = [f"model.layers.{i}" for i in range(config.num_hidden_layers) if i not in layers]
    if not first and not (last and getattr(config, "tie_word_embeddings", False)):
        out.append("model.embed_tokens")
    if not last:
        out += ["model.norm", "lm_head"]
    return out


def keep_stage_modules(model: nn.Module, pp_rank: int, pp: int, virtual: int = 1) -> nn.Module:
    """Drop from ``model`` (sharded by :func:`tensorpar.hf.apply.parallelize`, still on the meta device) the
    modules that pipeline rank ``pp_rank`` does not hold (:func:`dropped_modules`; ``nn.Identity`` placeholders
    keep the layer indices), so that loading afterwards reads and materialises only this rank's stage.
    :func:`cut_stages` then cuts the same chunks. Returns ``model``."""
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    names = dropped_modules(model.config, pp_rank, pp, virtual)
    if tied and stage_layers(model.config.num_hidden_layers, pp_rank, pp, virtual)[2]:
        names = [n for n in names if n != "model.embed_tokens"]   # the head is the embedding's tensor
    for name in names:
        parent, _, attr = name.rpartition(".")
        model.get_submodule(parent).register_module(attr, nn.Identity())
    return model


def cut_stages(model: nn.Module, pp_rank: int, pp: int, virtual: int = 1) -> list[DecoderStage]:
    """The chunks that pipeline rank ``pp_rank`` holds (``virtual`` of them), each a :class:`DecoderStage`.

    ``model`` is a model sharded by :func:`tensorpar.hf.apply.parallelize`; the rest of it is dropped by the
    caller. Raises ValueError for a family whose blocks need more than the causal mask and one rotary table,
    and for more chunks than layers.
    """
    plan = model.tensorpar_plan
    why = why_not("pipeline", model.config)
    if why is not None:
        raise ValueError(f"{why}; use pp=1")
    ranges = chunk_ranges(plan.num_layers, pp, virtual)
    n = len(ranges)
    out = []
    for c in range(pp_rank, n, pp):
        a, b = ranges[c]
        out.append(DecoderStage(model, range(a, b), first=c == 0, last=c == n - 1))
    return out


def build_schedule(stages: list[nn.Module], pp, device: torch.device, micro_batches: int, schedule: str, loss_fn):
    """torch.distributed.pipelining's schedule over this rank's stage modules (from :func:`cut_stages`).

    ``pp``: the pipeline :class:`~tensorpar.comm.Group`; ``loss_fn(logits, target)`` runs on the last stage, per
    micro-batch. GPipe and 1F1B take one stage per rank, interleaved 1F1B ``virtual`` of them (stage indices
    ``pp.rank + k * pp.size``). The schedule's ``step`` runs forward and backward of all micro-batches (gradients
    accumulated, then divided by ``micro_batches``), its ``eval`` the forwards only. Raises ValueError for an
    unknown schedule or an interleaved one whose micro-batches are not a multiple of pp.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: use one of {', '.join(SCHEDULES)}")
    n = pp.size * len(stages)
    piped = [PipelineStage(mod, pp.rank + k * pp.size, n, device, group=pp.pg) for k, mod in enumerate(stages)]
    m = micro_batches
    if schedule == "interleaved-1f1b":
        if m % pp.size:
            raise ValueError(f"micro_batches={m} must be a multiple of pp={pp.size} for the interleaved 1F1B "
                             f"schedule; use micro_batches={m + pp.size - m % pp.size}")
        return ScheduleInterleaved1F1B(piped, m, loss_fn=loss_fn)
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    return cls(piped[0], m, loss_fn=loss_fn)
