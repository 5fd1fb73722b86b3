"""Start-up of the same-host path: exchange host identities once, then build one segment per host.

Everything here is collective over a torch.distributed process group and runs once, when a
group is made; the collectives themselves never touch torch.distributed.
"""
from __future__ import annotations

import dataclasses
import os
import platform
from dataclasses import dataclass

import torch.distributed as dist

from tensorpar.comm import all_gather_json
from tensorpar.shm.collectives import ShmCommunicator
from tensorpar.shm.segment import W_PID, W_START, Layout, Segment, host_identity, process_start_time, sweep_stale
from tensorpar.shm.sync import Peer, WaitPolicy

# Architectures whose store ordering the protocol relies on (see protocol.py).
TSO_MACHINES = frozenset({"x86_64", "amd64", "i386", "i686", "x86"})


def ordering_supported() -> bool:
    """True on x86 (TSO): stores become visible in program order, which the flag protocol needs."""
    return platform.machine().lower() in TSO_MACHINES


@dataclass(frozen=True)
class Member:
    """One rank as its peers learn it at start-up."""

    host: str
    pid: int
    start_time: int | None
    global_rank: int


def exchange_members(pg, host_id: str | None) -> list[Member]:
    """All-gather every rank's :class:`Member` over ``pg`` (group-rank order; as JSON). Collective."""
    me = Member(host=host_id if host_id is not None else host_identity(), pid=os.getpid(),
                start_time=process_start_time(os.getpid()), global_rank=dist.get_rank())
    return [Member(**m) for m in all_gather_json(dataclasses.asdict(me), pg)]


def hosts_of(members: list[Member]) -> list[list[int]]:
    """Group ranks per host, hosts in order of their lowest rank: ``[[0, 1], [2, 3]]``."""
    by_host: dict[str, list[int]] = {}
    for r, m in enumerate(members):
        by_host.setdefault(m.host, []).append(r)
    return list(by_host.values())


def build_host_communicator(pg, members: list[Member], *, group_name: str, slot_bytes: int, timeout_s: float,
                            policy: WaitPolicy | None, oneshot_bytes: int) -> tuple[ShmCommunicator | None, str]:
    """Give every host with two or more ranks of ``pg`` its own segment; return this rank's communicator.

    Collective over ``pg``. The lowest rank of each host creates a segment; the names are
    all-gathered; the others attach and write their pid into their control line; a second
    all-gather confirms every attach; the creators unlink (always, also on failure); each rank
    then checks that it sees its peers' pids through the segment, i.e. that they really share
    memory, and a third all-gather agrees on the outcome.

    Returns:
        ``(communicator, "")`` on success; ``(None, "")`` if this rank is alone on its host;
        ``(None, reason)`` on every rank if any host failed (no ``/dev/shm``, no room, not
        shared between the ranks that claim one host).
    """
    hosts = hosts_of(members)
    rank = dist.get_rank(pg)
    mine = next(h for h in hosts if rank in h)
    local_rank = mine.index(rank)
    layout = Layout(size=len(mine), slot_bytes=slot_bytes)
    seg, err = None, ""
    created = None
    try:
        if len(mine) > 1 and local_rank == 0:
            sweep_stale()
            try:
                created = seg = Segment.create(layout)
            except OSError as e:
                err = f"rank {rank} could not create a {layout.total_bytes}-byte segment in /dev/shm: {e}"
        names = _all_gather(pg, (seg.name if seg else None, err))
        if len(mine) > 1 and local_rank > 0:
            name, cerr = names[mine[0]]
            if name is None:
                err = cerr
            else:
                try:
                    seg = Segment.attach(name, layout)
                except (OSError, RuntimeError) as e:
                    err = (f"rank {rank} could not attach rank {mine[0]}'s segment {name} (do they share /dev/shm? "
                           f"their host ids are both {members[rank].host!r}): {e}")
        if seg is not None:
            line = layout.line(local_rank)
            seg.ctl[line + W_START] = members[rank].start_time or 0
            seg.ctl[line + W_PID] = members[rank].pid
        errs = _all_gather(pg, err)
        if created is not None:
            created.unlink()
        if not any(errs) and seg is not None:
            seen = [seg.ctl[layout.line(i) + W_PID] for i in range(len(mine))]
            want = [members[r].pid for r in mine]
            if seen != want:
                err = (f"rank {rank} sees pids {seen} in the segment of host {members[rank].host!r} but the ranks "
                       f"{mine} reported pids {want}: the segment is not shared")
        errs = _all_gather(pg, err)
    finally:
        if created is not None:
            created.unlink()
    failed = [e for e in errs if e]
    if failed:
        if seg is not None:
            seg.close()
        return None, "; ".join(failed)
    if seg is None:
        return None, ""
    # Liveness checks need the peer's /proc entry; in another PID namespace it is not ours to see.
    peers = [Peer(rank=i, pid=members[r].pid,
                  start_time=members[r].start_time if process_start_time(members[r].pid) == members[r].start_time
                  else None) for i, r in enumerate(mine)]
    policy = policy or WaitPolicy.for_ranks(len(mine))
    return ShmCommunicator(seg, local_rank, len(mine), peers, group_name=group_name, timeout_s=timeout_s,
                           policy=policy, oneshot_bytes=oneshot_bytes), ""


def _all_gather(pg, obj) -> list:
    return [tuple(x) if isinstance(x, list) else x for x in all_gather_json(obj, pg)]  # JSON: never pickle
