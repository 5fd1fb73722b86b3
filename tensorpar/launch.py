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
a couple of seconds (:data:`SHUTDOWN_TIMEOUT_S`).
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
import sys
import tempfile
import uuid
from typing import Any, Callable, Iterator

# One default for every command (issue 14, item 7).
DEFAULT_TP = 2
DEFAULT_TIMEOUT_S = 300.0
# Seconds the launcher waits, after SIGTERM, for the ranks left running when one failed before it
# kills them (torch's default is 30 s, which a stopped rank always uses up).
SHUTDOWN_TIMEOUT_S = 2

_LAUNCHER_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing",
                     "torch.distributed.elastic.multiprocessing.api",
                     "torch.distributed.elastic.agent.server.api",
                     "torch.distributed.elastic.agent.server.local_elastic_agent",
                     "torch.distributed.elastic.rendezvous.dynamic_rendezvous")


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


def under_torchrun() -> bool:
    """True inside a process started by torchrun / torch elastic."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def rank0_print(*args, **kwargs) -> None:
    """Print from global rank 0 only (reads ``RANK``; prints everything outside a launch)."""
    if int(os.environ.get("RANK", "0")) == 0:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def one_line(e: BaseException) -> str:
    """The message of ``e`` on one line: ``ValueError``/``OSError``/collective text as is, other types
    prefixed with their name (an unexpected error should say what it is). A collective that timed out
    gets a hint: a peer rank stopped, hung or died."""
    text = " ".join(str(e).split()) or type(e).__name__
    text = re.sub(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\] ", "", text)  # C++ source locations of gloo / c10d
    # gloo's advice after a peer's socket closed ("This is typically caused by a remote worker hanging ... GLHF!")
    text, advice = re.subn(r"\s*This is typically caused by a remote worker.*$", "", text)
    if type(e).__name__ == "CollectiveError":
        if advice:
            text += " - another rank exited or closed its connection during this collective"
        elif "timed out" in text.lower():
            text += " - another rank stopped, hung or died before reaching this collective (a rank that is only " \
                    "slow needs a larger --timeout)"
        return text
    if isinstance(e, (ValueError, OSError, KeyError)) and not isinstance(e, (TimeoutError, ConnectionError)):
        return text
    return f"{type(e).__name__}: {text}"


def report_error(message: str, prog: str = "tensorpar") -> None:
    """Print ``<prog>: error: <message>`` as one line on stderr; under torchrun also write it, in torch elastic's
    error-file format, to ``TORCHELASTIC_ERROR_FILE``.

    torchrun sets that variable for each worker and, when the worker exits non-zero, shows the file's
    ``py_callstack`` (else its ``message``) in its ``ChildFailedError`` summary, the first failure by the file's
    ``timestamp`` as the root cause (``torch.distributed.elastic.multiprocessing.errors``; ``@record`` writes the
    same JSON with a Python traceback). Without the file that summary says only "To enable traceback see ...";
    with it, the summary repeats this one line. The file is written atomically (temp + rename); a failure to
    write it is ignored (the line on stderr is what matters).
    """
    import json
    import time

    line = f"{prog}: error: {' '.join(str(message).split())}"
    print(line, file=sys.stderr, flush=True)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE") if under_torchrun() else None
    if not path:
        return
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass


@contextlib.contextmanager
def locked_folder(folder: str, what: str = "--out") -> Iterator[None]:
    """Hold the exclusive lock of a folder a run writes into (``<folder>/.lock``, :func:`tensorpar.cache.file_lock`)
    while the block runs; refuse at once, without waiting, when another process holds it. The kernel drops a
    ``flock`` with the holder's last file descriptor, so a crashed or killed run releases it too. The lock file is
    removed when the block ends, and so is a folder the lock made that holds nothing else (a refused run leaves the
    folder as it found it); a killed run leaves its ``.lock``, which the next run takes over.

    Raises:
        ValueError: another run holds the lock (one line naming ``what``, the folder and the holder), or ``folder``
            is a file.
    """
    from tensorpar.cache import file_lock

    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"{what} {folder!r} is a file, not a folder; choose a folder for the run's outputs")
    created = not os.path.exists(folder)
    path = os.path.join(folder, ".lock")
    with file_lock(path, busy=f"{what} {folder!r} is in use by another run; wait for it to end, or choose another "
                              f"{what} folder"):
        try:
            yield
        finally:
            try:   # still held: a run that locks the removed file after this sees so and locks a new one
                os.unlink(path)
                if created and not os.listdir(folder):
                    os.rmdir(folder)
            except OSError:
                pass


class RankError(Exception):
    """Raised inside a rank, in place of the original exception, with the one-line message to show."""


def _stopped_siblings() -> list[int]:
    """Pids of the other ranks of this launch that are stopped (state ``T``: SIGSTOP, a debugger, Ctrl-Z of one
    process). Linux only (``/proc``); ranks are the launcher's ``spawn_main`` children."""
    ppid, me, found = os.getppid(), os.getpid(), []
    try:
        tasks = os.listdir(f"/proc/{ppid}/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/{ppid}/task/{tid}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except (OSError, ValueError):
            continue
        for pid in kids:
            if pid == me:
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    ours = b"spawn_main" in f.read()
                if state == "T" and ours:
                    found.append(pid)
            except (OSError, IndexError):
                continue
    return found


def _end_stopped(pids: list[int]) -> None:
    """End stopped ranks at once: SIGTERM, then SIGCONT (what ``kill`` in a shell and systemd do to a stopped job).

    A stopped process only queues SIGTERM, and torch's launcher would wait its whole shutdown timeout for it
    (30 s by default). The SIGTERM is queued first so that the rank dies the moment it continues, without
    running another line: continued alone, it went on with its program, ran into its next collective, failed
    there once the first rank had exited, and exited through Python with its gloo process group still alive,
    which now and then aborted in C++ ("terminate called without an active exception" and a stack on stderr,
    after the one-line error; pytorch/pytorch#65231, #179291)."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGCONT):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass


def _release_process_group(timeout_s: float) -> None:
    """Destroy torch.distributed's process groups, if this rank has any, while the interpreter is still whole;
    wait at most ``timeout_s`` seconds.

    A rank that exits with its gloo process group alive, after a collective failed or timed out, now and then
    aborts in C++ while Python shuts down ("terminate called without an active exception", "Fatal Python error:
    Aborted", on stderr next to the one-line error): the group's worker threads and pending work are torn down
    with the interpreter (pytorch/pytorch#65231, #179291; the fix there is ``destroy_process_group`` before
    exit). Bounded, in a helper thread: a group whose work still waits on a peer is left as it is after
    ``timeout_s`` (the launcher ends the rank within :data:`SHUTDOWN_TIMEOUT_S` anyway). Errors are ignored.
    """
    import threading

    dist = sys.modules.get("torch.distributed")  # never imported here just for this
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        return

    def destroy():
        try:
            dist.destroy_process_group()
        except Exception:
            pass

    t = threading.Thread(target=destroy, name="tensorpar-destroy-process-group", daemon=True)
    t.start()
    t.join(timeout_s)


def _rank_entry(fn: Callable[..., Any], verbose: bool, error_dir: str, *args) -> Any:
    """What the launcher runs on each rank: ``fn(*args)``, turning an error into a one-line :class:`RankError`.

    The one-line message also goes to ``<error_dir>/rank<R>.json`` with the time it happened, so that the
    launcher reports the rank that failed first (torch records only the first process it sees exit). Then
    the ranks of this launch that are stopped are ended (:func:`_end_stopped`) and this rank's process groups
    destroyed (:func:`_release_process_group`), so that no rank aborts in C++ on its way out.
    Top level so that it pickles. With ``verbose`` the original exception (and traceback) passes through.
    """
    import json
    import time

    rank = os.environ.get("RANK", "?")
    try:
        with open(os.path.join(error_dir, f"pid-{os.getpid()}"), "w") as f:  # who is who, for the error
            f.write(rank)
    except OSError:
        pass
    try:
        return fn(*args)
    except Exception as e:
        line = one_line(e)
        stopped_pids, stopped = _stopped_siblings(), []
        for pid in stopped_pids:
            try:
                with open(os.path.join(error_dir, f"pid-{pid}")) as f:
                    stopped.append(f"rank {f.read()}")
            except OSError:
                stopped.append(f"pid {pid}")
        if stopped:
            line += f"; {', '.join(sorted(stopped))} had been stopped (SIGSTOP / Ctrl-Z)"
        try:
            tmp = os.path.join(error_dir, f".rank{rank}.tmp")
            with open(tmp, "w") as f:
                json.dump({"time": time.time(), "rank": rank, "message": line}, f)
            os.replace(tmp, os.path.join(error_dir, f"rank{rank}.json"))
        except OSError:
            pass
        _end_stopped(stopped_pids)  # after the error is on record: the launcher reports this rank's error
        _release_process_group(SHUTDOWN_TIMEOUT_S)
        if verbose:
            raise
        raise RankError(line) from None


def _first_error(error_dir: str, secondary_too: bool = True) -> str | None:
    """``message (rank R)`` of the earliest error written by :func:`_rank_entry`, passing over the secondary
    ones (a peer that lost its connection because the first rank exited); None if no rank wrote one (or, with
    ``secondary_too=False``, none but secondary ones)."""
    import glob
    import json

    found = []
    for path in glob.glob(os.path.join(error_dir, "rank*.json")):
        try:
            with open(path) as f:
                found.append(json.load(f))
        except (OSError, ValueError):
            continue
    if not found:
        return None
    found.sort(key=lambda r: r["time"])
    primary = [r for r in found if not _SECONDARY.search(r["message"])]
    if secondary_too or primary:
        r = (primary or found)[0]
        return f"{r['message']} (rank {r['rank']})"
    return None


_SECONDARY = re.compile(r"connection closed by peer|connection reset by peer|remote worker crash|broken pipe|"
                        r"signal \d+|sigterm|sigkill|closed its communicator|exited without arriving|"
                        r"another rank exited or closed its connection", re.IGNORECASE)


def _failure_line(err) -> tuple[str, str]:
    """``(one-line message, full traceback text)`` of the rank that failed first for its own reason.

    When one rank fails, its peers fail too (their collectives lose the peer, or the launcher kills them),
    sometimes within the same second (the error files' resolution): those secondary failures are passed
    over in favour of a rank whose error is not one of them.
    """
    def text(failure):
        msg, trace = failure.message, ""
        if isinstance(msg, dict):
            trace = str(msg.get("extraInfo", {}).get("py_callstack", ""))
            msg = msg.get("message", "")
        msg = str(msg or "").strip()
        if failure.exitcode < 0:  # killed by a signal: no Python error to show
            msg = f"killed by signal {failure.signal_name()} (out of memory? killed by hand?)"
        elif not msg or msg.startswith("To enable traceback"):  # exited without an error file
            msg = f"exited with code {failure.exitcode}"
        if msg.startswith("RankError: "):
            msg = msg[len("RankError: "):]
        return " ".join(msg.split()), trace

    order = sorted(err.failures.items(), key=lambda kv: (kv[1].timestamp, kv[0]))
    primary = [(r, f) for r, f in order if not _SECONDARY.search(text(f)[0])]
    rank, failure = (primary or order)[0]
    msg, trace = text(failure)
    return f"{msg} (rank {rank})", trace


def run_ranks(fn: Callable[..., Any], nproc: int, *args, verbose: bool = False) -> int:
    """Run ``fn(*args)`` on ``nproc`` local ranks; return a process exit code (0 = all ranks succeeded).

    ``fn`` must be a top-level function (it is pickled to spawned processes). Under torchrun it is
    called once, in this process (errors then propagate to the caller). A failing rank stops all others
    within :data:`SHUTDOWN_TIMEOUT_S` seconds; its error is printed as one line (``tensorpar: error: ...
    (rank R)``, exit code 1), or with its traceback when ``verbose``. Ctrl-C stops every rank (exit 130).
    More ranks than usable cores is allowed (each rank then gets one thread) and prints a one-line warning.

    Raises:
        ValueError: ``TENSORPAR_THREADS`` is set but not a positive integer (before anything starts).
    """
    threads = os.environ.get("TENSORPAR_THREADS", "")
    if threads and not (threads.isdigit() and int(threads) >= 1):
        raise ValueError(f"TENSORPAR_THREADS={threads!r}: must be a positive integer (torch threads per rank), "
                         f"or unset")
    if under_torchrun() or nproc == 1 and "RANK" not in os.environ:
        if under_torchrun():
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

