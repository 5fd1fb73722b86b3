"""A step's segments as rows of one token, so that the row step (:class:`~tensorpar.decode.row_step.RowStep`) runs
short prompts and mixed steps too, not only decode rows.

A segment of ``b`` rows of ``s`` tokens (:class:`~tensorpar.decode.kv_cache.Segment`: a prompt, a padded group of
prompts, decode rows) is, token by token, the same computation as ``b * s`` rows of one token: every token's
matmuls, norms and activation are its own; its K/V go to its own cache position; its query attends to its row's
positions under its row of the mask. Within one layer the row step writes every row's K/V (rotary and cache write
for all rows) before any row's attention reads the cache, so a prompt's token ``c`` sees the K/V of the tokens
``< c`` of the same step, as in one causal forward. The attention kernel skips masked positions (never reads them),
so a row whose mask is wider than its own length computes exactly what it would alone.

:func:`as_rows` turns one segment into such rows (``None`` where it cannot: see there), :func:`merge` joins several
into one segment of one-token rows, each with its own block table, cache position and mask row.
No collectives (the row step runs those of one step over the merged rows).
"""
from __future__ import annotations

import torch

from tensorpar.decode.kv_cache import Segment, offsets


class Rows:
    """The tokens of one segment as rows of one token: ``ids`` ``[n]`` (or the residual stream ``[n, h]`` on a later
    pipeline stage), ``rope_pos`` ``[n]``, ``blocks`` ``[n, nb]`` (each row's block table), ``cache_pos`` ``[n]``,
    ``mask`` ``[n, length]`` bool (``None``: every row attends to all of ``[0, length)``), ``length`` (the segment's),
    ``last`` (per segment row, the index in ``0..n-1`` of its last token: the row whose logits it returns) and
    ``whole`` (every token of the segment kept, in order)."""
    __slots__ = ("ids", "rope_pos", "blocks", "cache_pos", "mask", "length", "last", "whole")

    def __init__(self, ids, rope_pos, blocks, cache_pos, mask, length, last, whole):
        self.ids, self.rope_pos, self.blocks, self.cache_pos = ids, rope_pos, blocks, cache_pos
        self.mask, self.length, self.last, self.whole = mask, length, last, whole

    @property
    def n(self) -> int:
        return self.cache_pos.shape[0]

    def part(self, a: int, b: int) -> "Rows":
        """Rows ``[a, b)`` as rows of their own (``last``: the segment rows whose last token lies there, re-based)."""
        last = self.last[(self.last >= a) & (self.last < b)] - a
        return Rows(self.ids[a:b], self.rope_pos[a:b], self.blocks[a:b], self.cache_pos[a:b],
                    None if self.mask is None else self.mask[a:b], self.length, last, self.whole)


def as_rows(ids: torch.Tensor, rope_pos: torch.Tensor, g: Segment, *, per_row_rope: bool) -> Rows | None:
    """Segment ``g``'s tokens (``ids``, ``rope_pos``: its ``b * s`` tokens row by row) as :class:`Rows`: the tokens it
    stores (``write``; all when ``None``), or ``None`` where that would not be the segment's own computation:

    * a token not stored is left out, so a row's last token must be stored (its logits are the row's);
    * every kept token must attend to its own cache position (a left-padded prompt's pads attend to themselves in
      ``generate``; a query that attends to nothing has no softmax);
    * ``per_row_rope`` (longrope: the rotary factors follow the row's length, not the token's position) and ``s > 1``:
      the row step computes a row's factors from its own position.
    """
    b, s = g.b, g.s
    if s > 1 and per_row_rope:
        return None
    dev = rope_pos.device
    if g.blocks is None:        # a start segment: row r in block r, positions start .. start + s - 1
        pos = torch.arange(g.start, g.start + s, device=dev).expand(b, s)
        blocks = torch.arange(b, device=dev).view(b, 1)
    else:
        pos, blocks = g.cache_pos, g.blocks
    keep = None
    if g.write is not None:
        if not bool(g.write[:, -1].all()):
            return None
        keep = g.write.reshape(-1).nonzero().view(-1)
    if int(pos.max()) >= g.length:
        return None
    mask = None
    if g.mask is not None:
        m = g.mask.reshape(b, s, g.length)                                     # [b, s, L] (the head dim is 1)
        own = m.gather(2, pos.reshape(b, s, 1)).view(b * s)                    # each query at its own position
        mask = m.reshape(b * s, g.length)
        if keep is not None:
            own, mask = own[keep], mask[keep]
        if not bool(own.all()):
            return None
    rows = torch.arange(b, device=dev).repeat_interleave(s)
    pos = pos.reshape(-1)
    ends = torch.arange(1, b + 1, device=dev) * s - 1                          # each row's last token
    if keep is not None:
        ids, rope_pos, rows, pos = ids[keep], rope_pos[keep], rows[keep], pos[keep]
        last = torch.searchsorted(keep, ends)                                  # its place among the kept
    else:
        last = ends
    return Rows(ids, rope_pos, blocks[rows], pos, mask, g.length, last, keep is None or keep.numel() == b * s)


