"""Waiting for peers: spin briefly, then yield the CPU, then sleep; never forever.

A rank that has published its data waits until every peer's arrival counter reaches the same
step. Most waits at decode time are a few microseconds (the peers are computing the same thing
on the other cores), so the first phase spins on the counter. When ranks outnumber cores the peer
we wait for may need *our* core, so after ``spin_us`` we call ``sched_yield`` between polls, and
after ``yield_us`` more we sleep with exponential back-off up to ``max_sleep_us``: a long wait
(a peer loading weights, a peer that died) costs almost no CPU.

Every ``check_ms`` of the slow phases the waiter also looks at the segment's abort word (set by
a peer that timed out, was interrupted or closed), at the peer's state and process liveness
(``/proc/<pid>/stat``), and at the deadline; any of these raises :class:`CollectiveError`
naming the collective and the missing rank.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

from tensorpar.comm import CollectiveError
from tensorpar.shm.segment import (ABORT_REASONS, G_ABORT_PEER, G_ABORT_RANK, G_ABORT_WHY, STATE_BROKEN,
                                   STATE_CLOSED, W_ARRIVED, W_STATE, process_alive)


@dataclass(frozen=True)
class WaitPolicy:
    """How a rank waits for its peers (all times in microseconds unless named otherwise).

    Attributes:
        spin_us: busy-poll this long first, which covers a peer a few microseconds behind (the
            common case at decode) without a system call. Kept short: on an idle core the yield
            phase polls almost as fast (``sched_yield`` returns at once when nothing else is
            runnable), and on a busy core spinning only delays the peer we wait for. On the
            shared 2-core development machine (load average ~4), 2-rank 4 KB all-reduce medians
            rose with the spin: ~65 us at 0 us, ~75 at 5, ~100 at 30, ~135 at 60 (noisy; on an
            idle machine the spin length should hardly matter).
        yield_us: then poll with ``os.sched_yield()`` between reads for this long: a peer that
            shares our core gets it at once, and we still react within a scheduler slice.
        max_sleep_us: then sleep between polls, doubling from 20 us up to this: waits of
            milliseconds or more (a slow or dead peer) burn no CPU, at the price of reacting up
            to this late.
        check_ms: in the yield and sleep phases, how often to check deadline, abort word and
            peer liveness (each check reads ``/proc``, so not on every poll).
    """

    spin_us: float = 5.0
    yield_us: float = 2000.0
    max_sleep_us: float = 500.0
    check_ms: float = 20.0

    def __post_init__(self):
        for k in ("spin_us", "yield_us", "max_sleep_us", "check_ms"):
            if getattr(self, k) < 0:
                raise ValueError(f"WaitPolicy.{k} must be >= 0, got {getattr(self, k)}")

    @classmethod
    def for_ranks(cls, ranks_on_host: int, cores: int | None = None) -> "WaitPolicy":
        """The default schedule, without spinning when ranks outnumber this process's cores.

        Oversubscribed, the peer a rank waits for is usually waiting for a core, quite possibly
        the one we would spin on; handing it over at once is then the fast choice.
        """
        if cores is None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return cls() if ranks_on_host <= cores else cls(spin_us=0.0)


@dataclass(frozen=True)
class Peer:
    """What a waiter needs to know about a peer to report it: group rank, pid and process start time."""

    rank: int
    pid: int
    start_time: int | None


def wait_slow(ctl, line: int, target: int, peer: Peer, policy: WaitPolicy, deadline_ns: int, what: str) -> None:
    """Wait (yield, then sleep) until ``ctl[line + W_ARRIVED] >= target``.

    Args:
        ctl: the segment's int64 control words.
        line: word index of the peer's control line.
        target: arrival count to reach.
        peer: who we wait for (named in errors).
        policy: the phases' lengths.
        deadline_ns: ``time.monotonic_ns()`` after which we give up.
        what: description of the collective for messages (``"all_reduce #17 on tp group, rank 0 of 2"``).

    Raises:
        CollectiveError: the deadline passed, a peer aborted, the peer closed or its process died.
    """
    now = time.monotonic_ns()
    yield_end = now + int(policy.yield_us * 1e3)
    check_ns = int(policy.check_ms * 1e6)
    next_check = now + check_ns            # not at once: most slow waits end within microseconds
    sleep_s = 20e-6
    max_sleep_s = policy.max_sleep_us * 1e-6
    arrived = line + W_ARRIVED
    while ctl[arrived] < target:
        now = time.monotonic_ns()
        if now >= next_check:
            next_check = now + check_ns
            _check(ctl, line, peer, deadline_ns, now, what)
        if now < yield_end:
            os.sched_yield()
        else:
            time.sleep(sleep_s)
            sleep_s = min(2 * sleep_s, max_sleep_s)


def _check(ctl, line: int, peer: Peer, deadline_ns: int, now: int, what: str) -> None:
    state = ctl[line + W_STATE]
    if state == STATE_CLOSED:
        raise CollectiveError(f"{what}: rank {peer.rank} (pid {peer.pid}) closed its communicator before arriving")
    if state == STATE_BROKEN:
        raise CollectiveError(f"{what}: rank {peer.rank} (pid {peer.pid}) broke off an earlier collective")
    if not process_alive(peer.pid, peer.start_time):
        raise CollectiveError(f"{what}: rank {peer.rank} (pid {peer.pid}) exited without arriving")
    aborter = ctl[G_ABORT_RANK]
    if aborter:
        why = ABORT_REASONS.get(ctl[G_ABORT_WHY], "failed").format(peer=ctl[G_ABORT_PEER])
        raise CollectiveError(f"{what}: while waiting for rank {peer.rank}, rank {aborter - 1} {why}; "
                              f"the shared-memory communicator is unusable")
    if now >= deadline_ns:
        raise CollectiveError(f"{what}: rank {peer.rank} (pid {peer.pid}) did not arrive within the timeout")
