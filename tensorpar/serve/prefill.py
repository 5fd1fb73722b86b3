"""How a serving step batches its new prompts (:class:`~tensorpar.serve.engine.Engine`): groups of prompts run as one
padded forward each (:func:`prefill_groups`) and the padded layout of a group (:func:`prefill_layout`). Pure
functions of the step plan, so every rank computes the same groups. No collectives.
"""
from __future__ import annotations

#: padded tokens (rows x longest prompt) one batched prefill forward may hold; a longer burst is split
PREFILL_TOKENS = 4096
#: a prefill group grows while its padded size stays within this factor of its real tokens, plus
#: :data:`PREFILL_FREE_PAD` pad tokens (cheaper than another forward's fixed cost)
PREFILL_PAD_SLACK = 1.5
PREFILL_FREE_PAD = 64


def prefill_groups(lengths: list[int], *, budget: int = PREFILL_TOKENS, slack: float = PREFILL_PAD_SLACK,
                   free_pad: int = PREFILL_FREE_PAD) -> list[list[int]]:
    """Split prefill rows of token counts ``lengths`` into groups run as one padded forward each.

    Rows are taken longest first; a group of longest length ``s`` takes the next row while
    ``(rows + 1) * s <= budget`` and ``(rows + 1) * s <= slack * real_tokens + free_pad`` (so padding adds
    at most ``slack - 1`` of the real work, or ``free_pad`` tokens). A row longer than ``budget`` is a group of
    its own. Returns the indices into ``lengths`` of each group (deterministic: every rank gets the same groups
    from the same plan).
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    real = s = 0
    for i in order:
        n = lengths[i]
        if groups and (len(groups[-1]) + 1) * s <= min(budget, slack * (real + n) + free_pad):
            groups[-1].append(i)
            real += n
        else:
            groups.append([i])
            real = s = n
    return groups


def prefill_layout(prompts: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids and positions ``[b, s]`` of a batched prefill (``s``: the longest prompt).

    Row ``i`` of ``n`` tokens is ``[pad] * (s - n) + prompts[i]`` (the pad: its first token) at positions
    ``[n, .., s-1, 0, .., n-1]``: the positions are both the cache entries written and the rotary positions, so
    the prompt lands where a prefill alone puts it, and the last column is every row's last prompt token.
    With the mask ``key_pos <= query_pos`` no prompt token attends to a pad (see the module docstring).
    """
    s = max(len(p) for p in prompts)
    ids = [[p[0]] * (s - len(p)) + list(p) for p in prompts]
    pos = [list(range(len(p), s)) + list(range(len(p))) for p in prompts]
    return ids, pos
