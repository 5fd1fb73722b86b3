"""Run a torchrun job across N hosts made on this machine (network namespaces joined by rate-limited links).

    sudo python scripts/nshosts.py --hosts 2 --rate 1gbit -- -m tensorpar generate --model smollm2 --tp 2

Everything after ``--`` is what torchrun runs on every host (``-m module args`` or ``script.py args``). One
torchrun agent per host, ``--nproc-per-host`` ranks each, c10d rendezvous on host 0; each host's output is
printed after the run, labelled with its hostname. The hosts, links and every process in them are removed
at the end, also on failure or Ctrl-C. ``--show-commands`` prints each host's torchrun command first:
the same command runs on real machines (docs/hosts.md). Needs root. See :mod:`tensorpar.nshosts`.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tensorpar.nshosts import NamespaceHosts  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="nshosts", description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=2, help="number of namespace hosts")
    p.add_argument("--rate", default="1gbit", help="link rate for tc, e.g. 1gbit, 10gbit; 'none' for no cap")
    p.add_argument("--nproc-per-host", type=int, default=1, help="ranks per host (torchrun --nproc-per-node)")
    p.add_argument("--subnet", default=None, help="IPv4 subnet of the hosts (default a random 10.x.y.0/24)")
    p.add_argument("--prefix", default=None, help="namespace name prefix (default tph<pid>-<random>)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before the hosts are killed")
    p.add_argument("--show-commands", action="store_true", help="print each host's torchrun command")

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
    try:
        hosts = NamespaceHosts(args.hosts, None if args.rate == "none" else args.rate, prefix=args.prefix,
                               subnet=args.subnet)
    except (ValueError, RuntimeError) as e:   # bad input or no namespaces here: one line, nothing started
        print(f"nshosts: error: {e}", file=sys.stderr)
        return 2
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    with hosts:
        if args.show_commands:
            for h in hosts.hosts:
                print(f"# host {h.hostname} ({h.addr}): GLOO_SOCKET_IFNAME=eth0 "
                      + shlex.join(hosts.torchrun_argv(h.index, args.nproc_per_host, cmd)), flush=True)
        res = hosts.run_torchrun(cmd, args.nproc_per_host, timeout_s=args.timeout, env=env)
    for h, (rc, out, err) in zip(hosts.hosts, res):
        print(f"===== {h.hostname} ({h.addr}) exit {rc}", flush=True)
        sys.stdout.write(out)
        sys.stderr.write(err)
    return next((rc if rc > 0 else 1 for rc, _, _ in res if rc), 0)   # killed by a signal: 1


if __name__ == "__main__":
    sys.exit(main())
