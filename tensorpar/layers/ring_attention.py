"""Causal self-attention over a sequence split across context-parallel (cp) ranks: ring or Ulysses all-to-all.

Layout (load-balanced, as torch's head-tail balancer and Megatron's context parallelism): the sequence of ``s``
positions is cut into ``2 cp`` chunks of ``c = s / (2 cp)``; cp rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``
(one early, one late), so under a causal mask every rank computes the same number of (query chunk, key chunk)
pairs. :func:`cp_positions` gives the global positions a rank holds, :func:`cp_shard` cuts a ``[b, s, ...]`` tensor.

Ring (Liu et al. 2023, "Ring Attention"): every rank keeps its queries; the key/value blocks travel around the cp
group (``cp - 1`` hops in forward and again in backward, each block's gradient one hop behind it; every hop in
flight while a block is computed). Each (query chunk ``i``, key chunk ``j``) pair is skipped when ``i < j`` (all
masked), causal when ``i == j``, full when ``i > j``; partial outputs are merged with their log-sum-exp in fp32,
so the result is softmax attention up to fp32 reordering. Backward recomputes the scores from the saved
log-sum-exp (as FlashAttention does); the key/value gradients arrive back at the block's owner after ``cp`` hops.

Ulysses (Jacobs et al. 2023): an all-to-all turns ``[b, heads, s/cp, d]`` into ``[b, heads/cp, s, d]``, the whole
sequence of a slice of the heads; SDPA runs causally on it (positions put in order first) and a second all-to-all
turns it back. Needs the local query heads (and KV heads, else they are repeated to the query heads first) to
divide by cp.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tensorpar.comm import Group


def check_cp_seq_len(seq_len: int, cp: int) -> None:
    """Raise ValueError unless ``seq_len`` splits into ``2 cp`` equal chunks (the load-balanced layout)."""
    if cp > 1 and seq_len % (2 * cp):
        lo = seq_len - seq_len % (2 * cp)
        raise ValueError(f"seq_len={seq_len} is not divisible by 2 x cp = {2 * cp} (each cp rank holds two equal "
                         f"chunks, one early and one late); use seq_len={lo or 2 * cp} or {lo + 2 * cp}")


def check_all2all_heads(local_heads: int, cp: int, tp: int, *, flags: bool = False) -> None:
    """Raise ValueError unless every tp rank's query heads divide by cp (the all2all mode splits them over cp).
    ``flags``: the message names the command-line flags (``--cp-mode all2all``) instead of the config fields."""
    if cp > 1 and local_heads % cp:
        if flags:
            raise ValueError(f"--cp-mode all2all needs the query heads of each tp rank ({local_heads} at --tp {tp}) "
                             f"divisible by --cp {cp}; use --cp-mode ring, or a --cp dividing {local_heads}")
        raise ValueError(f"cp_mode='all2all' needs the query heads of each tp rank ({local_heads} at tp={tp}) "
                         f"divisible by cp={cp}; use cp_mode='ring', or a cp dividing {local_heads}")


def cp_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two global chunk indices (of ``2 cp``) that cp rank ``rank`` holds: ``(rank, 2 cp - 1 - rank)``."""
    return rank, 2 * cp - 1 - rank


def cp_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """``LongTensor[s / cp]``: the global positions cp rank ``rank`` holds, in its local order."""
    if cp == 1:
        return torch.arange(seq_len, device=device)
    check_cp_seq_len(seq_len, cp)
    c = seq_len // (2 * cp)
    a, b = cp_chunks(cp, rank)
    return torch.cat([torch.arange(a * c, (a + 1) * c, device=device), torch.arange(b * c, (b + 1) * c, device=device)])


