"""Run a torchrun job across N hosts made on this machine (network namespaces joined by rate-limited links).

    sudo python scripts/nshosts.py --hosts 2 --rate 1gbit -- -m tensorpar generate --model smollm2 --tp 2

Everything after ``--`` is what torchrun runs on every host (``-m module args`` or ``script.py args``). One
torchrun agent per host, ``--nproc-per-host`` ranks each, c10d rendezvous on host 0; each host's output is
printed as it comes, each line after its hostname in brackets. When a host fails, torchrun's own report of the
failure (its traceback, ``ChildFailedError`` and the "Root Cause" block; its traceback when it is stopped) and C++
stack frames are left out (``--verbose`` shows them): the ranks' own lines stay, then one line per failed host with
its exit code. The hosts, links and every process in them are removed at the end, also on failure, Ctrl-C or
SIGTERM / SIGHUP (``timeout``, ``kill``, a cancelled job): the hosts' processes get SIGTERM and 10 s to end first.
``--show-commands`` prints each host's torchrun command first: the same command runs on real machines
(docs/hosts.md). Needs root. See :mod:`tensorpar.nshosts`.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tensorpar.nshosts import NamespaceHosts  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="nshosts", description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=2, help="number of namespace hosts")
    p.add_argument("--rate", default="1gbit", help="link rate for tc, 1mbit-1000gbit, e.g. 1gbit, 10gbit; 'none' for "
                                                   "no cap")
    p.add_argument("--nproc-per-host", type=int, default=1, help="ranks per host (torchrun --nproc-per-node)")
    p.add_argument("--subnet", default=None, help="IPv4 subnet of the hosts (default a random 10.x.y.0/24)")
    p.add_argument("--prefix", default=None, help="namespace name prefix (default tph<pid>-<random>)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before the hosts are killed")
    p.add_argument("--show-commands", action="store_true", help="print each host's torchrun command")
    p.add_argument("--verbose", action="store_true", help="also show torchrun's failure reports and C++ frames")

    def refuse(message: str):          # one line, as every other refusal of the script (no usage block)
        print(f"nshosts: error: {message}", file=sys.stderr)
        raise SystemExit(2)
    p.error = refuse
    if "--" not in argv:
        if "-h" in argv or "--help" in argv:
            p.parse_args(argv)   # prints the help and exits 0
        p.error("give the torchrun target after '--', e.g. -- -m tensorpar generate --tp 2")
    cut = argv.index("--")
    args, cmd = p.parse_args(argv[:cut]), argv[cut + 1:]
    if not cmd:
        p.error("nothing to run after '--'")
    if args.nproc_per_host < 1:
        p.error(f"--nproc-per-host must be >= 1, got {args.nproc_per_host}")
    if not args.timeout > 0:
        p.error(f"--timeout must be > 0 seconds, got {args.timeout:g}")

    def stop(signum, frame):                  # SIGINT, SIGTERM, SIGHUP: one teardown
        raise KeyboardInterrupt
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):     # SIGINT too: a shell's `cmd &` ignores it
        signal.signal(sig, stop)
    try:
        hosts = NamespaceHosts(args.hosts, None if args.rate.lower() == "none" else args.rate, prefix=args.prefix,
                               subnet=args.subnet)
        hosts.up()                            # undoes what it made if it fails or is interrupted
    except (ValueError, RuntimeError) as e:   # bad input, no namespaces here, or a name taken meanwhile: one line
        print(f"nshosts: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("nshosts: interrupted while making the hosts; nothing is left", file=sys.stderr)
        return 130
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    show = _Shown(hosts, args.verbose)
    try:
        if args.show_commands:
            for h in hosts.hosts:
                print(f"# host {h.hostname} ({h.addr}): GLOO_SOCKET_IFNAME=eth0 "
                      + shlex.join(hosts.torchrun_argv(h.index, args.nproc_per_host, cmd)), flush=True)
        res = hosts.run_torchrun(cmd, args.nproc_per_host, timeout_s=args.timeout, env=env, on_line=show.line)
    except KeyboardInterrupt:
        _ignore_signals()                     # a second signal does not cut the teardown short
        hosts.stop(grace_s=10)
        show.summary()
        print("nshosts: interrupted; the hosts and every process in them are removed", file=sys.stderr)
        return 130
    finally:
        _ignore_signals()                     # nor one that comes while the hosts are deleted after the run
        hosts.down()
    for h, (rc, _, _) in zip(hosts.hosts, res):
        if rc:
            why = f" ({hosts.killed[h.index]})" if h.index in hosts.killed else show.cause(h.index)
            print(f"nshosts: host {h.hostname} ({h.addr}): torchrun exit {rc}{why}", file=sys.stderr)
    show.summary()
    return next((rc if rc > 0 else 1 for rc, _, _ in res if rc), 0)   # killed by a signal: 1


def _ignore_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)


#: torchrun's agent stopping its ranks, its log lines: after a rank failed ("... failed (exitcode: N) ...", "Sending
#: process N closing signal ..."), or when it got a signal ("Received N death signal ...")
_REPORT = re.compile(r"^[EWI]\d{4} .*(failed \(exitcode: -?\d+\)|Sending process \d+ closing signal|"
                     r"Received \d+ death signal)")
#: what follows in the agent's report: its log lines, its traceback and exception (torch.distributed.elastic...),
#: the "Failures" / "Root Cause" block, and the ranks' c10d warnings as their store goes away ("[W1203 ...
#: TCPStore.cpp ...] ... Broken pipe", "<omitting python frames>"); a rank's own lines do not look like these and stay
_REPORT_LINE = re.compile(r"^(\[?[EWI]\d{4} \d\d:\d\d:\d\d|\s|Traceback \(most recent call last\)|During handling of|"
                          r"The above exception|torch\.distributed\.elastic|=+\s*$|-+\s*$|Failures:|Root Cause|"
                          r"\[\d+\]:|\S+ FAILED\s*$|<omitting python frames>)")
_FIELD = re.compile(r"^\s*(rank|exitcode|traceback)\s*: (.*)$")
_FRAME = re.compile(r"^(frame #\d+: |Exception raised from )")


class _Shown:
    """The hosts' lines as they come, each after ``[hostname]``. Unless ``verbose``, left out (and counted): C++
    stack frames, and the report of torchrun's agent once it stops its ranks (from one of :data:`_REPORT`'s lines
    on, the lines that look like :data:`_REPORT_LINE`), whose "Root Cause" rank, exit code and recorded error line
    :meth:`cause` gives."""

    def __init__(self, hosts, verbose: bool):
        self.names = [h.hostname for h in hosts.hosts]
        self.verbose, self.left_out = verbose, 0
        self.in_report: set[int] = set()
        self.root: set[int] = set()
        self.fields: dict[int, dict] = {}
        self.lock = threading.Lock()

    def line(self, k: int, name: str, text: str) -> None:
        with self.lock:
            if not self.verbose and name == "err" and self._left_out(k, text):
                self.left_out += 1
                return
            out = sys.stdout if name == "out" else sys.stderr
            out.write(f"[{self.names[k]}] {text}" + ("" if text.endswith("\n") else "\n"))
            out.flush()

    def _left_out(self, k: int, text: str) -> bool:
        if _FRAME.match(text):
            return True
        if _REPORT.match(text):
            self.in_report.add(k)
        if k not in self.in_report or not _REPORT_LINE.match(text):
            return False
        if text.startswith("Root Cause"):        # its entry, not the first of "Failures"
            self.root.add(k)
        m = _FIELD.match(text)
        if m and k in self.root:
            self.fields.setdefault(k, {}).setdefault(m.group(1), m.group(2).strip())
        return True

    def cause(self, k: int) -> str:
        """``" (rank R: exit code C)"`` from host ``k``'s root cause, with the error line a rank recorded."""
        f = self.fields.get(k, {})
        if not f:
            return ""
        tb = f.get("traceback", "")
        said = "" if not tb or tb.startswith("To enable traceback") else f"; {tb}"
        rank, code = (f.get(key, "?").split()[0] or "?" for key in ("rank", "exitcode"))    # "0 (local_rank: 0)"
        return f" (rank {rank}: exit code {code}{said})"

    def summary(self) -> None:
        if self.left_out:
            print(f"nshosts: {self.left_out} lines of torchrun's own report and C++ stack frames left out "
                  f"(--verbose shows them)", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
