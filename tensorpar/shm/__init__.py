"""Fast collectives for CPU tensors: shared memory among the ranks of one host, hierarchical across hosts.

At decode time a tensor-parallel all-reduce carries a few kilobytes, and its cost is the
latency of the transport (gloo: hundreds of microseconds between two local processes), not
bandwidth. Ranks on one host can instead exchange data through one shared memory segment and a
counter per rank, which costs a memcpy, an add, and a few microseconds of Python.

Use::

    from tensorpar.shm import enable_fast_collectives
    enable_fast_collectives(ctx.tp, "auto")   # collective over ctx.tp's ranks; True if enabled

After that, :mod:`tensorpar.comm`'s raw and autograd collectives on ``ctx.tp`` run through the
segment for CPU tensors (CUDA tensors keep NCCL). The files are:

* ``segment.py`` - layout, creation/attach/unlink of the ``/dev/shm`` segment, process identity;
* ``sync.py`` - spin / yield / sleep waiting with deadline, abort and liveness checks;
* ``protocol.py`` - the step protocol: arrivals, barriers, metadata checks, chunked building blocks;
* ``collectives.py`` - :class:`ShmCommunicator`: the collectives, built on the protocol;
* ``bootstrap.py`` - the one-time host-identity exchange and per-host segment set-up;
* ``hierarchical.py`` - :class:`HierarchicalComm`: two-level all-reduce across hosts.
"""
from __future__ import annotations

import warnings

import torch.distributed as dist

from tensorpar.comm import CollectiveError, Group
from tensorpar.shm.bootstrap import build_host_communicator, exchange_members, hosts_of, ordering_supported
from tensorpar.shm.collectives import ShmCommunicator
from tensorpar.shm.hierarchical import HierarchicalComm, make_hierarchical
from tensorpar.shm.segment import host_identity, sweep_stale
from tensorpar.shm.sync import WaitPolicy

MODES = ("auto", "on", "off", "hierarchical")
DEFAULT_SLOT_BYTES = 2 * 1024 * 1024     # per rank and buffer: 4 ranks use 16 MiB of /dev/shm
DEFAULT_ONESHOT_BYTES = 256 * 1024

__all__ = ["enable_fast_collectives", "disable_fast_collectives", "ShmCommunicator", "HierarchicalComm",
           "WaitPolicy", "host_identity", "sweep_stale", "MODES"]


