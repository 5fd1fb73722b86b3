"""The step plan every tp rank runs (a :class:`StepPlan` of :class:`Row` s) and its wire format: under serve rank 0
broadcasts each plan as one int64 tensor (:func:`encode_plan`, :func:`decode_plan`;
:meth:`tensorpar.serve.engine.Engine.exchange`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Row:
    """One request's part of a step: feed ``tokens`` at positions ``start ..`` of the row's KV blocks.

    ``blocks``: the row's block table (position ``p`` lives in block ``blocks[p // block_size]`` of the engine's
    pool); ``None``: the one block ``[slot]`` (the static layout of ``generate``: one block of ``max_len`` per
    row). ``slot`` is otherwise only the row's name. ``start == 0`` is a prefill (batched with the step's other
    prefills); otherwise a continuation: the one last token (decode; continuations of equal token counts run
    together) or, after a prefix-cache hit or a preemption, the tokens not in the cache.
    ``sampled``: the token is sampled on rank 0 (else greedy). ``logprobs``: -1 none, 0 the chosen token's
    log-probability, k > 0 also the top-k.
    """

    slot: int
    tokens: list[int]
    start: int
    sampled: bool = False
    logprobs: int = -1
    blocks: list[int] | None = None

    @property
    def table(self) -> list[int]:
        """The row's block table: ``blocks``, or ``[slot]``."""
        return self.blocks if self.blocks is not None else [self.slot]


@dataclass
class StepPlan:
    """What every rank does next: ``op`` is ``"step"`` (run ``rows``), ``"noop"`` (heartbeat) or ``"stop"``."""

    op: str
    rows: list[Row] = field(default_factory=list)


#: words of the fixed-size plan message (32 KiB: 64 decode rows with 16-block tables fit); a longer plan sends
#: the rest in a second broadcast
PLAN_WORDS = 4096
_OPS = ("stop", "step", "noop")
PLAN_MAGIC = 0x7470_5350                # "tpSP": a desynchronised message fails loudly instead of running garbage
_HEAD = 5                           # magic, op, rows, tokens + block-table words, total words
_ROW = 6                            # slot, start, tokens, sampled, logprobs, blocks (-1: None)


def encode_plan(plan: StepPlan) -> torch.Tensor:
    """``plan`` as a 1-D int64 CPU tensor: a header ``[magic, op, rows, tokens, total words]``, then per row
    ``[slot, start, len(tokens), sampled, logprobs, len(blocks) or -1]``, then every row's tokens and block table
    in row order (``5 + 6 * rows + tokens + blocks`` words; :func:`decode_plan` inverts it). Raises ValueError for
    an unknown op."""
    if plan.op not in _OPS:
        raise ValueError(f"StepPlan.op must be one of {_OPS}, got {plan.op!r}")
    rows = plan.rows
    ntok = sum(len(r.tokens) + len(r.blocks or ()) for r in rows)
    words = [PLAN_MAGIC, _OPS.index(plan.op), len(rows), ntok, _HEAD + _ROW * len(rows) + ntok]
    for r in rows:
        words += (r.slot, r.start, len(r.tokens), int(r.sampled), r.logprobs,
                  -1 if r.blocks is None else len(r.blocks))
    for r in rows:
        words += r.tokens
        words += r.blocks or ()
    return torch.tensor(words, dtype=torch.int64)


def decode_plan(t: torch.Tensor) -> StepPlan:
    """The :class:`StepPlan` of :func:`encode_plan`'s tensor ``t`` (1-D int64, at least the header's total
    words; trailing words are ignored). Raises ValueError on a bad magic word or op code."""
    w = t.tolist()
    if len(w) < _HEAD or w[0] != PLAN_MAGIC or not 0 <= w[1] < len(_OPS) or len(w) < w[4]:
        raise ValueError(f"not a step plan message (header {w[:_HEAD]}): the tp ranks are out of step")
    n, rows, off = w[2], [], _HEAD + _ROW * w[2]
    for i in range(n):
        slot, start, k, sampled, lp, nb = w[_HEAD + _ROW * i:_HEAD + _ROW * (i + 1)]
        blocks = None if nb < 0 else w[off + k:off + k + nb]
        rows.append(Row(slot, w[off:off + k], start, bool(sampled), lp, blocks))
        off += k + max(nb, 0)
    return StepPlan(_OPS[w[1]], rows)
