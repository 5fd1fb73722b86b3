"""Rank functions for tests/test_cli_errors.py, started through tensorpar.launch.run_ranks (top level: pickled).

Run as ``python -m tests._launch_jobs <job> <nproc> [--verbose]``; the exit code is run_ranks' return value.
"""
from __future__ import annotations

import os
import signal
import sys
import time


def raise_on_rank1() -> int:
    if os.environ["RANK"] == "1":
        raise ValueError("--lr nan: must be a finite\nnumber")
    time.sleep(60)  # rank 0 would wait much longer than the test: the launcher must stop it
    return 0


def kill_rank1() -> int:
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's out-of-memory killer would
    time.sleep(60)
    return 0


def stop_rank1_before_all_reduce(timeout_s: float) -> int:
    import datetime

    import torch
    import torch.distributed as dist

    from tensorpar import comm
    from tensorpar.parallel import ParallelConfig, init_parallel

    # joining may take far longer than timeout_s on a loaded machine (each rank imports torch): only the
    # collectives of the tp group below have the short timeout under test
    ctx = init_parallel(ParallelConfig(tp=2), timeout_s=120, backend="gloo")
    ctx.tp = comm.Group(pg=dist.new_group([0, 1], timeout=datetime.timedelta(seconds=timeout_s)), rank=ctx.rank,
                        size=2, name="tp")
    comm.all_reduce(torch.ones(4), ctx.tp)  # both ranks arrive once
    if ctx.rank == 1:
        if os.environ.get("TENSORPAR_STOP_FILE"):  # bench/bench_rank_failure.py times the exit from here
            with open(os.environ["TENSORPAR_STOP_FILE"], "w") as f:
                f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)  # a stopped rank: it never reaches the next collective
    comm.all_reduce(torch.ones(4), ctx.tp)
    ctx.destroy()
    return 0


def port_of_run(seconds: float) -> int:
    """Both ranks form a process group, hold it ``seconds``, then check one all-reduce."""
    import torch

    from tensorpar import comm
    from tensorpar.parallel import ParallelConfig, init_parallel

    ctx = init_parallel(ParallelConfig(tp=int(os.environ["WORLD_SIZE"])), timeout_s=60, backend="gloo")
    time.sleep(seconds)
    out = comm.all_reduce(torch.ones(3), ctx.tp)
    assert out.tolist() == [ctx.tp.size] * 3, out
    if ctx.rank == 0:
        print(f"port {os.environ.get('MASTER_PORT')} sum {out.tolist()}", flush=True)
    ctx.destroy()
    return 0


def threads_after_destroy() -> int:
    """Broadcast as generate's last step does, then ``ctx.destroy()``: the group's gloo threads must be gone
    (a worker left running may take the GIL while Python finalizes, and the rank aborts after its output)."""
    import torch

    from tensorpar import comm
    from tensorpar.parallel import ParallelConfig, init_parallel

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    start = threads()
    ctx = init_parallel(ParallelConfig(tp=int(os.environ["WORLD_SIZE"])), timeout_s=60, backend="gloo",
                        fast_collectives="off")
    out = comm.broadcast(torch.arange(4.0) * (ctx.rank == 0), ctx.tp)
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0], out
    before = threads()
    ctx.destroy()
    after = threads()
    print(f"rank {ctx.rank} threads {start} -> {before} -> {after} pg {ctx.tp.pg}", flush=True)
    assert ctx.tp.pg is None and after == start, (start, before, after)
    return 0


if __name__ == "__main__":
    from tensorpar.launch import run_ranks

    job, nproc = sys.argv[1], int(sys.argv[2])
    verbose = "--verbose" in sys.argv
    timeout = float(os.environ.get("TENSORPAR_JOB_TIMEOUT", "3"))
    extra = {"raise_on_rank1": (), "kill_rank1": (), "stop_rank1_before_all_reduce": (timeout,),
             "port_of_run": (3.0,), "threads_after_destroy": ()}[job]
    sys.exit(run_ranks(globals()[job], nproc, *extra, verbose=verbose))
