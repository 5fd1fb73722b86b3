"""What runs around each rank's function, and how a failed rank reaches the user as one line.

:func:`_rank_entry` is what :func:`tensorpar.launch.run_ranks` starts on every rank: it runs the command's rank
function and turns an error into a one-line :class:`RankError`, written with its time to the launch's error folder;
:func:`_first_error` and :func:`_failure_line` pick, in the launching process, the rank that failed first for its
own reason (not a peer that lost its connection because of it). :func:`one_line` and :func:`report_error` are the
one-line form of an error every command prints (``tensorpar: error: ...``). A rank that was stopped (SIGSTOP) is
named and ended (:func:`_end_stopped`), and a failed rank's process groups are destroyed before it exits
(:func:`_release_process_group`), so that no rank aborts in C++ on its way out.
"""
from __future__ import annotations

import os
import re
import sys
from typing import Any, Callable

#: Seconds the launcher waits, after SIGTERM, for the ranks left running when one failed before it kills them
#: (torch's default is 30 s, which a stopped rank always uses up).
SHUTDOWN_TIMEOUT_S = 2


def under_torchrun() -> bool:
    """True inside a process started by torchrun / torch elastic."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def watch_agent(poll_s: float = 1.0) -> None:
    """Under torchrun: end this rank, with one line and exit 1, once its torchrun agent is gone.

    torchrun starts each worker in a session of its own, so an agent that is killed (SIGKILL, the OOM killer) leaves
    its ranks running with no one to stop them: a server across hosts kept serving, and the other hosts' agents
    never heard of it. A daemon thread compares the parent pid with the agent's every ``poll_s`` seconds; once this
    rank has exited, its peers' next collective fails at once (connection reset), naming the collective and the
    hosts. Nothing is done when the parent is already init (a worker started some other way)."""
    import socket
    import threading
    import time
    agent = os.getppid()
    if agent <= 1:
        return

    def watch():
        while os.getppid() == agent:
            time.sleep(poll_s)
        print(f"tensorpar: error: torchrun's agent (pid {agent}) on host {socket.gethostname()} is gone; rank "
              f"{os.environ.get('RANK', '?')} stops", file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="tensorpar-agent-watch", daemon=True).start()


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
