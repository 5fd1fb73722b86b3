"""How global sizes split across ranks: heads and vocabulary over tensor-parallel ranks, layers over
pipeline stages. These follow what tensorpar's layers support:

* query heads split near-evenly, sizes differing by at most one (the first ``num_heads % tp`` ranks hold
  one extra head);
* a rank holds every KV head its query heads read; a GQA group that straddles two ranks has its KV head
  duplicated on both, and when ``tp`` exceeds the KV head count each rank holds one replicated KV head;
* ``tp`` may not exceed the number of query heads;
* vocabulary rows split near-evenly;
* layers split near-evenly over pipeline stages (and virtual chunks), the extra layers going to the
  *last* chunks, so that the first stage, which holds the most micro-batches in flight, holds fewest.

The planner costs a layout at its busiest rank, so these functions also give the maximum per rank.
"""
from __future__ import annotations

from dataclasses import dataclass


def split_sizes(total: int, parts: int) -> list[int]:
    """``total`` items in ``parts`` near-even pieces, larger pieces first (sizes differ by at most one)."""
    if parts < 1:
        raise ValueError(f"cannot split {total} items into {parts} parts; parts must be >= 1")
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


@dataclass(frozen=True)
class RankHeads:
    """Heads held by one tensor-parallel rank: ``q`` query heads reading ``kv`` key/value heads.

    ``uniform``: every local KV head serves the same number of local query heads (then the
    attention kernel broadcasts KV heads; otherwise tensorpar gathers them per query head).
    """

    q: int
    kv: int
    uniform: bool = True


def head_partition(num_heads: int, num_kv_heads: int, tp: int) -> list[RankHeads]:
    """Query and KV heads per tensor-parallel rank (rank order).

    Query head j belongs to GQA group ``j // (num_heads // num_kv_heads)``; a rank holding query heads
    [start, stop) needs KV heads ``start // g`` .. ``(stop - 1) // g``.
    """
    if tp > num_heads:
        raise ValueError(
            f"tp ({tp}) exceeds the number of query heads ({num_heads}); use tp <= {num_heads}"
        )
    group = num_heads // num_kv_heads
    ranks, start = [], 0
    for size in split_sizes(num_heads, tp):
        stop = start + size
        counts = [min(stop, (k + 1) * group) - max(start, k * group)
                  for k in range(start // group, (stop - 1) // group + 1)]
        ranks.append(RankHeads(q=size, kv=len(counts), uniform=len(set(counts)) == 1))
        start = stop
    return ranks


def kv_heads_duplicated(num_heads: int, num_kv_heads: int, tp: int) -> bool:
    """Whether some KV head is held by more than one rank (a straddling group, or tp > KV heads)."""
    return sum(r.kv for r in head_partition(num_heads, num_kv_heads, tp)) > num_kv_heads


def busiest_heads(num_heads: int, num_kv_heads: int, tp: int) -> RankHeads:
    """The rank with the most query heads, and among those the most KV heads (the slowest rank)."""
    return max(head_partition(num_heads, num_kv_heads, tp), key=lambda r: (r.q, r.kv))


def max_vocab_rows(vocab_size: int, tp: int) -> int:
    """Rows of the largest vocabulary shard (near-even split)."""
    return -(-vocab_size // tp)


def stage_layers(num_layers: int, pp: int, virtual_stages: int = 1) -> list[int]:
    """Layers held by each pipeline stage.

    The model is cut into ``pp * virtual_stages`` chunks; stage i holds chunks i, i + pp, i + 2 pp, ...
    (the interleaved assignment of Narayanan et al. 2021, section 2.2.2). Extra layers go to the last chunks.
    """
    chunks = pp * virtual_stages
    if chunks > num_layers:
        raise ValueError(
            f"pp x virtual_stages ({pp} x {virtual_stages} = {chunks}) exceeds num_layers ({num_layers}); "
            "every pipeline chunk needs at least one layer"
        )
    sizes = split_sizes(num_layers, chunks)[::-1]
    return [sum(sizes[i::pp]) for i in range(pp)]
