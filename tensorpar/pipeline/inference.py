"""Pipeline stages in inference (``generate --pp``): which layers a stage holds, and what moves between stages.

The stages are cut by training's rule (:func:`tensorpar.pipeline.stages.stage_layers`, one chunk per pipeline
rank): consecutive layer ranges whose sizes differ by at most one, the larger ones last; the first stage holds the
embedding, the last the final norm and the LM head (a tied head: the embedding's tensor, so the last stage holds
it too). A rank loads only its stage (:func:`tensorpar.pipeline.stages.keep_stage_modules` before the loader reads
anything), and its KV cache holds only its stage's layers.

A step of the decode engine (:meth:`tensorpar.serve.engine.Engine.step`) under ``pp`` stages, on every rank with
the same plan: stage 0 embeds the step's tokens and runs its layers; stage ``k`` receives the residual stream
``[T, h]`` (``T``: the step's tokens) from stage ``k - 1`` (:func:`recv_hidden`; tp rank ``r`` of one stage
sends to tp rank ``r`` of the next, both hold the full ``[T, h]``), runs its layers and sends it on
(:func:`send_hidden`); the last stage computes its vocabulary slice of the logits and picks the tokens
(vocab-parallel, over its tp group) and broadcasts them over the pipeline group
(:func:`tensorpar.serve.tokens.choose_stage_tokens`; sampled
rows are drawn on global rank 0, where the samplers are, from the logits the last stage sends) so that every
stage builds the next step. ``generate`` runs one plan at a time: while stage ``k`` computes, the others wait,
so each stage is busy ``1 / pp`` of a step (a bubble of ``(pp - 1) / pp``). ``serve`` keeps ``pp`` plans in
flight (:meth:`~tensorpar.serve.engine.Engine.tick`): at tick ``t`` stage ``s`` runs the plan of tick
``t - s``, each of ``pp`` batches of requests has one plan in flight, and every stage computes every tick.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tensorpar.comm import Group
from tensorpar.comm.group import _run
from tensorpar.hf.families import why_not


@dataclass(frozen=True)
class Stage:
    """The part of the model one pipeline rank holds.

    Attributes:
        rank, size: this rank's index in the pipeline and the number of stages.
        layers: the decoder layers it holds (global indices, ascending).
        first: it holds the embedding (and takes token ids).
        last: it holds the final norm and the LM head (and returns logits).
    """

    rank: int
    size: int
    layers: tuple[int, ...]
    first: bool
    last: bool


def stage_of(config, pp_rank: int, pp: int) -> Stage:
    """The :class:`Stage` of pipeline rank ``pp_rank`` of ``pp`` for a model of ``config`` (training's cut, one
    chunk per rank). Raises the ValueError of :func:`check_stages`."""
    from tensorpar.pipeline.stages import stage_layers

    check_stages(config, pp)
    layers, first, last = stage_layers(config.num_hidden_layers, pp_rank, pp)
    return Stage(pp_rank, pp, tuple(sorted(layers)), first, last)


def check_stages(config, pp: int) -> None:
    """The rule for ``--pp`` of ``generate``, made in the launching process and again in each rank: a family whose
    record has a stage cut (``pipeline_stages``, full causal attention) and at least one layer per stage. Raises
    ValueError naming ``--pp``, its value and what works."""
    if pp < 1:
        raise ValueError(f"--pp must be a positive integer (1 = no pipeline stages), got {pp}")
    if pp == 1:
        return
    why = why_not("pipeline", config)
    if why is not None:
        raise ValueError(f"--pp {pp}: {why}; use --pp 1")
    n = config.num_hidden_layers
    if pp > n:
        raise ValueError(f"--pp {pp} exceeds the model's {n} decoder layers (every stage needs at least one); "
                         f"use --pp <= {n}")


def check_pp_arguments(args) -> None:
    """The flag-only rules of ``--pp`` on ``generate`` and ``serve`` (launching process): a positive degree, not
    with ``--ep`` (experts are split over the dp axis, which the stages do not cut) nor ``--quantize`` (the int8
    weights are not cut into stages). Raises ValueError naming the flags."""
    pp, ep, quantize = getattr(args, "pp", 1), getattr(args, "ep", 1), getattr(args, "quantize", "none")
    if pp < 1:
        raise ValueError(f"--pp must be a positive integer (1 = no pipeline stages), got {pp}")
    if pp > 1 and ep > 1:
        raise ValueError(f"--pp {pp} with --ep {ep}: expert parallelism runs without pipeline stages; drop one of them")
    if pp > 1 and quantize != "none":
        raise ValueError(f"--quantize {quantize} with --pp {pp}: the int8 weights are not cut into pipeline stages; "
                         f"drop one of them")


def send_hidden(x: torch.Tensor, pp: Group, pending=None):
    """Send the residual stream ``x`` ``[T, h]`` to the next stage (pipeline rank ``pp.rank + 1``, the same tp
    rank) without waiting for it: the send is posted (a copy of ``x``) and returned, ``(work, tensor)``, after
    ``pending`` (this stage's previous send) has completed. The next stage receives it at the next tick of the
    engine (:meth:`~tensorpar.serve.engine.Engine.tick`), after this stage has gone on to the tick's token
    broadcast: a blocking send (gloo waits for the matching recv) would deadlock there. Point-to-point on the
    pipeline group; raises :class:`~tensorpar.comm.CollectiveError` on failure (of this send or of ``pending``)."""
    wait_send(pending, pp)
    x = x.detach().clone().contiguous()        # the caller's buffer may be reused before the send completes
    pp.counter.record("send", x.numel(), x.element_size(), 2)
    work = _run("send", pp, x, lambda: dist.isend(x, group=pp.pg, group_dst=pp.rank + 1))
    return work, x


def wait_send(pending, pp: Group) -> None:
    """Wait for a send of :func:`send_hidden` (``None``: nothing to wait for)."""
    if pending is not None:
        work, x = pending
        t0 = pp.counter.start()
        _run("send", pp, x, work.wait)
        pp.counter.blocked("send", t0)


def recv_hidden(shape: tuple[int, int], dtype: torch.dtype, device: torch.device, pp: Group) -> torch.Tensor:
    """Receive the residual stream ``[T, h]`` from the stage before (pipeline rank ``pp.rank - 1``)."""
    x = torch.empty(shape, dtype=dtype, device=device)
    pp.counter.record("recv", x.numel(), x.element_size(), 2)
    t0 = pp.counter.start()
    _run("recv", pp, x, lambda: dist.recv(x, group=pp.pg, group_src=pp.rank - 1))
    pp.counter.blocked("recv", t0)      # while counting: the time this stage waited for the one before
    return x


def tokens_from_last(t: torch.Tensor, pp: Group) -> torch.Tensor:
    """Every stage gets the last stage's ``t`` (the step's tokens ``[n]``, or their log-probabilities): one
    broadcast over the pipeline group from its last rank (the same shape and dtype on every stage)."""
    from tensorpar import comm

    t0 = pp.counter.start()
    out = comm.broadcast(t, pp, src=pp.size - 1)
    pp.counter.blocked("broadcast", t0)   # while counting: a stage before the last waits here for the last
    return out


def module_stage_forward(model, stage: Stage, cache, parts, x: torch.Tensor | None, layer_masks) -> torch.Tensor:
    """The module path's forward of one pipeline stage (families without the lean decoder), one forward per batch.

    ``parts``: per batch ``(ids [b, s], pos [b, s], blocks [b, n], mask, length, write)`` (the engine's
    :meth:`~tensorpar.serve.engine.Engine._segment`); ``x``: the residual stream ``[T, h]`` from the stage before
    (``None`` on the first stage, which embeds ``ids``); ``cache``: the engine's
    :class:`~tensorpar.decode.slot_cache.SlotKVCache` (bound per batch; it holds only this stage's layers);
    ``layer_masks(pos, mask, length)``: the engine's attention masks. Each batch runs the stage's Hugging Face
    layers with the model's rotary table, as the model's own forward does. Returns the last stage's logits of each
    row's last position ``[sum(b), V_r]``, the other stages' residual stream ``[T, h]``. Collectives: the layers' tp
    all-reduces (and the embedding's on the first stage)."""
    base, outs, off = model.model, [], 0
    for ids_t, pos_t, blocks_t, mask, length, _ in parts:     # module path: one block (slot) per row
        slot_t = blocks_t[:, 0]
        b, s = ids_t.shape
        cache.bind(slot_t, pos_t, length)
        h = base.embed_tokens(ids_t) if x is None else x[off:off + b * s].view(b, s, -1)            # [b, s, h]
        off += b * s
        am, pe = layer_masks(pos_t, mask, length), base.rotary_emb(h, pos_t)
        for i in stage.layers:
            h = base.layers[i](h, attention_mask=am, position_embeddings=pe, position_ids=pos_t, cache=cache,
                               use_cache=False)
        outs.append(model.lm_head(base.norm(h[:, -1:]))[:, -1] if stage.last else h.reshape(b * s, -1))
    return torch.cat(outs)


def logprobs_from_last(want: list[int], lps, top, pp: Group, *, last: bool, device: torch.device):
    """The last stage's log-probabilities on every stage: per row the chosen token's (``want[i] >= 0``) and the top
    ``want[i]`` ``(id, lp)`` (``lps``, ``top`` as the last stage computed them; ignored elsewhere). One broadcast of
    ``[n, 1 + 2 k]`` float64 over the pipeline group (``k``: the most top entries a row asked for)."""
    n, k = len(want), max(want)
    msg = torch.zeros(n, 1 + 2 * k, dtype=torch.float64)
    if last:
        for i in range(n):
            msg[i, 0] = lps[i] if lps[i] is not None else 0.0
            for j, (tid, lp) in enumerate(top[i] or []):
                msg[i, 1 + 2 * j], msg[i, 2 + 2 * j] = tid, lp
    dev = device if device.type == "cuda" else torch.device("cpu")   # NCCL moves device tensors
    msg = tokens_from_last(msg.to(dev), pp).cpu()
    return ([float(msg[i, 0]) if w >= 0 else None for i, w in enumerate(want)],
            [[(int(msg[i, 1 + 2 * j]), float(msg[i, 2 + 2 * j])) for j in range(w)] if w > 0 else None
             for i, w in enumerate(want)])
