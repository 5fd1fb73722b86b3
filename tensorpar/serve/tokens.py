"""Token choice of the decode engine (:class:`tensorpar.serve.engine.Engine`), the one place where both
``tensorpar generate`` and ``tensorpar serve`` pick their tokens:

* greedy: a vocab-parallel argmax (each rank's best logit and its global index, all-gathered: ``2 * b`` floats
  instead of the ``b * V`` logits), ties broken to the lowest index like ``torch.argmax``; every rank gets the
  same tokens without a broadcast;
* sampling: the sampled rows' logits are all-gathered, rank 0 samples each row with its sampler (temperature,
  top-k, top-p on a seeded generator) and broadcasts the tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tensorpar import comm
from tensorpar.comm import Group


@dataclass(frozen=True)
class SamplingConfig:
    """How to pick tokens. ``temperature == 0`` means greedy.

    Attributes:
        max_new_tokens: token budget per prompt (>= 1).
        temperature: softmax temperature; 0 for greedy.
        top_k: keep the k most likely tokens (0 = off).
        top_p: keep the smallest set of tokens with cumulative probability >= p (1.0 = off).
        seed: seed of rank 0's sampling generator.
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def vocab_parallel_argmax(logits: torch.Tensor, tp: Group, *, partition) -> torch.Tensor:
    """Global argmax over vocab-sharded logits ``[b, V_r] -> [b]`` (int64), lowest index on ties.

    ``partition``: the vocabulary split (a Partition, the vocab size, or the sharded model/LM head; see
    :mod:`tensorpar.layers.vocab`). Collectives: one all-gather of ``[b, 2]`` (float64, so token ids up to
    2^53 are exact; fp32 values exactly). The ``2 * b`` numbers on each side of it are handled as Python lists (a
    decode step's few rows: fewer framework calls than tensor ops on them). Raises ValueError for logits that are not
    this rank's slice.
    """
    from tensorpar.layers.vocab import check_local_width, resolve_vocab_partition

    vocab_start, _ = check_local_width(logits.shape[-1], resolve_vocab_partition(partition, tp), tp)
    val, idx = logits.float().max(dim=-1)
    if tp.size == 1 or logits.shape[0] == 0:
        return idx
    # this rank's best (value, global index) per row, [1, b, 2]; a handful of rows: Python lists, not tensor ops
    pair = torch.tensor([[[v, i + vocab_start] for v, i in zip(val.tolist(), idx.tolist())]], dtype=torch.float64,
                        device=logits.device)
    ranks = comm.all_gather(pair, tp, dim=0).tolist()                                 # [tp][b][2]
    tokens = []
    for j in range(len(ranks[0])):
        best = ranks[0][j]
        for r in ranks[1:]:     # the first (lowest-rank, hence lowest-index) maximum; a NaN wins, as in argmax
            v = r[j][0]
            if best[0] == best[0] and (v > best[0] or v != v):
                best = r[j]
        tokens.append(int(best[1]))
    return torch.tensor(tokens, dtype=torch.long, device=logits.device)


