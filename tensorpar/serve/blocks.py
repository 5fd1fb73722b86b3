"""Rank 0's bookkeeping of the KV block pool (:class:`BlockAllocator`): which blocks are free, which requests hold
which, and which full prompt blocks are cached for reuse (prefix caching). The ranks hold only the pool itself
(:class:`~tensorpar.decode.kv_cache.LeanKVCache`) and execute the block tables of the step plan, so every rank
makes the same decision (rank 0's). No collectives, no tensors.

Prefix caching (as vLLM's automatic prefix caching): a full block of prompt tokens is named by a hash of its tokens
and of everything before it (:func:`block_hashes`, a chain: SHA-256 of the previous block's hash and this block's
token ids), so two prompts share a cached block exactly when they share every token up to its end. A block whose
last holder ends keeps its contents and its hash while nobody needs its memory: it is *cached* (reference count 0),
reused by the next request with that prefix, and evicted least-recently-used when a request needs a block and
none is free.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict


def block_hashes(tokens: list[int], block_size: int) -> list[bytes]:
    """The chain hash of each full ``block_size`` block of ``tokens`` (a trailing partial block has none)."""
    out, prev = [], b""
    for i in range(len(tokens) // block_size):
        h = hashlib.sha256(prev)
        h.update(b"".join(int(t).to_bytes(8, "little", signed=True)
                          for t in tokens[i * block_size:(i + 1) * block_size]))
        prev = h.digest()
        out.append(prev)
    return out


class BlockAllocator:
    """Free list, reference counts and the prefix cache of ``num_blocks`` blocks of ``block_size`` positions.

    A block is *free* (no contents), *held* (reference count > 0: by the requests whose block tables name it) or
    *cached* (reference count 0 but named by a prompt-prefix hash; reusable until evicted). :meth:`available`
    counts free + cached blocks (what :meth:`allocate` can hand out).

    Args:
        num_blocks, block_size: the pool.
        caching: keep full prompt blocks for reuse (prefix caching); off: a released block is free at once.
    """

    def __init__(self, num_blocks: int, block_size: int, *, caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a block pool needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size, self.caching = num_blocks, block_size, caching
        self.free: list[int] = list(range(num_blocks))       # popped from the end: block 0 first
        self.free.reverse()
        self.refs = [0] * num_blocks
        self.by_hash: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()     # cached blocks (reference count 0), oldest first
        self.queries = self.hits = 0                         # prompt tokens looked up / found (hit rate)

    def available(self) -> int:
        """Blocks :meth:`allocate` can hand out: free ones and cached ones it would evict."""
        return len(self.free) + len(self.lru)

    def used(self) -> int:
        """Blocks held by requests (reference count > 0)."""
        return self.num_blocks - self.available()

    def allocate(self, n: int) -> list[int] | None:
        """``n`` blocks with reference count 1 (free ones first, then the least recently used cached ones,
        forgetting their hash), or ``None`` (nothing taken) when fewer than ``n`` are available."""
        if n > self.available():
            return None
        out = []
        for _ in range(n):
            if self.free:
                b = self.free.pop()
            else:
                b, _ = self.lru.popitem(last=False)
                del self.by_hash[self.hash_of.pop(b)]
            self.refs[b] = 1
            out.append(b)
        return out

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each of ``blocks``; a block at zero becomes cached (if it has a hash and
        caching is on; most recently used last) or free."""
        for b in reversed(blocks):          # the prefix's last blocks are evicted before its first ones
            if self.refs[b] < 1:
                raise ValueError(f"block {b} released more often than it was taken")
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if b in self.hash_of:
                    self.lru[b] = None              # most recently used: the end of the eviction order
                else:
                    self.free.append(b)

    def match(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of ``hashes`` (each taken: reference count + 1)."""
        out = []
        if self.caching:
            for h in hashes:
                b = self.by_hash.get(h)
                if b is None:
                    break
                if self.refs[b] == 0:
                    del self.lru[b]
                self.refs[b] += 1
                out.append(b)
        return out

    def register(self, block: int, h: bytes) -> None:
        """Name held block ``block`` by prefix hash ``h`` (its contents are complete); a hash already naming
        another block keeps that one."""
        if self.caching and h not in self.by_hash and block not in self.hash_of:
            self.by_hash[h] = block
            self.hash_of[block] = h
