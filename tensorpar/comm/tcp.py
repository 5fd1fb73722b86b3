"""Small collectives between hosts over plain TCP sockets, exchanged in the calling thread.

Why: gloo hands every message to its transport's own I/O thread and wakes the caller when it is done. On the
namespace-host testbed (two cores) a 2.3 KB all-reduce between two hosts costs 0.5-2.3 ms through gloo, against
27-53 us for a TCP ping-pong done by the calling thread itself (bench/results/link_probe.md). Decode across hosts
runs two all-reduces of ``[rows, hidden]`` per layer, so that difference is most of a token's time.

:class:`TcpMesh` is the ``fast`` communicator of a group whose ranks are on different hosts (the leaders' group of
:class:`tensorpar.shm.HierarchicalComm`): one TCP connection per pair of ranks (``TCP_NODELAY``), made once.

* **all-reduce** (sum or max) of at most :attr:`TcpMesh.max_bytes` bytes: every rank sends its whole tensor to
  every other rank and receives theirs (one hop), then adds the ``t`` copies in rank order,
  ``((x0 + x1) + x2) ...``, so every rank gets the same bits. Bytes each rank sends: ``(t - 1) B``; the ring's
  ``2 (t - 1) / t * B`` is the same at ``t = 2`` (a host pair, the common case) and less above it, but for
  messages this small the round trips cost, not the bytes (Thakur, Rabenseifner & Gropp 2005, sec. 4: latency
  term ``(t - 1) a`` of the ring vs ``a`` of one exchange when the network takes the sends in parallel).
* **all-gather** of equal shards of at most ``max_bytes`` each: the same exchange, concatenated in rank order.
* everything larger, reduce-scatter and broadcast: the group's torch.distributed process group, unchanged.

The size limit is agreed at build time by all ranks (the smallest of theirs), so every rank takes the same path
for a given tensor. It keeps a message within the sockets' kernel buffers, so two ranks sending to each other at
once never both block: ``(SO_SNDBUF + SO_RCVBUF) / 4`` (the kernel reports twice the usable bytes), at most
256 KiB.

Wire format per message: an 8-byte header (the collective's kind and the payload's bytes, little-endian uint32
each), then the payload. A header that differs from this rank's (ranks calling different collectives or sizes)
raises :class:`~tensorpar.comm.CollectiveError` and leaves the mesh unusable (its streams are out of step).

Failures: a peer that sends nothing within ``timeout_s`` (the collective timeout) or whose connection ends (its
process died, its link went down) raises :class:`~tensorpar.comm.CollectiveError` naming the collective, the
peer's rank and its host; its ``reason`` attribute holds the part after the group, for
:class:`tensorpar.shm.HierarchicalComm` to name the group the caller used.
"""
from __future__ import annotations

import os
import secrets
import socket
import struct

import torch

from tensorpar.comm.group import CollectiveError, Group

#: upper bound of :attr:`TcpMesh.max_bytes` (bytes)
MAX_BYTES = 256 * 1024
_HDR = struct.Struct("<II")
_HELLO = struct.Struct("<I16s")
_KINDS = {"all_reduce": 1, "all_gather": 2}
_SIOCGIFADDR = 0x8915


