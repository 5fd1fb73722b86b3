"""How global sizes split across ranks: heads and vocabulary over tensor-parallel ranks, layers over
pipeline stages. These follow what tensorpar's layers support:

* query heads, MLP columns and vocabulary rows split near-evenly with the runtime's own
  :func:`tensorpar.shard.split_sizes` (the first ``n % tp`` ranks hold one extra), so the planner accepts
  exactly the shapes the layers run (an MLP size not divisible by tp included) and rejects the rest with
  the runtime's message; ``tests/planner/test_planner_split_rules.py`` checks this over a grid of shapes against
  :class:`tensorpar.layers.attention.HeadLayout` and :class:`tensorpar.shard.Partition`;
* a rank holds every KV head its query heads read; a GQA group that straddles two ranks has its KV head
  duplicated on both, and when ``tp`` exceeds the KV head count each rank holds one replicated KV head;
* ``tp`` may not exceed the number of query heads, MLP columns or vocabulary rows;
* layers split near-evenly over pipeline stages (and virtual chunks), the extra layers going to the
  *last* chunks, so that the first stage, which holds the most micro-batches in flight, holds fewest.

The planner costs a layout at its busiest rank, so these functions also give the maximum per rank.
"""
from __future__ import annotations

from dataclasses import dataclass

from tensorpar.shard import split_sizes as _runtime_split


def split_sizes(total: int, parts: int, name: str = "dimension") -> list[int]:
    """``total`` items in ``parts`` near-even pieces, larger pieces first (sizes differ by at most one):
    :func:`tensorpar.shard.split_sizes`, the split the layers use.

    Raises:
        ValueError: ``parts < 1``, or fewer items than parts (the runtime's message, naming ``name``).
    """
    return _runtime_split(total, parts, name=name)


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
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads "
                         f"({num_kv_heads})")
    group = num_heads // num_kv_heads
    ranks, start = [], 0
    for size in split_sizes(num_heads, tp, name="num_attention_heads"):
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


def max_ffn_columns(ffn_hidden_size: int, tp: int) -> int:
    """MLP columns of the busiest rank (near-even split; an MLP size not divisible by tp is allowed)."""
    return -(-ffn_hidden_size // tp)


def split_problems(num_heads: int, num_kv_heads: int, ffn_hidden_size: int, vocab_size: int, tp: int) -> list[str]:
    """Why the runtime's layers cannot split these sizes over ``tp`` ranks (empty when they can): the
    errors of :func:`tensorpar.shard.split_sizes` for the query heads, MLP columns and vocabulary rows."""
    out = []
    for n, name in ((num_heads, "num_attention_heads"), (ffn_hidden_size, "intermediate_size"),
                    (vocab_size, "vocab_size")):
        try:
            split_sizes(n, tp, name=name)
        except ValueError as err:
            out.append(str(err))
    return out


def stage_layers(num_layers: int, pp: int, virtual_stages: int = 1) -> list[int]:
    """Layers held by each pipeline stage.

    The model is cut into ``pp * virtual_stages`` chunks; stage i holds chunks i, i + pp, i + 2 pp, ...
    (the interleaved assignment of Narayanan et al. 2021, section 2.2.2). Extra layers go to the last chunks.
    """
    from tensorpar.shard import pipeline_chunks  # the runtime's rule (tensorpar.pipeline.stages uses it too)

    sizes = [b - a for a, b in pipeline_chunks(num_layers, pp, virtual_stages)]
    return [sum(sizes[i::pp]) for i in range(pp)]
