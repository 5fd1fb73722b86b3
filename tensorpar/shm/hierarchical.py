"""Two-level all-reduce for a group that spans hosts: shared memory inside a host, leaders across.

For a group of ``N`` ranks on ``h`` hosts with ``k = N / h`` ranks each, one all-reduce of a
tensor of ``B`` bytes runs as

1. reduce to the host's leader (its lowest rank) through the host's shared segment (rank order);
2. all-reduce among the ``h`` leaders: over their TCP mesh (:class:`tensorpar.comm.tcp.TcpMesh`, one exchange
   in the calling thread, rank-order sum) up to its ``max_bytes``, else over their own torch.distributed group
   (gloo ring);
3. broadcast from the leader through the segment.

Only step 2 crosses hosts. Each leader sends ``2 (h - 1) / h * B`` (ring) or ``(h - 1) B`` (mesh; the same for
two hosts), so with two hosts the whole group puts ``2 (h - 1) B`` on the network instead of the flat ring's
``2 (N - 1) B``; the tensor
bytes handed to inter-host collectives (the counter's ``bytes``) fall from ``N B`` to ``h B``,
i.e. to ``1 / k``. The leaders' :class:`~tensorpar.comm.Group` has its own
:class:`~tensorpar.comm.CommCounter`, so ``with comm.counting(h.leaders):`` measures exactly
what crossed hosts. Every rank gets the leader's bits, so results are identical on all ranks;
they differ from the flat all-reduce only in summation order (within the harness's ``close``
tolerance).

All-gather, reduce-scatter and broadcast on such a group keep the flat torch.distributed path, except where every
host has one rank (the leaders are the group): then all-gathers of small equal shards take the mesh too (the
compressed all-reduce of ``--tp-comm int8`` is one), and :meth:`HierarchicalComm.all_reduce_parts` gives the row
step of decode the ranks' partial sums as they arrived (:func:`tensorpar.decode.fused.all_reduce_exchange`).

Bad input: ranks of one host that disagree on dtype or size get the shared-memory
``ValueError``; hosts that disagree with each other reach the leaders' gloo all-reduce, which
does not check (an extra cross-host round trip per call would be the price of checking).
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import secrets
import warnings

import torch
import torch.distributed as dist

from tensorpar import comm
from tensorpar.comm import CommCounter, Group, all_gather_json
from tensorpar.comm.group import failed
from tensorpar.comm.tcp import TcpMesh
from tensorpar.shm.bootstrap import Member, build_host_communicator, hosts_of
from tensorpar.shm.collectives import ShmCommunicator
from tensorpar.shm.sync import WaitPolicy


class HierarchicalComm:
    """The ``fast`` object of a multi-host group: hierarchical all-reduce, flat everything else.

    Build it with :func:`make_hierarchical` (or ``enable_fast_collectives(group, "hierarchical")``).

    Attributes:
        group: the flat group it serves.
        hosts: group ranks per host, e.g. ``[[0, 1], [2, 3]]``.
        intra: this host's :class:`ShmCommunicator`, or None if this rank is alone on its host.
        leaders: the leaders' group (own counter) on leader ranks, None on the others.
    """

    def __init__(self, group: Group, hosts: list[list[int]], intra: ShmCommunicator | None, leaders: Group | None):
        self.group, self.hosts, self.intra, self.leaders = group, hosts, intra, leaders
        # one rank per host: the leaders are the group, in the same order
        self._one_per_host = all(len(h) == 1 for h in hosts)
        if self._one_per_host and leaders is not None and isinstance(leaders.fast, TcpMesh):
            self.all_reduce_parts = self._leaders_parts      # decode reads the partials

    @property
    def is_leader(self) -> bool:
        return self.leaders is not None

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce in the host, all-reduce among leaders, broadcast in the host. Same shape, new tensor."""
        if op not in ("sum", "max"):
            raise ValueError(f"all_reduce on {self.group.name} group: op must be 'sum' or 'max', got {op!r}")
        with self._named("all_reduce", x, inside=True):
            y = x if self.intra is None else self.intra.reduce(x, dst=0, op=op)
        if self.leaders is not None:
            with self._named("all_reduce", x):
                y = comm.all_reduce(y, self.leaders, op=op)        # identity for a one-host group
        if self.intra is None:
            return y if y is not x else x.clone()
        with self._named("all_reduce", x, inside=True):
            return self.intra.broadcast(y if self.is_leader else x, src=0)

    def _leaders_parts(self, x: torch.Tensor) -> tuple[int, ...]:
        """The leaders' mesh's :meth:`~tensorpar.comm.tcp.TcpMesh.all_reduce_parts` of ``x`` (set as
        ``all_reduce_parts`` only when every host has one rank), counted on the leaders' group."""
        lead = self.leaders
        lead.counter.record("all_reduce", x.numel(), x.element_size(), lead.size)
        t0 = lead.counter.start()
        with self._named("all_reduce", x):
            parts = lead.fast.all_reduce_parts(x)
        lead.counter.blocked("all_reduce", t0)
        return parts

    def all_gather(self, x: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
        mesh = self.leaders.fast if self._one_per_host and self.leaders is not None else None
        if mesh is not None and mesh.fits(x) and len(set(sizes)) == 1:
            with self._named("all_gather", x):
                return comm.all_gather(x, self.leaders, dim, sizes)
        return comm._pg_all_gather(x, self.group, dim, sizes)

    @contextlib.contextmanager
    def _named(self, kind: str, x: torch.Tensor, inside: bool = False):
        """A failure between the leaders, named as a collective of the group the caller used (its hosts and the
        host it waited for) rather than of the leaders' internal group. ``inside``: a failure of this host's
        shared-memory step (a rank that is not its host's leader waits there while its leader waits for the
        other hosts, and learns of a lost host only when its leader stops), named the same way, "inside host H:"
        before the shared-memory error."""
        try:
            yield
        except comm.CollectiveError as e:
            why = getattr(e, "reason", None) or str(e)
            if inside and self.group.hosts is not None:
                why = f"inside host {self.group.hosts[self.group.rank]}: {why}"
            raise failed(kind, self.group, x, why) from e

    def reduce_scatter(self, x: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
        return comm._pg_reduce_scatter(x, self.group, dim, sizes)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        return comm._pg_broadcast(x, self.group, src)

    def close(self) -> None:
        """Unmap the host segment, close the leaders' TCP mesh and destroy their process group. Idempotent."""
        if self.intra is not None:
            self.intra.close()
            self.intra = None
        if self.leaders is not None and self.leaders.fast is not None:
            self.leaders.fast.close()
            self.leaders.fast = None
        self.leaders = None        # the leaders' gloo group is not registered with torch: it goes with its last reference

    def __repr__(self) -> str:
        return f"HierarchicalComm({self.group.name}, hosts={self.hosts}, leader={self.is_leader})"


def make_hierarchical(group: Group, members: list[Member], *, slot_bytes: int, timeout_s: float,
                      policy: WaitPolicy | None = None, oneshot_bytes: int = 256 * 1024) -> HierarchicalComm:
    """Build the host segments and the leaders' group for ``group``. Collective over ``group``'s ranks.

    Args:
        group: a group whose ranks may span hosts.
        members: every rank's host and process identity, from
            :func:`tensorpar.shm.bootstrap.exchange_members` (host ids may be simulated).
        slot_bytes, timeout_s, policy, oneshot_bytes: as for the shared-memory communicator.

    Only the leaders take part in creating the leaders' group (a gloo group under a store prefix that the first
    rank of ``group`` draws at random and every rank learns, see :func:`_leaders_pg`); the leaders then connect
    their TCP mesh (:meth:`tensorpar.comm.tcp.TcpMesh.build`). Where it cannot connect (an address the peers
    cannot reach, a firewall), every leader warns once with the reason and keeps gloo for everything.

    Raises:
        CollectiveError: a host's ranks could not share a segment.
    """
    hosts = hosts_of(members)
    intra, err = build_host_communicator(group.pg, members, group_name=f"{group.name}.host", slot_bytes=slot_bytes,
                                         timeout_s=timeout_s, policy=policy, oneshot_bytes=oneshot_bytes)
    if err:
        raise comm.CollectiveError(f"hierarchical all-reduce on {group.name} group: {err}")
    leader_ranks = [h[0] for h in hosts]
    # the leaders' process group lives under a store prefix no earlier group used (see _leaders_pg): every rank
    # draws one, all take the first in the process group's order (whatever the Group's own rank order)
    token = all_gather_json(secrets.token_hex(8), group.pg)[0]
    leaders = None
    if group.rank in leader_ranks:
        pg = (_leaders_pg(f"tensorpar/{group.name}.leaders/{token}/", leader_ranks.index(group.rank),
                          len(leader_ranks), timeout_s) if len(leader_ranks) > 1 else None)
        leaders = Group(pg=pg, rank=leader_ranks.index(group.rank), size=len(leader_ranks),
                        name=f"{group.name}.leaders", counter=CommCounter())
        if pg is not None:
            mesh, err = TcpMesh.build(leaders, timeout_s)
            if mesh is None:
                warnings.warn(f"{group.name} group across hosts: small all-reduces stay on gloo, the TCP mesh did "
                              f"not connect: {err}", RuntimeWarning)
            leaders.fast = mesh
    return HierarchicalComm(group, hosts, intra, leaders)


def _leaders_pg(prefix: str, rank: int, size: int, timeout_s: float):
    """A gloo process group of the leaders only, rendezvousing under ``prefix`` of the default store.

    Not ``dist.new_group(..., use_local_synchronization=True)``: that names the group by its ranks and the number
    of groups this process holds, so a group made again after the last was destroyed reuses the name and its store
    keys, and gloo connected to the previous group's closed ports and hung (CI, 2026-12-02); and two leaders that
    hold different numbers of groups would wait under different names. torch runs all-reduce, the only collective
    the leaders call on it (:func:`tensorpar.comm.all_gather_json` is built on all-reduce), on a group it has not
    registered. Raises RuntimeError (gloo) if a leader does not arrive within ``timeout_s``."""
    store = dist.PrefixStore(prefix, dist.distributed_c10d._get_default_store())
    return dist.ProcessGroupGloo(store, rank, size, _dt.timedelta(seconds=timeout_s))
