"""What a step plan becomes on a rank (:func:`step_batches`), and the record of the pipelined schedule
(:class:`PipelineStats`) of :class:`~tensorpar.serve.engine.Engine`.

With pipeline stages (``serve --pp P``) the engine runs in lockstep *ticks* (:meth:`Engine.tick`): at tick ``t``
stage ``s`` runs the plan rank 0 made at tick ``t - s``, so up to ``P`` plans (rank 0's scheduler keeps ``P``
batches of requests, one per stage, as vLLM's virtual engines) are in flight and every stage works every tick
once the pipeline is full. Pure functions and counters here; no collectives.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from tensorpar.serve.plan import Row
from tensorpar.serve.prefill import prefill_groups, prefill_layout


def step_batches(rows: list[Row], *, block_size: int, num_blocks: int, max_len: int):
    """The batches one forward of ``rows`` runs, ``[(tables, ids [b, s], pos [b, s], write or None)]``, and
    ``order``: the row index of each of their rows, batch after batch (the forward's logits come in that order).

    The prefill rows (``start == 0``) in the padded groups of :func:`prefill_groups` (layout of
    :func:`prefill_layout`; the pads are not written), then the other rows, those of equal token counts together
    (one group of every 1-token decode row, in block order, so that consecutive blocks are read as views).
    The same on every rank for one plan. Raises ValueError for a row outside the cache (``num_blocks`` blocks of
    ``block_size`` positions, ``max_len`` per row) or with no tokens, or two rows writing one block.
    """
    bs, written = block_size, set()
    for r in rows:
        t = r.table
        if not r.tokens or r.start < 0 or r.start + len(r.tokens) > max_len \
                or len(t) < -(-(r.start + len(r.tokens)) // bs) or not all(0 <= x < num_blocks for x in t):
            raise ValueError(f"row {r} does not fit the cache ({num_blocks} blocks of {bs} positions, "
                             f"{max_len} per row)")
        mine = set(t[r.start // bs:(r.start + len(r.tokens) - 1) // bs + 1])
        if mine & written:
            raise ValueError(f"a step plan writes block(s) {sorted(mine & written)} from two rows")
        written |= mine
    batches, order = [], []
    new = [i for i, r in enumerate(rows) if r.start == 0]
    for group in prefill_groups([len(rows[i].tokens) for i in new]):
        idx = [new[j] for j in group]
        ids, pos = prefill_layout([rows[i].tokens for i in idx])
        s = len(ids[0])
        write = [[c >= s - len(rows[i].tokens) for c in range(s)] for i in idx]   # the pads are not stored
        batches.append(([rows[i].table for i in idx], ids, pos, write))
        order.extend(idx)
    by_count: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        if r.start > 0:
            by_count.setdefault(len(r.tokens), []).append(i)
    for n, idx in sorted(by_count.items()):
        idx = sorted(idx, key=lambda i: rows[i].table)   # block order: consecutive blocks read as views
        batches.append(([rows[i].table for i in idx], [rows[i].tokens for i in idx],
                        [list(range(rows[i].start, rows[i].start + n)) for i in idx], None))
        order.extend(idx)
    return batches, order


@dataclass
class PipelineStats:
    """One rank's record of the engine's ticks (every rank keeps its own; the in-flight counts are the same on
    every rank, the busy ones are this stage's).

    Attributes:
        ticks: ticks run (:meth:`~tensorpar.serve.engine.Engine.tick`; one per plan at pp 1).
        busy_ticks: ticks in which this stage ran its layers.
        busy_s: seconds this stage spent running them (from the residual stream's arrival to the end of its
            layers, LM head included: not the waits for the stage before, for the tokens or for the plan).
        stages_busy: ticks by the number of stages that ran layers in them (``{2: 40}``: 40 ticks in which two
            stages computed at once; at most 1 when one micro-batch is in flight).
    """

    ticks: int = 0
    busy_ticks: int = 0
    busy_s: float = 0.0
    stages_busy: Counter = field(default_factory=Counter)

    def tick(self, flight: list, mine: bool) -> None:
        """Count one tick: ``flight`` is the work of each stage this tick (``None``: nothing), ``mine`` whether
        this stage has some."""
        self.ticks += 1
        self.busy_ticks += bool(mine)
        self.stages_busy[sum(w is not None for w in flight)] += 1
