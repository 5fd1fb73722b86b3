"""Start N local ranks through torch's elastic launcher, or run in place under torchrun.

``tensorpar generate --tp 2`` calls :func:`run_ranks`, which starts the ranks with
``torch.distributed.launcher.api.elastic_launch`` (the machinery of torchrun). Nothing it opens is
reachable from outside the host: both stores of the rendezvous listen on ``127.0.0.1`` only, at ports the
kernel picks (:func:`loopback_store`; torch's own ``TCPStore`` listens on every interface), so two runs, or a
run next to another torchrun job, do not collide either; the ranks' gloo / NCCL sockets are put on the
loopback interface (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME=lo`` unless set); a one-rank run uses an
in-process store (:func:`tensorpar.parallel.init_parallel`). See docs/security.md. When the process already is a torchrun worker (``TORCHELASTIC_RUN_ID`` or ``RANK`` in the
environment), the function runs directly: ``torchrun --nnodes M --nproc-per-node N -m
tensorpar generate ...`` is the multi-machine path, unchanged (it binds what the user gave torchrun).

Errors: a rank that raises reaches the user as one line, ``tensorpar: error: <message> (rank R)``,
and the run exits 1; the launcher's log lines and the rank's traceback are shown only with
``verbose``. A rank that stops or hangs makes its peers' next collective time out (the collective
timeout of the command); the error names the collective, and the remaining ranks are stopped within
a couple of seconds (:data:`SHUTDOWN_TIMEOUT_S`). The wrapper each rank runs and the choice of the error to
show live in :mod:`tensorpar.rank_errors`. What is sent to the ranks is one :class:`tensorpar.job.Job`.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import sys
import tempfile
import uuid
from typing import Any, Callable, Iterator

from tensorpar.rank_errors import (SHUTDOWN_TIMEOUT_S, _failure_line, _first_error,  # noqa: F401 (re-exported)
                                   _rank_entry, one_line, report_error, under_torchrun, watch_agent)

# One default for every command (issue 14, item 7).
DEFAULT_TP = 2
DEFAULT_TIMEOUT_S = 300.0

_LAUNCHER_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing",
                     "torch.distributed.elastic.multiprocessing.api",
                     "torch.distributed.elastic.agent.server.api",
                     "torch.distributed.elastic.agent.server.local_elastic_agent",
                     "torch.distributed.elastic.rendezvous.dynamic_rendezvous")



def check_socket_ifname() -> None:
    """``GLOO_SOCKET_IFNAME`` (the interfaces gloo and tensorpar's TCP connections bind to) names interfaces this host
    has, and, in a run whose ranks span hosts (``WORLD_SIZE`` > ``LOCAL_WORLD_SIZE``, as torchrun sets them with
    ``--nnodes`` > 1), none of them is a loopback interface: another host cannot reach an address there, and gloo
    would wait for its connections until the collective timeout. Raises ValueError naming the variable, its value
    and the interfaces here (gloo's own error names neither, or comes minutes later)."""
    import socket

    value = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if not value:
        return
    here = [name for _, name in socket.if_nameindex()]
    missing = [n for n in value.split(",") if n not in here]
    if missing:
        raise ValueError(f"GLOO_SOCKET_IFNAME={value}: no interface {', '.join(map(repr, missing))} on host "
                         f"{socket.gethostname()}; interfaces here: {', '.join(here)} (across hosts: the one the "
                         f"other hosts reach this host through, comma-separated without spaces or empty names; on "
                         f"one host: lo, or leave it unset)")
    world, local = os.environ.get("WORLD_SIZE", ""), os.environ.get("LOCAL_WORLD_SIZE", "")
    if world.isdigit() and local.isdigit() and int(world) > int(local):
        loop = [n for n in value.split(",") if _is_loopback(n)]
        if loop:
            others = [n for n in here if not _is_loopback(n)]
            raise ValueError(f"GLOO_SOCKET_IFNAME={value}: {', '.join(map(repr, loop))} is a loopback interface, "
                             f"which the other hosts of this {world}-rank run cannot reach (host "
                             f"{socket.gethostname()}); name the interface of the link between the hosts"
                             + (f" (here: {', '.join(others)})" if others else ""))


def _is_loopback(name: str) -> bool:
    """Whether network interface ``name`` is a loopback one (Linux: IFF_LOOPBACK in /sys/class/net/NAME/flags;
    elsewhere, by the name ``lo``/``lo0``)."""
    try:
        with open(f"/sys/class/net/{name}/flags") as f:
            return bool(int(f.read().strip(), 16) & 0x8)
    except (OSError, ValueError):
        return name in ("lo", "lo0")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` (default loopback) that is free right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def loopback_store(timeout_s: float = 300.0):
    """A ``TCPStore`` server that listens on ``127.0.0.1`` only, at a port the kernel picks.

    torch's ``TCPStore`` has no bind-address option and listens on the wildcard address (every interface); its
    ``master_listen_fd`` takes a socket that is already listening, so we bind that socket to loopback ourselves
    (the libuv server, torch's default, takes it over and closes it). Clients connect to ``127.0.0.1:<port>``.
    """
    import datetime

    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1024)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, multi_tenant=True,
                         master_listen_fd=sock.detach(), use_libuv=True,
                         timeout=datetime.timedelta(seconds=timeout_s))


LOOPBACK_RDZV = "tensorpar-loopback"


def _loopback_rendezvous(params):
    """torch elastic's c10d rendezvous (``DynamicRendezvousHandler`` on ``C10dRendezvousBackend``) with both of its
    stores on :func:`loopback_store`: the rendezvous store, and the store it shares with the ranks
    (``TORCHELASTIC_USE_AGENT_STORE``; torch makes that one with ``TCPStore(addr, 0, is_master=True)``, i.e. on
    every interface, in ``_create_tcp_store_server``, replaced here). For one-host launches only."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    class Backend(C10dRendezvousBackend):
        @property
        def name(self) -> str:  # the launcher checks that the handler is of the backend it asked for
            return LOOPBACK_RDZV

    timeout = float(params.get_as_int("read_timeout", 60) or 60)
    store = loopback_store(timeout)
    handler = create_handler(store, Backend(store, params.run_id), params)
    if not hasattr(handler, "_create_tcp_store_server"):  # a torch whose handler makes its store elsewhere
        raise RuntimeError("this torch's elastic rendezvous has no _create_tcp_store_server; tensorpar cannot keep "
                           "its store on loopback (report this with the torch version)")
    handler._create_tcp_store_server = lambda addr, port: loopback_store(timeout)
    return handler


def rank0_print(*args, **kwargs) -> None:
    """Print from global rank 0 only (reads ``RANK``; prints everything outside a launch)."""
    if int(os.environ.get("RANK", "0")) == 0:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def check_gpu_count(local_ranks: int, backend: str | None = None) -> None:
    """Refuse more ranks on this host than CUDA devices when the ranks would run on CUDA.

    ``init_parallel`` runs the ranks over NCCL, one GPU each (``cuda:<LOCAL_RANK>``), whenever CUDA is available
    (``backend`` None or ``"nccl"``); NCCL refuses two ranks on one GPU. The launcher applies this rule before any
    rank starts, and each rank again in ``init_parallel``. Calls only ``torch.cuda.is_available`` and
    ``device_count`` (no tensor is made on a GPU).

    Raises:
        ValueError: ``local_ranks`` > ``torch.cuda.device_count()`` on a machine with CUDA, naming both numbers and
            what would work.
    """
    import torch
    if backend not in (None, "nccl") or not torch.cuda.is_available():
        return
    gpus = torch.cuda.device_count()
    if local_ranks > gpus:
        raise ValueError(f"{local_ranks} ranks on this host but CUDA sees {gpus} GPU{'s' * (gpus != 1)}: NCCL needs "
                         f"one GPU per rank; use at most {gpus} rank{'s' * (gpus != 1)} per host (the product of the "
                         f"parallel degrees: --tp and the others the command takes), "
                         f"or hide the GPUs (CUDA_VISIBLE_DEVICES=) to run every rank on CPU over gloo")


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def machine_ranks(proc: str = "/proc") -> int | None:
    """Ranks of this torchrun job that run on this machine's kernel, and so share its cores; None outside torchrun.

    The processes in ``proc`` whose environment names this job (``TORCHELASTIC_RUN_ID``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` equal to ours) counted by their ``RANK``, at least ``LOCAL_WORLD_SIZE``. Hosts that are network
    namespaces (or containers without a PID namespace) of one machine (:mod:`tensorpar.nshosts`) see each other's
    ranks here; ranks on other machines, or whose environment this user may not read, are not counted."""
    keys = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")
    if not under_torchrun() or not all(k in os.environ for k in keys):
        return None
    ours = [f"{k}={os.environ[k]}".encode() for k in keys]
    ranks = {os.environ.get("RANK")}
    try:
        pids = [d for d in os.listdir(proc) if d.isdigit()]
    except OSError:
        pids = []
    for pid in pids:
        try:
            with open(os.path.join(proc, pid, "environ"), "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if all(k in env for k in ours):
            rank = next((e[5:].decode() for e in env if e.startswith(b"RANK=")), None)
            if rank is not None:
                ranks.add(rank)
    return max(len(ranks - {None}), int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def rank_thread_count(local_world_size: int, cores: int | None = None) -> int:
    """Torch threads of each of ``local_world_size`` ranks on this host: ``TENSORPAR_THREADS`` where set, else an
    equal share of ``cores`` (:func:`usable_cores` by default), at least 1. The one rule of
    :func:`tensorpar.parallel.set_rank_threads` (the ranks) and of the planner's rank device
    (:func:`tensorpar.train.autoplan.rank_device`)."""
    env = os.environ.get("TENSORPAR_THREADS")
    if env:
        return int(env)
    return max(1, (usable_cores() if cores is None else cores) // max(local_world_size, 1))


@contextlib.contextmanager
def locked_folder(folder: str, what: str = "--out") -> Iterator[None]:
    """Hold the exclusive lock of a folder a run writes into (``<folder>/.lock``, :func:`tensorpar.cache.file_lock`)
    while the block runs; refuse at once, without waiting, when another process holds it. The kernel drops a
    ``flock`` with the holder's last file descriptor, so a crashed or killed run releases it too. The lock file is
    removed when the block ends, and so are the folders the lock made (``folder`` and missing parents) that hold
    nothing else (a refused run leaves the file system as it found it); a killed run leaves its ``.lock``, which
    the next run takes over.

    Raises:
        ValueError: another run holds the lock (one line naming ``what``, the folder and the holder), or ``folder``
            is a file.
    """
    from tensorpar.cache import file_lock

    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"{what} {folder!r} is a file, not a folder; choose a folder for the run's outputs")
    made = []       # the folders the lock makes (``folder`` and its missing parents), innermost first
    d = os.path.abspath(folder)
    while not os.path.exists(d) and os.path.dirname(d) != d:
        made.append(d)
        d = os.path.dirname(d)
    path = os.path.join(folder, ".lock")
    with file_lock(path, busy=f"{what} {folder!r} is in use by another run; wait for it to end, or choose another "
                              f"{what} folder"):
        try:
            yield
        finally:
            try:   # still held: a run that locks the removed file after this sees so and locks a new one
                os.unlink(path)
                for d in made:      # each left empty: a refused run leaves no folder behind
                    if os.listdir(d):
                        break
                    os.rmdir(d)
            except OSError:
                pass


def run_ranks(fn: Callable[..., Any], nproc: int, *args, verbose: bool = False) -> int:
    """Run ``fn(*args)`` on ``nproc`` local ranks; return a process exit code (0 = all ranks succeeded).

    ``fn`` must be a top-level function (it is pickled to spawned processes). Under torchrun it is
    called once, in this process (errors then propagate to the caller). A failing rank stops all others
    within :data:`SHUTDOWN_TIMEOUT_S` seconds; its error is printed as one line (``tensorpar: error: ...
    (rank R)``, exit code 1), or with its traceback when ``verbose``. Ctrl-C stops every rank (exit 130).
    More ranks than usable cores is allowed (each rank then gets one thread) and prints a one-line warning.

    Raises:
        ValueError: ``TENSORPAR_THREADS`` is set but not a positive integer, ``GLOO_SOCKET_IFNAME`` names an
            interface this host lacks, or the ranks would run on CUDA and this host has fewer GPUs than ranks
            (:func:`check_gpu_count`), before anything starts.
    """
    check_socket_ifname()                       # the rules the ranks apply in init_parallel
    if not under_torchrun():
        check_gpu_count(nproc)
    threads = os.environ.get("TENSORPAR_THREADS", "")
    if threads and not (threads.isdigit() and int(threads) >= 1):
        raise ValueError(f"TENSORPAR_THREADS={threads!r}: must be a positive integer (torch threads per rank), "
                         f"or unset")
    if under_torchrun() or nproc == 1 and "RANK" not in os.environ:
        if under_torchrun():
            if "TORCHELASTIC_RUN_ID" in os.environ:     # the agent is the parent: a rank does not outlive it
                watch_agent()
            return int(fn(*args) or 0)
        # one rank in this process: set the launch variables for fn, then restore them, so that later code in
        # this process (or a child it starts) does not read the leftovers as a torchrun launch
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        saved_env = {k: os.environ.get(k) for k in names}
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        # a one-rank process group still needs a store: a free loopback port, never a fixed one
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        try:
            rc = fn(*args)
        finally:
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        return int(rc or 0)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    cores = usable_cores()
    if nproc > cores and not os.environ.get("TENSORPAR_THREADS"):
        print(f"tensorpar: warning: {nproc} ranks on {cores} usable cores; ranks share cores (one thread each) "
              f"and run slower than with tp <= {cores}", file=sys.stderr, flush=True)
    if sys.stderr.isatty():  # starting ranks takes seconds (each imports torch): say so on a terminal
        print(f"tensorpar: starting {nproc} ranks ...", file=sys.stderr, flush=True)
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(LOOPBACK_RDZV, _loopback_rendezvous)  # idempotent (same function)
    cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                       rdzv_backend=LOOPBACK_RDZV, rdzv_endpoint="127.0.0.1:0", local_addr="127.0.0.1",
                       max_restarts=0, monitor_interval=0.1, start_method="spawn",
                       shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    # the ranks' own sockets (gloo's pairs, NCCL's bootstrap) on loopback too, unless the user chose an interface
    saved_ifnames = {k: os.environ.get(k) for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    for k, v in saved_ifnames.items():
        if v is None:
            os.environ[k] = "lo"
    saved = {}
    if not verbose:  # the launcher logs every failure with a traceback; we print one line instead
        for name in _LAUNCHER_LOGGERS:
            lg = logging.getLogger(name)
            saved[name] = lg.level
            lg.setLevel(logging.CRITICAL + 1)
    error_dir = tempfile.mkdtemp(prefix="tensorpar-errors-")
    try:
        results = elastic_launch(cfg, _rank_entry)(fn, verbose, error_dir, *args)
    except ChildFailedError as e:
        line, trace = _failure_line(e)
        if verbose and trace:
            print(trace, file=sys.stderr)
        # a rank's own error first; else the launcher's view (e.g. a rank killed by a signal, which writes no
        # error), followed by what its peers saw
        first = _first_error(error_dir, secondary_too=False)
        if first is None:
            seen = _first_error(error_dir)
            first = line if seen is None else f"{line}; then {seen}"
        print(f"tensorpar: error: {first}", file=sys.stderr, flush=True)
        return 1
    except (KeyboardInterrupt, SignalException):  # the agent stops every rank before this is raised
        print("tensorpar: interrupted; all ranks stopped", file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(error_dir, ignore_errors=True)
        for k, v in saved_ifnames.items():
            if v is None:
                os.environ.pop(k, None)
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)
    return max(int(r or 0) for r in results.values())