def local_address() -> str:
    """The IPv4 address this rank's peers reach it at: that of ``GLOO_SOCKET_IFNAME`` when it names one interface
    (where gloo binds too), else what this host's name resolves to (gloo's own default). Raises OSError."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if ifname and "," not in ifname:
        import fcntl
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname[:15].encode()))
        return socket.inet_ntoa(packed[20:24])
    return socket.gethostbyname(socket.gethostname())


class TcpMesh:
    """One TCP connection per pair of a group's ranks, for the group's small all-reduces and all-gathers.

    Build it with :meth:`build` (collective over ``group.pg``). Attributes: ``group`` (the
    :class:`~tensorpar.comm.Group` it serves, whose process group takes what the mesh does not), ``max_bytes`` (the
    largest message it carries, agreed by all ranks), ``hosts`` (each rank's hostname, for messages).
    """

    def __init__(self, group: Group, socks: dict[int, socket.socket], max_bytes: int, hosts: list[str]):
        self.group, self.max_bytes, self.hosts = group, max_bytes, hosts
        self._socks = [(r, socks[r]) for r in sorted(socks)]
        # one buffer per rank (this rank's holds what it sends), reused by every call: the 8-byte header right
        # before a 64-byte aligned payload, so that a message goes out and comes in as one piece
        raw = [torch.empty(max_bytes + 128, dtype=torch.uint8) for _ in range(group.size)]
        self._msgs = [b[(-b.data_ptr()) % 64 + 64 - _HDR.size:][:_HDR.size + max_bytes] for b in raw]
        self._bufs = [m[_HDR.size:] for m in self._msgs]
        self._views = [memoryview(m.numpy()) for m in self._msgs]
        self._addrs = tuple(b.data_ptr() for b in self._bufs)
        self._parts: dict = {}        # (bytes, dtype, shape) -> every rank's payload as such a tensor
        self._broken: str | None = None
        self._big: torch.Tensor | None = None

    # -- building -------------------------------------------------------------------------------------------------
    @classmethod
    def build(cls, group: Group, timeout_s: float) -> tuple["TcpMesh | None", str]:
        """Connect every pair of ``group``'s ranks. Collective over ``group.pg`` (three small all-gathers).

        Each rank listens on :func:`local_address` (an ephemeral port); the addresses are all-gathered; each rank
        connects to every lower rank and accepts every higher one, each connection opened with a 16-byte key the
        accepting rank published (a stray connection is dropped). Returns ``(mesh, "")``, or ``(None, reason)`` on
        every rank when any rank failed (no address, a port not reachable within ``timeout_s``): the group then
        keeps torch.distributed for everything.
        """
        from tensorpar.comm import all_gather_json

        lsock, me = None, {}
        try:
            addr = local_address()
            lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            _tune(lsock)
            lsock.bind((addr, 0))
            lsock.listen(max(1, group.size))
            me = {"addr": addr, "port": lsock.getsockname()[1], "key": secrets.token_hex(16),
                  "host": socket.gethostname()}
        except OSError as e:
            me = {"error": f"rank {group.rank}: no listening socket ({e})"}
        peers = all_gather_json(me, group.pg)
        errors = [p["error"] for p in peers if "error" in p]
        socks: dict[int, socket.socket] = {}
        err = ""
        if not errors:
            try:
                socks = _connect(group.rank, peers, lsock, timeout_s)
                limit = min(MAX_BYTES, *[_limit(s) for s in socks.values()])
            except OSError as e:
                err = f"rank {group.rank} on host {me['host']}: {e}"
        if lsock is not None:
            lsock.close()
        outcome = all_gather_json({"error": err or (errors[0] if errors else ""),
                                   "limit": 0 if err or errors else limit}, group.pg)
        bad = [o["error"] for o in outcome if o["error"]]
        if bad:
            for s in socks.values():
                s.close()
            return None, bad[0]
        for s in socks.values():
            s.settimeout(timeout_s)
        limit = min(o["limit"] for o in outcome) // 64 * 64
        return cls(group, socks, limit, [p["host"] for p in peers]), ""

    # -- collectives ----------------------------------------------------------------------------------------------
    def fits(self, x: torch.Tensor) -> bool:
        """Whether the mesh carries ``x`` (a CPU tensor of at most ``max_bytes``), the same answer on every rank
        for the same shape and dtype."""
        return x.is_cpu and x.numel() * x.element_size() <= self.max_bytes

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Sum (or max) of ``x`` over the group: a new tensor of ``x``'s shape and dtype, the same bits on every
        rank (rank-order sum). Collectives: one exchange on the mesh (``x`` at most ``max_bytes``), else the process
        group's all-reduce. Raises CollectiveError (a peer failed or timed out, or called another collective)."""
        from tensorpar import comm
        if not self.fits(x):
            return comm._pg_all_reduce(x, self.group, op)
        parts = self._exchange(x, "all_reduce")
        out = torch.add(parts[0], parts[1]) if op == "sum" else torch.maximum(parts[0], parts[1])
        for p in parts[2:]:
            if op == "sum":
                out.add_(p)
            else:
                torch.maximum(out, p, out=out)
        return out

    def all_reduce_parts(self, x: torch.Tensor) -> tuple[int, ...]:
        """The exchange of a sum :meth:`all_reduce` without the sum (as
        :meth:`tensorpar.shm.ShmCommunicator.all_reduce_parts`): the addresses of every rank's copy of ``x``, in
        rank order, valid until the next collective on this mesh. The caller adds them in rank order. A tensor too
        large for the mesh is all-reduced by the process group into a kept buffer whose address is returned alone."""
        if not self.fits(x):
            from tensorpar import comm
            y = comm._pg_all_reduce(x, self.group, "sum")
            if self._big is None or self._big.numel() < y.numel() or self._big.dtype != y.dtype:
                self._big = torch.empty_like(y.reshape(-1))
            self._big[:y.numel()].copy_(y.reshape(-1))
            return (self._big.data_ptr(),)
        self._exchange(x.contiguous(), "all_reduce")
        return self._addrs

    def all_gather(self, x: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
        """Concatenation along ``dim`` of every rank's ``x`` in rank order. Shapes: ``x`` ``[..., sizes[rank],
        ...]`` -> ``[..., sum(sizes), ...]``. The mesh carries equal shards of at most ``max_bytes``; other cases go
        through the process group."""
        from tensorpar import comm
        if not self.fits(x) or len(set(sizes)) != 1:
            return comm._pg_all_gather(x, self.group, dim, sizes)
        parts = self._exchange(x.contiguous(), "all_gather")
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
        from tensorpar import comm
        return comm._pg_reduce_scatter(x, self.group, dim, sizes)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        from tensorpar import comm
        return comm._pg_broadcast(x, self.group, src)

    def close(self) -> None:
        """Close the connections (local; the peers see their end close). Idempotent."""
        for _, s in self._socks:
            s.close()
        self._socks = []
        self._broken = self._broken or "closed"

    def __repr__(self) -> str:
        return f"TcpMesh({self.group.name}, rank={self.group.rank}, size={self.group.size}, max_bytes={self.max_bytes})"

    # -- the exchange ---------------------------------------------------------------------------------------------
    def _exchange(self, x: torch.Tensor, kind: str) -> list[torch.Tensor]:
        """Send ``x``'s bytes to every peer, receive theirs; every rank's copy as a tensor like ``x``, rank order
        (this rank's is ``x``'s copy in its own buffer)."""
        if self._broken is not None:
            raise CollectiveError(f"{kind} on {self.group.name} group over TCP: the connections are unusable "
                                  f"({self._broken})")
        me = self.group.rank
        n = x.numel() * x.element_size()
        self._bufs[me][:n].copy_(x.reshape(-1).view(torch.uint8))
        mine = self._views[me]
        _HDR.pack_into(mine, 0, _KINDS[kind], n)
        m = _HDR.size + n
        peer = -1
        try:
            for peer, s in self._socks:
                s.sendall(mine[:m])
            for peer, s in self._socks:
                got, k = self._views[peer], 0
                while k < m:                   # the header is checked as soon as it is in
                    r = s.recv_into(got[k:m], m - k)
                    if r == 0:
                        raise _Closed()
                    if k < _HDR.size <= k + r and got[:_HDR.size] != mine[:_HDR.size]:
                        kd, theirs_n = _HDR.unpack_from(got)
                        theirs = {v: n_ for n_, v in _KINDS.items()}.get(kd, f"kind {kd}")
                        raise _Mismatch(f"rank {peer} called {theirs} of {theirs_n} bytes, this rank {kind} of "
                                        f"{n} bytes")
                    k += r
        except _Mismatch as e:
            self._fail(kind, x, peer, str(e), e)
        except TimeoutError as e:
            self._fail(kind, x, peer, "nothing arrived within the collective timeout", e)
        except (OSError, _Closed) as e:
            self._fail(kind, x, peer, f"the connection ended ({e or 'closed by the peer'}): its process or its "
                                      f"link is gone", e)
        key = (n, x.dtype, x.shape)
        parts = self._parts.get(key)
        if parts is None:
            if len(self._parts) > 64:
                self._parts.clear()
            parts = self._parts[key] = [b[:n].view(x.dtype).view(x.shape) for b in self._bufs]
        return parts


    def _fail(self, kind: str, x: torch.Tensor, peer: int, why: str, e: BaseException):
        self._broken = why
        me = self.group.rank
        there = self.hosts[peer] if peer >= 0 else "?"
        err = CollectiveError(
            f"{kind} on {self.group.name} group over TCP (rank {me} of {self.group.size} on host {self.hosts[me]}, "
            f"tensor {tuple(x.shape)} {x.dtype}) failed waiting for rank {peer} on host {there}: {why}")
        err.reason = f"waiting for host {there} over TCP: {why}"       # for a caller that names its own group
        raise err from e


class _Mismatch(Exception):
    pass


class _Closed(Exception):
    pass


def _recv_exact(s: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = s.recv_into(view[got:], n - got)
        if k == 0:
            raise _Closed()
        got += k


def _tune(s: socket.socket) -> None:
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            s.setsockopt(socket.SOL_SOCKET, opt, 1 << 20)     # the kernel caps it at [wr]mem_max
        except OSError:
            pass


def _limit(s: socket.socket) -> int:
    return (s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) + s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)) // 4


def _connect(rank: int, peers: list[dict], lsock: socket.socket, timeout_s: float) -> dict[int, socket.socket]:
    """Connect to every lower rank, accept every higher one (a connection's queued in the listener's backlog until
    accepted, so the order cannot deadlock). Raises OSError (also a timeout)."""
    socks: dict[int, socket.socket] = {}
    try:
        for r in range(rank):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks[r] = s
            _tune(s)
            s.settimeout(timeout_s)
            s.connect((peers[r]["addr"], peers[r]["port"]))
            s.sendall(_HELLO.pack(rank, bytes.fromhex(peers[r]["key"])))
        lsock.settimeout(timeout_s)
        key = bytes.fromhex(peers[rank]["key"])
        while len(socks) < len(peers) - 1:
            c, _ = lsock.accept()
            c.settimeout(timeout_s)
            try:
                hello = bytearray(_HELLO.size)
                _recv_exact(c, memoryview(hello))
                r, k = _HELLO.unpack(hello)
            except (OSError, _Closed):
                c.close()
                continue
            if k != key or not rank < r < len(peers) or r in socks:
                c.close()                                  # not one of ours
                continue
            _tune(c)
            socks[r] = c
    except BaseException:
        for s in socks.values():
            s.close()
        raise
    return socks