def cp_shard(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's positions of ``x`` along ``dim`` (global ``s`` -> ``s / cp``); the identity at cp = 1."""
    if cp == 1:
        return x
    return x.index_select(dim, cp_positions(x.shape[dim], cp, rank, device=x.device))


# ------------------------------------------------------------------ ring

def _peers(group: Group) -> tuple[int, int]:
    """Global ranks of the next and previous cp rank."""
    nxt, prv = (group.rank + 1) % group.size, (group.rank - 1) % group.size
    return dist.get_global_rank(group.pg, nxt), dist.get_global_rank(group.pg, prv)


def _rotate(buf: torch.Tensor, group: Group, tag: int = 0):
    """Start sending ``buf`` to the next cp rank and receiving the previous rank's; returns ``(recv, works)``.
    ``tag`` keeps two streams in flight at once apart (backward: key/value blocks 0, their gradients 1)."""
    nxt, prv = _peers(group)
    recv = torch.empty_like(buf)
    ops = [dist.P2POp(dist.isend, buf, nxt, group.pg, tag=tag), dist.P2POp(dist.irecv, recv, prv, group.pg, tag=tag)]
    group.counter.record("send", buf.numel(), buf.element_size(), group.size)
    return recv, dist.batch_isend_irecv(ops)


def _arrive(pending, group: Group) -> torch.Tensor:
    """Wait for a :func:`_rotate` and return what arrived; the wait counts as exposed ``send`` time."""
    recv, works = pending
    t0 = group.counter.start()
    for w in works:
        w.wait()
    group.counter.blocked("send", t0)
    return recv


def _pairs(cp: int, q_rank: int, kv_rank: int):
    """``(query half, key half, causal)`` for every (query chunk, key chunk) pair that is not fully masked."""
    out = []
    for a, qi in enumerate(cp_chunks(cp, q_rank)):
        for c, kj in enumerate(cp_chunks(cp, kv_rank)):
            if qi >= kj:
                out.append((a, c, qi == kj))
    return out


def _scores(q, k, scale, causal):
    """``q [b, h, c, d] @ k^T`` scaled, upper triangle masked when ``causal``: ``[b, h, c, c]`` fp32."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _block_forward(q, k, v, scale: float, causal: bool, fused: bool | None = None):
    """Attention of one (query chunk, key chunk) block, ``q, k, v [b, h, c, d]`` fp32 contiguous: ``(out [b, h, c,
    d], lse [b, h, c])``. On CPU torch's fused flash kernel (it works in tiles, so its working memory does not grow
    with ``c``); elsewhere (or ``fused=False``) the ``[b, h, c, c]`` scores in full. Every row sees >= 1 key, so
    ``lse`` is finite."""
    if (q.device.type == "cpu") if fused is None else fused:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    s = _scores(q, k, scale, causal)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v), lse


def _block_backward(do, q, k, v, o, lse, scale: float, causal: bool, fused: bool | None = None):
    """``(dq, dk, dv)`` of one block (shapes of ``q, k, v``) from the merged output ``o`` and log-sum-exp ``lse``
    of the whole rows (FlashAttention's backward: ``P = exp(S - lse)``, ``dS = P (dO V^T - rowsum(dO o))``), so the
    blocks' gradients add up to the full attention's. CPU: torch's flash backward kernel; elsewhere (or
    ``fused=False``) in full."""
    if (q.device.type == "cpu") if fused is None else fused:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(do, q, k, v, o, lse, 0.0, causal,
                                                                                    scale=scale)
    p = torch.exp(_scores(q, k, scale, causal) - lse.unsqueeze(-1))                  # [b, h, c, c]
    ds = p * (torch.matmul(do, v.transpose(-1, -2)) - (do * o).sum(-1, keepdim=True))
    return (torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale,
            torch.matmul(p.transpose(-1, -2), do))


def _halves(x: torch.Tensor, g: int = 1):
    """The two chunks of ``x [b, n, s_l, ...]`` along the sequence (dim 2), fp32, contiguous; heads repeated ``g``
    times (a KV block read by ``g`` query heads each)."""
    x = x.float()
    if g > 1:
        x = x.repeat_interleave(g, dim=1)
    return [t.contiguous() for t in x.chunk(2, dim=2)]


class _RingAttention(torch.autograd.Function):
    """Forward: ring attention, ``cp - 1`` hops of the stacked key/value block ``[2, b, kv, s_l, d]``, the next
    block in flight while one is computed. Backward: the key/value blocks go round again (``cp - 1`` hops, next
    one in flight) and each block's partial ``[dk, dv]`` follows it one step behind (``cp`` hops, the last one
    home to the block's owner), sent while the next block is computed; dq stays local."""

    @staticmethod
    def forward(ctx, q, k, v, group: Group, scale: float):
        with torch.autocast(q.device.type, enabled=False):   # fp32 whatever the caller's autocast
            return _RingAttention._forward(ctx, q, k, v, group, scale)

    @staticmethod
    def _forward(ctx, q, k, v, group, scale):
        cp, r = group.size, group.rank
        g = q.shape[1] // k.shape[1]
        halves = _halves(q)                                               # 2 x [b, h, c, d]
        out, lse = [None, None], [None, None]
        buf = torch.stack([k, v]).float().contiguous()                  # [2, b, kv, s_l, d]
        for step in range(cp):
            pending = _rotate(buf, group) if step < cp - 1 else None
            kh, vh = _halves(buf[0], g), _halves(buf[1], g)               # [b, h, c, d] per key half
            for a, c, causal in _pairs(cp, r, (r - step) % cp):
                blk, blk_lse = _block_forward(halves[a], kh[c], vh[c], scale, causal)
                if out[a] is None:
                    out[a], lse[a] = blk, blk_lse
                    continue
                new = torch.logaddexp(lse[a], blk_lse)
                out[a] = out[a] * torch.exp(lse[a] - new).unsqueeze(-1) + blk * torch.exp(blk_lse - new).unsqueeze(-1)
                lse[a] = new
            if pending is not None:
                buf = _arrive(pending, group)
        o = torch.cat(out, dim=2)
        ctx.save_for_backward(q, k, v, o, torch.cat(lse, dim=2))
        ctx.group, ctx.scale = group, scale
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        with torch.autocast(dout.device.type, enabled=False):
            return _RingAttention._backward(ctx, dout)

    @staticmethod
    def _backward(ctx, dout):
        q, k, v, o, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        cp, r = group.size, group.rank
        g = q.shape[1] // k.shape[1]
        b, kvh, s_l, d = k.shape
        qh, doh, oh = _halves(q), _halves(dout), _halves(o)
        lh = [t.contiguous() for t in lse.chunk(2, dim=2)]
        dq = [torch.zeros_like(qh[0]) for _ in range(2)]
        kv = torch.stack([k, v]).float().contiguous()                    # [2, b, kv, s_l, d]
        dkv_pending = None   # the partial [dk, dv] of the block held now, on its way from the previous rank
        for step in range(cp):
            kv_pending = _rotate(kv, group) if step < cp - 1 else None   # next block in flight during this one
            kh, vh = _halves(kv[0], g), _halves(kv[1], g)
            dk = [torch.zeros_like(kh[0]) for _ in range(2)]               # [b, h, c, d], summed per group below
            dv = [torch.zeros_like(kh[0]) for _ in range(2)]
            for a, c, causal in _pairs(cp, r, (r - step) % cp):
                gq, gk, gv = _block_backward(doh[a], qh[a], kh[c], vh[c], oh[a], lh[a], scale, causal)
                dq[a] += gq
                dk[c] += gk
                dv[c] += gv
            dkv = torch.stack([torch.cat(dk, dim=2), torch.cat(dv, dim=2)]).view(2, b, kvh, g, s_l, d).sum(3)
            if dkv_pending is not None:     # the earlier ranks' share of this block's gradient
                dkv += _arrive(dkv_pending, group)
            dkv_pending = _rotate(dkv, group, tag=1)              # on to the block's next holder (or owner)
            if kv_pending is not None:
                kv = _arrive(kv_pending, group)
        buf = _arrive(dkv_pending, group)                                # my own block's [dk, dv], home
        dq_full = torch.cat(dq, dim=2).to(q.dtype)
        return dq_full, buf[0].to(k.dtype), buf[1].to(v.dtype), None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group, *,
                   scale: float | None = None) -> torch.Tensor:
    """Causal attention of this cp rank's queries against the whole sequence's keys (ring over ``group``).

    Shapes (per rank, load-balanced layout of :func:`cp_positions`): ``q [b, h, s/cp, d]``,
    ``k, v [b, kv, s/cp, d]`` with ``h`` a multiple of ``kv`` (query head ``i`` reads KV head ``i // (h / kv)``);
    returns ``[b, h, s/cp, d]`` in ``q``'s dtype (computed in fp32). At cp = 1 (or a group without process group)
    it is SDPA, causal.

    Collectives: forward ``cp - 1`` send/recv hops of ``[2, b, kv, s/cp, d]`` fp32; backward ``cp - 1`` hops of
    the key/value blocks and ``cp`` of their gradients (``[2, b, kv, s/cp, d]`` each), every hop in flight while
    a block is computed. Waits count as exposed ``send`` seconds in the group's counter.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if group.size == 1:
        return _sdpa_causal(q, k, v, scale)
    return _RingAttention.apply(q, k, v, group, scale)


def _sdpa_causal(q, k, v, scale):
    """Causal SDPA; grouped KV heads broadcast by the kernel (``enable_gqa``), so they are kept compact for
    backward rather than repeated to the query heads."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