def enable_fast_collectives(group: Group, mode: str = "auto", *, host_id: str | None = None,
                            timeout_s: float = 120.0, slot_bytes: int = DEFAULT_SLOT_BYTES,
                            oneshot_bytes: int = DEFAULT_ONESHOT_BYTES, policy: WaitPolicy | None = None) -> bool:
    """Install a fast communicator as ``group.fast``; return whether one was installed.

    Collective over the group's ranks when ``mode`` is not ``"off"``: every rank must call it,
    with the same ``mode``, right after the group is made (``init_parallel``). What runs:
    one all-gather of host identities over ``group.pg``, then (same host) the creation of one
    ``/dev/shm`` segment of ``~2 * size * slot_bytes`` bytes, unlinked as soon as all ranks have
    mapped it, so nothing is left in ``/dev/shm`` however the processes end.

    Args:
        group: the group (any :class:`~tensorpar.comm.Group` with a gloo or NCCL ``pg``).
        mode: ``"auto"`` - on an x86 machine (whose store ordering the protocol relies on): shared
            memory if all ranks are on one host, the hierarchical all-reduce of ``"hierarchical"`` if they
            are on several (its leaders exchange small tensors over their own TCP mesh,
            :class:`tensorpar.comm.tcp.TcpMesh`); else nothing (torch.distributed);
            ``"on"`` - shared memory or an error; ``"off"`` - remove any fast path;
            ``"hierarchical"`` - the two-level all-reduce of :class:`HierarchicalComm`
            (shared memory inside each host, one leader per host over torch.distributed).
        host_id: this rank's host identity; default :func:`host_identity`
            (``hostname/boot_id/net-namespace``). Tests pass simulated ids (``f"host{rank // 2}"``).
        timeout_s: how long a rank waits for a peer at any step before raising
            :class:`~tensorpar.comm.CollectiveError` (use the collective timeout of
            ``init_parallel``).
        slot_bytes: bytes per rank and buffer; larger messages go in chunks of this size.
            A multiple of 4096.
        oneshot_bytes: all-reduces up to this size are summed by every rank (one step);
            larger ones are reduce-scattered then all-gathered (two-shot).
        policy: the spin / yield / sleep schedule; default :meth:`WaitPolicy.for_ranks` of the
            number of ranks on this host (short spinning when they outnumber the cores).

    Returns:
        True if ``group.fast`` is now set.

    Raises:
        ValueError: a bad ``mode``, ``timeout_s`` or ``slot_bytes``; ``mode="on"`` for a group
            whose ranks are on several hosts (on every rank) or on a non-x86 machine.
        CollectiveError: ``mode="on"`` or ``"hierarchical"`` and the ranks could not share a
            segment (``/dev/shm`` missing, full, or not shared).
    """
    if mode not in MODES:
        raise ValueError(f"fast collectives mode must be one of {MODES}, got {mode!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
    if not isinstance(slot_bytes, int) or slot_bytes < 4096 or slot_bytes % 4096:
        raise ValueError(f"slot_bytes must be a positive multiple of 4096, got {slot_bytes!r}; "
                         f"the default is {DEFAULT_SLOT_BYTES}")
    if not isinstance(oneshot_bytes, int) or oneshot_bytes < 0:
        raise ValueError(f"oneshot_bytes must be a non-negative int, got {oneshot_bytes!r}")
    disable_fast_collectives(group)
    if mode == "off" or group.size == 1:
        return False
    if not ordering_supported():
        if mode == "auto":
            return False
        raise ValueError(f"fast collectives mode {mode!r}: the shared-memory protocol relies on x86 store ordering "
                         f"and this machine is not x86; use mode='auto' or 'off'")
    if mode == "auto" and dist.get_backend(group.pg) == "nccl":
        return False                       # tensors live on the GPU there; NCCL already is the fast path
    members = exchange_members(group.pg, host_id)
    opts = dict(slot_bytes=slot_bytes, timeout_s=timeout_s, policy=policy, oneshot_bytes=oneshot_bytes)
    if mode == "hierarchical":
        group.fast = make_hierarchical(group, members, **opts)
        return True
    hosts = hosts_of(members)
    if len(hosts) > 1 and mode == "auto":         # the same rule on every rank: members are all-gathered
        try:
            group.fast = make_hierarchical(group, members, **opts)
        except CollectiveError as e:
            warnings.warn(f"fast collectives disabled for the {group.name} group: {e}", RuntimeWarning)
            return False
        return True
    if len(hosts) > 1:
        raise ValueError(f"fast collectives mode 'on' needs every rank of the {group.name} group on one host, but "
                         f"its ranks are on {len(hosts)} hosts: " + "; ".join(
                             f"{members[h[0]].host!r}: ranks {h}" for h in hosts)
                         + ". Use mode 'auto' (--fast-collectives auto: shared memory inside each host, the hosts' "
                           "leaders over their own TCP connections)")
    fast, err = build_host_communicator(group.pg, members, group_name=group.name, **opts)
    if fast is None:
        if mode == "on":
            raise CollectiveError(f"fast collectives on {group.name} group: {err}")
        warnings.warn(f"shared-memory collectives disabled for the {group.name} group: {err}", RuntimeWarning)
        return False
    group.fast = fast
    return True


def disable_fast_collectives(group: Group) -> None:
    """Close and remove ``group.fast`` (local, not collective; the peers should do the same)."""
    fast, group.fast = group.fast, None
    if fast is not None and hasattr(fast, "close"):
        fast.close()
