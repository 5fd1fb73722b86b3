"""Rank functions for tests/cli/test_cli_errors.py, started through tensorpar.launch.run_ranks (top level: pickled).

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


def listening_sockets(pids: list[int]) -> list[str]:
    """``host:port`` of every listening TCP socket (IPv4 and IPv6) that one of ``pids`` holds (Linux ``/proc``)."""
    import ipaddress
    import socket
    import struct

    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    found = []
    for name, fam in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            lines = open(f"/proc/net/{name}").read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A: LISTEN
                continue
            addr, port = f[1].split(":")
            raw = bytes.fromhex(addr)
            words = struct.unpack(f"<{len(raw) // 4}I", raw)  # /proc prints each 32-bit word in host order
            ip = ipaddress.ip_address(struct.pack(f">{len(words)}I", *words))
            found.append(f"{ip}:{int(port, 16)}")
    return sorted(found)


def report_listeners() -> int:
    """Form the process group and run a collective; then rank 0 prints the listening sockets of the launcher
    (this rank's parent, which hosts the rendezvous store) and of every rank of this launch."""
    import torch

    from tensorpar import comm
    from tensorpar.parallel import ParallelConfig, init_parallel

    ctx = init_parallel(ParallelConfig(tp=int(os.environ["WORLD_SIZE"])), timeout_s=60, backend="gloo")
    comm.all_reduce(torch.ones(3), ctx.tp)
    pids = torch.tensor([os.getpid()])
    allp = comm.all_gather(pids, ctx.tp, dim=0) if ctx.tp.size > 1 else pids
    if ctx.rank == 0:
        print("listening " + " ".join(listening_sockets([os.getppid(), *allp.tolist()])), flush=True)
    comm.all_reduce(torch.ones(3), ctx.tp)
    ctx.destroy()
    return 0


def exchanges_without_pickle() -> int:
    """tensorpar's own exchanges (the shared-memory start-up, the fingerprint check through the store) with every
    pickle entry point replaced by one that raises: none of them may unpickle (or pickle) anything."""
    import pickle

    import torch
    import torch.distributed.distributed_c10d as c10d

    from tensorpar import comm, fingerprint
    from tensorpar.parallel import ParallelConfig, init_parallel
    from tensorpar.shm import enable_fast_collectives

    ctx = init_parallel(ParallelConfig(tp=int(os.environ["WORLD_SIZE"])), timeout_s=60, backend="gloo")

    def no(*a, **k):
        raise AssertionError("pickle used")
    saved = [(pickle, n, getattr(pickle, n)) for n in ("loads", "dumps", "load", "dump", "Pickler", "Unpickler")]
    saved += [(c10d, n, getattr(c10d, n)) for n in ("_pickler", "_unpickler") if hasattr(c10d, n)]
    for mod, n, _ in saved:
        setattr(mod, n, no)
    try:
        assert enable_fast_collectives(ctx.tp, "on", timeout_s=60)
        fingerprint.enable(ctx.tp, every=1, timeout_s=30)
        for _ in range(2):
            comm.all_reduce(torch.ones(3), ctx.tp)
            assert fingerprint.check(ctx.tp, {"seed": 1, "ids": torch.arange(4)})
        fingerprint.disable(ctx.tp)
    finally:
        for mod, n, f in saved:
            setattr(mod, n, f)
    pids = comm.all_gather(torch.tensor([os.getpid()]), ctx.tp, dim=0)
    if ctx.rank == 0:
        print("no pickle", flush=True)
        print("listening " + " ".join(listening_sockets([os.getppid(), *pids.tolist()])), flush=True)
    comm.all_reduce(torch.ones(3), ctx.tp)
    ctx.destroy()
    return 0


if __name__ == "__main__":
    from tensorpar.launch import run_ranks

    job, nproc = sys.argv[1], int(sys.argv[2])
    verbose = "--verbose" in sys.argv
    timeout = float(os.environ.get("TENSORPAR_JOB_TIMEOUT", "3"))
    extra = {"raise_on_rank1": (), "kill_rank1": (), "stop_rank1_before_all_reduce": (timeout,),
             "port_of_run": (3.0,), "threads_after_destroy": (), "report_listeners": (),
             "exchanges_without_pickle": ()}[job]
    sys.exit(run_ranks(globals()[job], nproc, *extra, verbose=verbose))