def sample(logits: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator) -> torch.Tensor:
    """Sample ``[b, V] -> [b]`` (int64, on ``logits``' device) with temperature, top-k and top-p
    (nucleus sampling, Holtzman et al. 2020).

    ``gen`` must live on ``logits``' device (``torch.multinomial`` draws with it there; a CPU generator
    cannot drive a CUDA draw). Raises ``ValueError`` naming both devices otherwise.
    """
    if gen.device.type != logits.device.type or (logits.device.index is not None
                                                 and gen.device.index not in (None, logits.device.index)):
        raise ValueError(f"sampling generator is on {gen.device} but the logits are on {logits.device}; "
                         f"create it with torch.Generator(device=logits.device)")
    x = logits.float() / cfg.temperature
    if cfg.top_k:
        kth = x.topk(min(cfg.top_k, x.shape[-1]), dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if cfg.top_p < 1.0:
        srt, order = x.sort(dim=-1, descending=True)
        cum = srt.softmax(-1).cumsum(-1)
        drop = cum - srt.softmax(-1) >= cfg.top_p            # keep the first token that crosses p
        x = x.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(x.softmax(-1), 1, generator=gen).squeeze(-1)


def sampler(cfg: SamplingConfig, gen: torch.Generator):
    """The per-row sampler :func:`choose_tokens` calls on rank 0: ``f(logits [1, V]) -> [1]`` drawing from ``gen``."""
    return lambda logits: sample(logits, cfg, gen)


def choose_tokens(logits: torch.Tensor, tp: Group, *, partition, sampled: list[int], samplers) -> torch.Tensor:
    """The next token of every row of vocab-sharded ``logits`` ``[n, V_r]``, identical on every rank: ``[n]``
    int64 on the CPU.

    Rows not in ``sampled`` take :func:`vocab_parallel_argmax`. Rows ``sampled`` (indices into the rows) are
    drawn on rank 0 by ``samplers[i](logits [1, V])`` (``samplers``: per row a callable, e.g. :func:`sampler`;
    ``None`` on the other ranks), in row order, then broadcast. Collectives: one all-gather ``[n, 2]`` unless every
    row is sampled; with sampled rows an all-gather of their logits ``[m, V_r] -> [m, V]`` and a broadcast of ``[n]``.
    """
    n = logits.shape[0]
    tokens = (vocab_parallel_argmax(logits, tp, partition=partition).cpu() if len(sampled) < n
              else torch.zeros(n, dtype=torch.long))                                         # [n]
    if sampled:
        idx = torch.tensor(sampled, device=logits.device)
        full = comm.all_gather(logits.index_select(0, idx).contiguous(), tp, -1, partition)     # [m, V]
        if tp.rank == 0 and samplers is not None:    # None: a follower whose tokens are not used (an ep replica)
            for j, i in enumerate(sampled):
                tokens[i] = int(samplers[i](full[j:j + 1]))
        if tp.size > 1:
            tokens = comm.broadcast(tokens.to(logits.device), tp, src=0).cpu()
    return tokens


def choose_stage_tokens(logits: torch.Tensor | None, n: int, tp: Group, pp: Group, world: Group, *, partition,
                        sampled: list[int], samplers, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """:func:`choose_tokens` with pipeline stages (:mod:`tensorpar.pipeline.inference`): the step's tokens ``[n]``
    (int64, CPU), the same on every rank of every stage.

    ``logits``: the last stage's vocab-sharded logits ``[n, V_r]`` (``None`` on the other stages). Greedy rows: the
    last stage's vocab-parallel argmax (:func:`vocab_parallel_argmax`), broadcast over the
    pipeline group. Rows ``sampled`` are drawn where the samplers live, global rank 0 (stage 0, tp rank 0; serve's
    scheduler, generate's seeded generator), as at one stage: the last stage all-gathers their logits over its tp
    group, broadcasts them ``[m, V]`` over the pipeline group, rank 0 draws each row with ``samplers[i]`` in row
    order and broadcasts the tokens over ``world`` (every rank). Collectives: on the last stage an all-gather
    ``[n, 2]`` (tp); one broadcast ``[n]`` (pp); with sampled rows an all-gather ``[m, V_r] -> [m, V]`` (tp), a
    broadcast ``[m, V]`` (pp) and a broadcast ``[n]`` (world).
    """
    from tensorpar.pipeline.inference import tokens_from_last

    dev = device if device.type == "cuda" else torch.device("cpu")   # NCCL moves device tensors
    last = logits is not None
    greedy = len(sampled) < n
    tokens = (vocab_parallel_argmax(logits, tp, partition=partition).to(dev) if last and greedy
              else torch.zeros(n, dtype=torch.long, device=dev))
    tokens = tokens_from_last(tokens, pp)
    if not sampled:
        return tokens.cpu()
    vocab = partition.n
    full = (comm.all_gather(logits.index_select(0, torch.tensor(sampled, device=logits.device)).contiguous(), tp,
                            -1, partition).to(dev) if last
            else torch.zeros(len(sampled), vocab, dtype=dtype, device=dev))                     # [m, V]
    full = tokens_from_last(full, pp)
    tokens = tokens.cpu()
    if world.rank == 0 and samplers is not None:
        for j, i in enumerate(sampled):
            tokens[i] = int(samplers[i](full[j:j + 1]))
    return comm.broadcast(tokens.to(dev), world, src=0).cpu()


def row_logprobs(logits: torch.Tensor, tokens: torch.Tensor, want: list[int], tp: Group, *, partition,
                 deterministic: bool = False):
    """Per row: the chosen token's log-probability (``want[i] >= 0``) and the top ``want[i]`` ``(id, lp)``
    (``want[i] > 0``), vocab-parallel over ``logits`` ``[n, V_r]`` (the engine's rows; ``tokens`` ``[n]`` the
    chosen ones). Collectives: all-reduces of ``[n]``, an all-gather of ``[n, tp*k]`` (``deterministic``: those of
    ``[1]`` and ``[1, tp*k]`` per row, as a reduction over the vocabulary splits across threads by the row
    count). Returns ``(lps, top)``, ``None`` where not asked."""
    from tensorpar.layers.log_softmax import vocab_parallel_logprobs, vocab_parallel_topk_logprobs

    lps: list[float | None] = [None] * len(want)
    top: list[list[tuple[int, float]] | None] = [None] * len(want)
    rows = [slice(j, j + 1) for j in range(len(want))] if deterministic else [slice(None)]
    tokens = tokens.to(logits.device)
    chosen = torch.cat([vocab_parallel_logprobs(logits[r].float(), tokens[r], tp, partition=partition)
                        for r in rows]).cpu()
    k = max(want)
    if k > 0:
        got = [vocab_parallel_topk_logprobs(logits[r], k, tp, partition=partition) for r in rows]
        tv, ti = torch.cat([v for v, _ in got]).cpu(), torch.cat([i for _, i in got]).cpu()
    for i, w in enumerate(want):
        if w > 0:
            top[i] = [(int(ti[i, j]), float(tv[i, j])) for j in range(w)]
        if w >= 0:   # a chosen token among the top ones gets the very value listed there (the two paths' sums
            #          differ in the last bits; clients compare them)
            lps[i] = next((lp for t, lp in top[i] if t == int(tokens[i])), None) if w > 0 else None
            lps[i] = float(chosen[i]) if lps[i] is None else lps[i]
    return lps, top
