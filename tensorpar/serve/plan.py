"""The step plan every tp rank runs (a :class:`StepPlan` of :class:`Row` s) and its wire format: under serve rank 0
broadcasts each plan as one int64 tensor (:func:`encode_plan`, :func:`decode_plan`;
:meth:`tensorpar.serve.engine.Engine.exchange`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Row:
    """One request's part of a step: feed ``tokens`` into ``slot`` at positions ``start ..``.

    ``start == 0`` is a prefill (batched with the step's other prefills); otherwise a continuation, usually the
    one last token (decode; continuations of equal token counts run together).
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


#: words of the fixed-size plan message (8 KiB); a longer plan sends the rest in a second broadcast
PLAN_WORDS = 1024
_OPS = ("stop", "step", "noop")
PLAN_MAGIC = 0x7470_5350                # "tpSP": a desynchronised message fails loudly instead of running garbage
_HEAD = 5                           # magic, op, rows, tokens, total words
_ROW = 5                            # slot, start, tokens, sampled, logprobs


def encode_plan(plan: StepPlan) -> torch.Tensor:
    """``plan`` as a 1-D int64 CPU tensor: a header ``[magic, op, rows, tokens, total words]``, then per row
    ``[slot, start, len(tokens), sampled, logprobs]``, then every row's tokens in row order
    (``5 + 5 * rows + tokens`` words; :func:`decode_plan` inverts it). Raises ValueError for an unknown op."""
    if plan.op not in _OPS:
        raise ValueError(f"StepPlan.op must be one of {_OPS}, got {plan.op!r}")
    rows = plan.rows
    ntok = sum(len(r.tokens) for r in rows)
    words = [PLAN_MAGIC, _OPS.index(plan.op), len(rows), ntok, _HEAD + _ROW * len(rows) + ntok]
    for r in rows:
        words += (r.slot, r.start, len(r.tokens), int(r.sampled), r.logprobs)
    for r in rows:
        words += r.tokens
    return torch.tensor(words, dtype=torch.int64)


def decode_plan(t: torch.Tensor) -> StepPlan:
    """The :class:`StepPlan` of :func:`encode_plan`'s tensor ``t`` (1-D int64, at least the header's total
    words; trailing words are ignored). Raises ValueError on a bad magic word or op code."""
    w = t.tolist()
    if len(w) < _HEAD or w[0] != PLAN_MAGIC or not 0 <= w[1] < len(_OPS) or len(w) < w[4]:
        raise ValueError(f"not a step plan message (header {w[:_HEAD]}): the tp ranks are out of step")
    n, rows, off = w[2], [], _HEAD + _ROW * w[2]
    for i in range(n):
        slot, start, k, sampled, lp = w[_HEAD + _ROW * i:_HEAD + _ROW * (i + 1)]
        rows.append(Row(slot, w[off:off + k], start, bool(sampled), lp))
        off += k
    return StepPlan(_OPS[w[1]], rows)
