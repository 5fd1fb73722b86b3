"""The namespace hosts themselves (:mod:`tensorpar.nshosts`): making them, running torchrun agents in them,
tearing them down."""
from __future__ import annotations

import atexit
import ipaddress
import itertools
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from tensorpar.nshosts.machine import (OWNERS, PREFIX, _kill_inside, _sh, addresses_in_use, delete_ns, netns_names,
                                       rate_bits, sweep_stale, unavailable)

IFNAME = "eth0"
RDZV_PORT = 29400          # free in any case: the hosts' network namespaces are new

# Run in the new UTS and mount namespaces of a host: $0 hostname, $1 hosts file, $2 private shm, then the command.
_SETUP = ('hostname "$0" && mount --bind "$1" /etc/hosts && '
          '{ [ "$2" = 0 ] || mount -t tmpfs -o mode=1777 tmpfs /dev/shm; } && shift 2 && exec "$@"')


@dataclass(frozen=True)
class NsHost:
    """One namespace host: its network namespace, hostname, address on ``eth0``."""

    index: int
    netns: str
    hostname: str
    addr: str


class NamespaceHosts:
    """``n`` namespace hosts on one bridge, each link capped at ``rate`` in each direction.

    Args:
        n: number of hosts (>= 1).
        rate: link rate for ``tc`` (``"1gbit"``, ``"10gbit"``), or None for no cap.
        prefix: namespace name prefix; default ``tph<pid>-<4 random hex digits>`` (host ``i`` is ``<prefix>-h<i>``,
            the switch ``<prefix>-sw``), so runs in one process may overlap.
        subnet: a /24 or larger IPv4 network; host ``i`` gets its ``i + 1``-th address. Default
            ``10.<random>.<random>.0/24``.
        hostnames: one name per host; default ``<prefix>-h<i>`` (``_`` and ``.`` as ``-``). Names may repeat (a
            misconfigured cluster): ranks are still told apart by their network namespace.
        private_shm: give each host its own ``/dev/shm`` (as on separate machines).

    Raises (in the constructor, before anything is made or started):
        ValueError: a bad ``n``, ``rate``, ``subnet`` or ``hostnames``; a namespace name or an address already in
            use on this machine (one line naming it).
        RuntimeError: namespace hosts cannot be made here (:func:`unavailable`).
    """

    def __init__(self, n: int, rate: str | None = "1gbit", *, prefix: str | None = None, subnet: str | None = None,
                 hostnames: list[str] | None = None, private_shm: bool = True):
        why = unavailable()
        if why:
            raise RuntimeError(why)
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"number of hosts must be a positive integer, got {n!r}")
        self.rate_bits = rate_bits(rate) if rate is not None else None
        self.rate, self.private_shm = rate, private_shm
        token = secrets.token_bytes(2)
        self.prefix = prefix if prefix is not None else f"{PREFIX}{os.getpid()}-{token.hex()}"
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,39}$", self.prefix):
            raise ValueError(f"namespace prefix must be 1-40 letters, digits, '_', '.', '-', starting with a letter "
                             f"or digit, got {self.prefix!r}")
        subnet = subnet or f"10.{token[0]}.{token[1]}.0/24"
        try:
            net = ipaddress.IPv4Network(subnet, strict=False)
        except ValueError as e:
            raise ValueError(f"subnet must be an IPv4 network such as 10.77.0.0/24, got {subnet!r} ({e})") from None
        if net.num_addresses - 2 < n:
            raise ValueError(f"subnet {subnet} has room for {max(net.num_addresses - 2, 0)} hosts, not {n}")
        names = hostnames or [re.sub(r"[^A-Za-z0-9-]", "-", f"{self.prefix}-h{i}") for i in range(n)]
        if len(names) != n or not all(re.match(r"^[A-Za-z0-9][A-Za-z0-9-]{0,62}$", h) for h in names):
            raise ValueError(f"hostnames must be {n} names of letters, digits and '-', got {hostnames!r}")
        addrs = [str(a) for a in itertools.islice(net.hosts(), n)]
        self.prefixlen = net.prefixlen
        self.hosts = [NsHost(i, f"{self.prefix}-h{i}", names[i], addrs[i]) for i in range(n)]
        self.switch = f"{self.prefix}-sw"
        sweep_stale()
        taken = [ns for ns in netns_names() if ns == self.switch or ns.startswith(self.prefix + "-")]
        if taken:
            raise ValueError(f"namespace name {taken[0]!r} is already in use on this machine (ip netns list); "
                             f"choose another prefix than {self.prefix!r} or delete it (ip netns del {taken[0]})")
        used = addresses_in_use()
        clash = [h.addr for h in self.hosts if h.addr in used]
        if clash:
            raise ValueError(f"address {clash[0]} is already in use ({used[clash[0]]}); choose another subnet than "
                             f"{subnet}")
        self._made: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self.killed: dict[int, str] = {}
        self._dir: str | None = None

    # ------------------------------------------------------------------ set-up and teardown

    def up(self) -> "NamespaceHosts":
        """Make the namespaces, links, rate caps and hosts files. On any failure, undo and raise."""
        atexit.register(self.down)
        try:
            self._dir = tempfile.mkdtemp(prefix=f"{self.prefix}-")
            self._add_ns(self.switch)
            _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
            for h in self.hosts:
                port = f"p{h.index}"
                self._add_ns(h.netns)
                _sh("ip", "-n", h.netns, "link", "add", IFNAME, "type", "veth", "peer", "name", port,
                    "netns", self.switch)
                _sh("ip", "-n", h.netns, "addr", "add", f"{h.addr}/{self.prefixlen}", "dev", IFNAME)
                for ns, dev in ((h.netns, "lo"), (h.netns, IFNAME), (self.switch, port)):
                    _sh("ip", "-n", ns, "link", "set", dev, "up")
                _sh("ip", "-n", self.switch, "link", "set", port, "master", "br0")
                if self.rate_bits is not None:
                    self._cap(h.netns, IFNAME)       # what the host sends
                    self._cap(self.switch, port)     # what it receives
                # its own line first: a hostname that repeats resolves to the host's own address; the IPv4-mapped
                # IPv6 forms name the peers of c10d's dual-stack sockets (else a lookup warning per connection)
                order = sorted(self.hosts, key=lambda o: o.index != h.index)
                lines = ["127.0.0.1 localhost", "::1 localhost", "::ffff:127.0.0.1 localhost"]
                lines += [f"{o.addr} {o.hostname}" for o in order] + [f"::ffff:{o.addr} {o.hostname}" for o in order]
                with open(os.path.join(self._dir, f"hosts{h.index}"), "w") as f:
                    f.write("\n".join(lines) + "\n")
        except BaseException:
            self.down()
            raise
        return self

    def _add_ns(self, ns: str) -> None:
        r = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True)
        if r.returncode:           # another run made it since the constructor's check: the same one line
            if "exists" in r.stderr:
                raise ValueError(f"namespace name {ns!r} is already in use on this machine (ip netns list); choose "
                                 f"another prefix than {self.prefix!r}")
            raise RuntimeError(f"ip netns add {ns} failed (exit {r.returncode}): {r.stderr.strip()}")
        self._made.append(ns)
        try:
            os.makedirs(OWNERS, exist_ok=True)
            with open(os.path.join(OWNERS, ns), "w") as f:
                f.write(str(os.getpid()))
        except OSError:            # no owner file: a prefix-named namespace left by a kill stays until deleted
            pass

    def _cap(self, ns: str, dev: str) -> None:
        # burst: 1 ms of traffic (>= 64 KiB, one GSO segment), so the cap holds at the millisecond scale
        burst = max(int(self.rate_bits / 8 / 1000), 65536)
        _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{self.rate_bits:.0f}bit", "burst",
            str(burst), "latency", "100ms")

    def down(self) -> None:
        """Kill what still runs in the hosts, delete the namespaces and the hosts files. Idempotent."""
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._procs = []
        for ns in reversed(self._made):
            delete_ns(ns)
        self._made = []
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        atexit.unregister(self.down)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to every process started in the hosts (torchrun's agents pass it to their ranks, which end as
        on a signal: a server answers its requests and says it stopped), up to ``grace_s`` seconds for them to
        end, then :meth:`down`."""
        live = [p for p in self._procs if p.poll() is None]
        for p in live:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        end = time.monotonic() + grace_s
        while any(p.poll() is None for p in live) and time.monotonic() < end:
            time.sleep(0.1)
        self.down()

    def __enter__(self) -> "NamespaceHosts":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # ------------------------------------------------------------------ running commands in a host

    def command(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` wrapped to run in host ``i``: its network namespace, a new UTS namespace with its hostname
        and a new mount namespace with its ``/etc/hosts`` (and ``/dev/shm``)."""
        h = self.hosts[i]
        return ["ip", "netns", "exec", h.netns, "unshare", "--uts", "--mount", "--propagation", "private", "--",
                "sh", "-c", _SETUP, h.hostname, os.path.join(self._dir, f"hosts{i}"), str(int(self.private_shm)),
                *argv]

    def popen(self, i: int, argv: list[str], **kw) -> subprocess.Popen:
        """Start ``argv`` in host ``i`` (own session, killed by :meth:`down`); ``kw`` as for ``Popen``."""
        p = subprocess.Popen(self.command(i, argv), start_new_session=True, **kw)
        self._procs.append(p)
        return p

    def torchrun_argv(self, i: int, nproc: int, cmd: list[str], *, run_id: str = "nshosts",
                      max_restarts: int = 0) -> list[str]:
        """The torchrun command of host ``i``: ``nproc`` ranks, c10d rendezvous on host 0, then ``cmd``
        (``["-m", "tensorpar", "generate", ...]`` or a script and its arguments); ``max_restarts``: torchrun's
        ``--max-restarts`` (a failed rank on any host restarts every host's ranks)."""
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(self.hosts)),
                "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{self.hosts[0].addr}:{RDZV_PORT}", "--rdzv-id", run_id,
                "--local-addr", self.hosts[i].addr, *cmd]

    def run_torchrun(self, cmd: list[str], nproc: int = 1, *, timeout_s: float = 300.0, env: dict | None = None,
                     on_line=None) -> list[tuple[int, str, str]]:
        """One torchrun agent per host running ``cmd``; ``(returncode, stdout, stderr)`` per host.

        Gloo binds to each host's ``eth0`` (``GLOO_SOCKET_IFNAME``). The hosts share this machine's cores, so
        each rank gets ``cores // (hosts x nproc)`` threads (at least 1) unless ``TENSORPAR_THREADS`` is set: each
        torchrun sees only its own ranks and would give each the whole machine (review: 1-1.8 tokens/s instead of
        30 for SmolLM2 at tp 2 on two cores). A host whose agent has not ended ``timeout_s`` seconds after the start
        is killed with every process in it (returncode -9; :attr:`killed` says why); after the first agent fails,
        the others get 30 s more (their ranks wait for the failed one until their own timeout).
        ``on_line(host index, "out" | "err", line)``: called for each line as it comes (from the threads that read
        the pipes), e.g. to show a server's output while it runs.
        """
        env = dict(os.environ if env is None else env, GLOO_SOCKET_IFNAME=IFNAME)
        env.setdefault("TENSORPAR_THREADS", str(max(1, (os.cpu_count() or 1) // (len(self.hosts) * nproc))))
        env.setdefault("OMP_NUM_THREADS", env["TENSORPAR_THREADS"])    # else torchrun prints its 4-line banner
        procs = [self.popen(i, self.torchrun_argv(i, nproc, cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env) for i in range(len(self.hosts))]
        deadline = time.monotonic() + timeout_s
        outs: dict[tuple[int, str], list[str]] = {}

        def read(k, name, pipe):              # read the pipes while waiting: a full pipe would stall an agent
            lines = outs.setdefault((k, name), [])
            for line in pipe:
                lines.append(line)
                if on_line is not None:
                    on_line(k, name, line)

        readers = [threading.Thread(target=read, args=(k, name, pipe), daemon=True)
                   for k, p in enumerate(procs) for name, pipe in (("out", p.stdout), ("err", p.stderr))]
        for t in readers:
            t.start()
        why = f"killed at the timeout ({timeout_s:g} s)"
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            failed = [k for k, p in enumerate(procs) if p.poll()]
            if failed and time.monotonic() + 30 < deadline:
                deadline = time.monotonic() + 30
                why = f"killed 30 s after host {self.hosts[failed[0]].hostname} failed"
            time.sleep(0.1)
        self.killed = {}                      # host index -> why its agent was killed (returncode -9)
        for k, p in enumerate(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                _kill_inside(self.hosts[k].netns)   # torchrun runs each rank in a session of its own
                self.killed[k] = why
        end = time.monotonic() + 30
        for t in readers:
            t.join(timeout=max(0.0, end - time.monotonic()))
        return [(p.wait(), "".join(outs.get((k, "out"), [])), "".join(outs.get((k, "err"), [])))
                for k, p in enumerate(procs)]