# ------------------------------------------------------------------ Ulysses all-to-all

class _AllToAll(torch.autograd.Function):
    """``[b, h, s_l, d]`` (sequence-sharded) <-> ``[b, h/cp, cp*s_l, d]`` (head-sharded); backward the inverse."""

    @staticmethod
    def forward(ctx, x, group: Group, to_heads: bool):
        ctx.group, ctx.to_heads = group, to_heads
        return _all_to_all(x, group, to_heads)

    @staticmethod
    def backward(ctx, g):
        return _all_to_all(g, ctx.group, not ctx.to_heads), None, None


def _exchange(send: torch.Tensor, group: Group) -> torch.Tensor:
    """``all_to_all_single`` of ``send`` (dim 0 indexed by the destination rank), counted and timed."""
    recv = torch.empty_like(send)
    group.counter.record("all_to_all", send.numel(), send.element_size(), group.size)
    t0 = group.counter.start()
    dist.all_to_all_single(recv, send, group=group.pg)
    group.counter.blocked("all_to_all", t0)
    return recv


def _all_to_all(x: torch.Tensor, group: Group, to_heads: bool) -> torch.Tensor:
    cp = group.size
    b, h, s, d = x.shape
    if to_heads:   # send head slice j to rank j; receive every rank's sequence part of my head slice
        send = x.reshape(b, cp, h // cp, s, d).permute(1, 0, 2, 3, 4).contiguous()
        recv = _exchange(send, group)
        return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)        # [b, h/cp, cp*s_l, d]
    sl = s // cp   # inverse: send sequence part j to rank j; receive my sequence part of every head slice
    send = x.reshape(b, h, cp, sl, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = _exchange(send, group)
    return recv.permute(1, 0, 2, 3, 4).reshape(b, cp * h, sl, d)               # [b, h*cp, s_l, d]


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group, *,
                      scale: float | None = None) -> torch.Tensor:
    """Causal attention by all-to-all over ``group`` (the cp ranks): same shapes and result as
    :func:`ring_attention`. The local query heads must divide by cp (:func:`check_all2all_heads`); KV heads that do
    not are repeated to one per query head first.

    Collectives: forward three all-to-alls (q, k, v) into the head split and one back; backward the inverse four.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    cp = group.size
    if cp == 1:
        return _sdpa_causal(q, k, v, scale)
    if q.shape[1] % cp:
        raise ValueError(f"ulysses_attention: {q.shape[1]} local query heads are not divisible by cp={cp}")
    if k.shape[1] % cp:
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = q.shape[2] * cp
    order = torch.cat([cp_positions(s, cp, r, device=q.device) for r in range(cp)])  # position of each row
    natural = torch.argsort(order)
    qs, ks, vs = (_AllToAll.apply(t, group, True).index_select(2, natural) for t in (q, k, v))
    out = _sdpa_causal(qs, ks, vs, scale)                                             # [b, h/cp, s, d]
    return _AllToAll.apply(out.index_select(2, order).contiguous(), group, False)


def cp_attention(q, k, v, group: Group, mode: str = "ring", *, scale: float | None = None) -> torch.Tensor:
    """:func:`ring_attention` (``mode="ring"``) or :func:`ulysses_attention` (``"all2all"``)."""
    if mode == "ring":
        return ring_attention(q, k, v, group, scale=scale)
    if mode == "all2all":
        return ulysses_attention(q, k, v, group, scale=scale)
    raise ValueError(f"cp_mode={mode!r}: use 'ring' or 'all2all'")