def merge(parts: list[Rows]) -> tuple[torch.Tensor, torch.Tensor, Segment, torch.Tensor]:
    """``(ids, rope_pos, segment, last)``: the rows of ``parts`` one after the other as one segment of ``n`` rows of
    one token (block tables padded with block 0 to the widest, read only under the mask; cache positions
    ``[n, 1]``; the length the longest part's; a mask ``[n, 1, 1, L]`` where a part has one or the parts' lengths
    differ, a part without one attending to all of its own ``[0, length)``), and ``last``: the merged row of each
    part's segment rows' last token, part after part."""
    if len(parts) == 1:
        p = parts[0]
        n = p.n
        mask = None if p.mask is None else p.mask.reshape(n, 1, 1, p.length)
        seg = Segment(n, 1, mask, p.length, blocks=p.blocks, cache_pos=p.cache_pos.view(n, 1))
        return p.ids, p.rope_pos, seg, p.last
    L = max(p.length for p in parts)
    nb = max(p.blocks.shape[1] for p in parts)
    dev = parts[0].cache_pos.device
    blocks = torch.cat([torch.nn.functional.pad(p.blocks, (0, nb - p.blocks.shape[1])) for p in parts])
    mask = None
    if any(p.mask is not None or p.length != L for p in parts):
        span = torch.arange(L, device=dev)
        mask = torch.cat([(span < p.length).expand(p.n, L) if p.mask is None
                          else torch.nn.functional.pad(p.mask, (0, L - p.length)) for p in parts])
    n = blocks.shape[0]
    offs, last = 0, []
    for p in parts:
        last.append(p.last + offs)
        offs += p.n
    seg = Segment(n, 1, None if mask is None else mask.reshape(n, 1, 1, L), L, blocks=blocks,
                  cache_pos=torch.cat([p.cache_pos for p in parts]).view(n, 1))
    return (torch.cat([p.ids for p in parts]), torch.cat([p.rope_pos for p in parts]), seg, torch.cat(last))


def run_split(step, ids: torch.Tensor, rope_pos: torch.Tensor, segments, rest):
    """``forward_segments(ids, rope_pos, segments)``'s logits with row step ``step``
    (:class:`~tensorpar.decode.row_step.RowStep`) running the segments it can as rows of one token (:func:`as_rows`)
    and fit in its ``R`` rows, the decode rows (which come last) first, in one program (:func:`merge`); the others
    go through ``rest`` (``forward_segments``, which may run the row step again for them); logits in segment order,
    or ``None`` where the row step runs none. A pipeline stage before the last runs it only for all of the step's
    tokens (its residual stream ``[T, h]`` goes on). Why: the general loop's framework ops per layer (a new prompt
    beside 31 decode rows of SmolLM2 at tp=2: +41.6 ms as its own forward, bench/results/serve_step.md; 163 ms for
    a 16-row step against the row step's 80, bench/results/batch-rows-xeon.md). Collectives: the row step's (the
    embedding's all-reduce and two per layer, of ``[n, H]`` for its ``n`` rows), then ``rest``'s."""
    dec = step.dec
    if len(segments) == 1 and segments[0].s == 1 and segments[0].b > step.R:
        return decode_chunks(step, ids, rope_pos, segments[0])
    parts, n, o = {}, 0, offsets(segments)
    for i in reversed(range(len(segments))):
        g = segments[i]
        if n + (g.b * g.s if g.write is None else int(g.write.sum())) > step.R:   # its stored tokens do not fit
            continue
        p = as_rows(ids[o[i]:o[i] + g.b * g.s], rope_pos[o[i]:o[i] + g.b * g.s], g,
                    per_row_rope=dec.rope_switch is not None)
        if p is not None and n + p.n <= step.R:
            parts[i], n = p, n + p.n
    whole = len(parts) == len(segments)
    if not parts or not (dec.last or (whole and all(p.whole for p in parts.values()))):
        return None
    x_ids, x_pos, seg, last = merge([parts[i] for i in sorted(parts)])
    if not step.runs([seg]):
        return None
    mine = step(x_ids, x_pos, seg, pick=last if dec.last else None)
    if whole:
        return mine
    left = [i for i in range(len(segments)) if i not in parts]
    span = [slice(o[i], o[i] + segments[i].b * segments[i].s) for i in left]
    others = rest(torch.cat([ids[s] for s in span]), torch.cat([rope_pos[s] for s in span]),
                  [segments[i] for i in left])
    out, a, c = [], 0, 0                                          # one row of logits per segment row, in order
    for i, g in enumerate(segments):
        if i in parts:
            out.append(mine[a:a + g.b])
            a += g.b
        else:
            out.append(others[c:c + g.b])
            c += g.b
    return torch.cat(out)


def decode_chunks(step, ids: torch.Tensor, rope_pos: torch.Tensor, g: Segment):
    """``forward_segments(ids, rope_pos, [g])`` for ``g`` a step of ``b`` decode rows (one token each), more than the
    row step's ``R``: the rows in chunks of at most ``R``, one row-step program each, one after the other; logits (or a
    stage's residual stream) in row order; ``None`` where the row step runs none of them. Each row's computation is
    its own (its matmul rows, norms, K/V at its own position, attention over its own row), so it is the same in any
    chunk: what a decoder of more rows than ``R`` (``max_batch`` above ``MAX_ROWS``) runs instead of the general
    loop. The weights are read once per chunk. Collectives: the row step's per chunk (the embedding's all-reduce
    and two per layer, of ``[rows, H]``)."""
    dec = step.dec
    p = as_rows(ids, rope_pos, g, per_row_rope=dec.rope_switch is not None)
    if p is None or not (dec.last or p.whole):
        return None
    runs = [merge([p.part(a, min(p.n, a + step.R))]) for a in range(0, p.n, step.R)]
    if not all(step.runs([seg]) for _, _, seg, _ in runs):
        return None
    return torch.cat([step(x_ids, x_pos, seg, pick=last if dec.last else None)
                      for x_ids, x_pos, seg, last in runs])
