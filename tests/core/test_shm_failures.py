"""Shared-memory collectives under failure: a rank that never arrives, dies, or is interrupted; cleanup."""
import os
import re
import signal
import threading
import time

import pytest
import torch

from tensorpar import comm
from tensorpar.comm import CollectiveError
from tensorpar.shm import WaitPolicy, disable_fast_collectives, sweep_stale
from tensorpar.shm.segment import PREFIX, SHM_DIR, Layout, Segment
from tensorpar.testing import RankFailure, WorkerPool
from tests._shm import fast_twin


def _segments_of(pids) -> list[str]:
    pids = {str(p) for p in pids}
    return [n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX) and n[len(PREFIX):].split("-")[0] in pids]


def job_never_arrives(ctx, timeout_s):
    g = fast_twin(ctx, timeout_s=timeout_s)
    try:
        if g.rank == 1:
            time.sleep(timeout_s + 1.0)       # alive, but never calls the collective
            return os.getpid(), "skipped", 0.0, ""
        t0 = time.monotonic()
        try:
            comm.all_reduce(torch.ones(8), g)
            first = "no error"
        except CollectiveError as e:
            first = str(e)
        took = time.monotonic() - t0
        try:                                  # the communicator is now unusable, at once
            comm.all_reduce(torch.ones(8), g)
            second = "no error"
        except CollectiveError as e:
            second = str(e)
        return os.getpid(), first, took, second
    finally:
        disable_fast_collectives(g)


def test_rank_that_never_arrives_fails_the_others_within_the_timeout(pools):
    out = pools(2).run(job_never_arrives, 1.5)
    _, msg, took, second = out[0]
    assert "shared-memory all_reduce" in msg and "rank 1" in msg and "did not arrive within the timeout" in msg, msg
    assert "timeout 1.5 s" in msg
    assert 1.5 <= took < 1.5 + 2.0, took
    assert "unusable" in second
    assert out[1][1] == "skipped"
    assert not _segments_of(pid for pid, *_ in out)


def job_interrupted(ctx):
    g = fast_twin(ctx, timeout_s=30.0)
    try:
        if g.rank == 1:
            # Ctrl-C arrives while rank 1 waits for rank 0 (which is late by 3 s: margin for a loaded machine)
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
            try:
                comm.all_reduce(torch.ones(8), g)
            except KeyboardInterrupt:
                return "interrupted", 0.0
            return "no interrupt", 0.0
        time.sleep(3.0)
        # rank 1 had published its data before it was interrupted, so this one completes ...
        assert torch.equal(comm.all_reduce(torch.ones(8), g), torch.full((8,), 2.0))
        t0 = time.monotonic()
        try:                                   # ... and the next one fails at once
            comm.all_reduce(torch.ones(8), g)
        except CollectiveError as e:
            return str(e), time.monotonic() - t0
        return "no error", 0.0
    finally:
        disable_fast_collectives(g)


def test_ctrl_c_on_one_rank_fails_the_others_fast(pools):
    out = pools(2).run(job_interrupted)
    assert out[1][0] == "interrupted"
    msg, took = out[0]
    assert "rank 1" in msg and ("broke off" in msg or "interrupted" in msg), msg
    assert took < 5.0, took     # far below the 30 s timeout


def job_dies(ctx):
    g = fast_twin(ctx, timeout_s=60.0, policy=WaitPolicy(check_ms=10))
    if g.rank == 1:
        time.sleep(0.5)
        os._exit(3)                            # dies without closing anything
    t0 = time.monotonic()
    try:
        comm.all_reduce(torch.ones(8), g)
    except CollectiveError as e:
        raise RuntimeError(f"{e} [after {time.monotonic() - t0:.1f} s]") from None
    finally:
        disable_fast_collectives(g)


def test_rank_that_dies_fails_the_others_long_before_the_timeout():
    with WorkerPool(2, collective_timeout_s=2.0, job_timeout_s=30.0) as pool:
        pool.run(lambda_free_noop)
        pids = [p.pid for p in pool._procs]
        with pytest.raises(RankFailure) as info:
            pool.run(job_dies)
    msg = str(info.value)
    assert "rank 1" in msg and "exited without arriving" in msg, msg
    took = float(re.findall(r"\[after ([0-9.]+) s\]", msg)[-1])
    assert took < 10.0, took                   # the timeout was 60 s
    assert not _segments_of(pids)


def lambda_free_noop(ctx):
    return None


def test_segment_is_unlinked_and_stale_ones_are_swept():
    seg = Segment.create(Layout(2, 4096))
    path = os.path.join(SHM_DIR, seg.name)
    assert os.path.exists(path)
    seg.unlink()
    assert not os.path.exists(path)
    seg.ctl[0] += 0                            # still mapped and usable after unlink
    seg.close()
    # a segment left by a creator that died during set-up (pid 2**22 + 1 cannot exist)
    stale = os.path.join(SHM_DIR, f"{PREFIX}{2 ** 22 + 1}-deadbeef")
    with open(stale, "wb"):
        pass
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    assert f"{PREFIX}{2 ** 22 + 1}-deadbeef" in sweep_stale()
    assert not os.path.exists(stale)


def job_pid(ctx):
    return os.getpid()


def test_no_segment_left_in_dev_shm(pools):
    """After everything above (and the other shm test files that ran before), nothing of ours remains."""
    pids = [os.getpid()]
    for n in (2, 4):
        pids += pools(n).run(job_pid)
    assert _segments_of(pids) == []
