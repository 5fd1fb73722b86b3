"""Hosts on this machine: N network-namespace "hosts" joined by rate-limited links, for tests and benchmarks.

Each host is a Linux network namespace made by the run (its own ``eth0`` with its own address, and ``lo``), plus, for
every process started in it, its own UTS namespace (hostname) and mount namespace, in which a private ``/etc/hosts``
(every host's name and address: torchrun and gloo resolve the host's own name) and, by default, a private
``/dev/shm`` are mounted. The hosts' ``eth0`` ends are joined by a bridge in one more namespace (the "switch");
token-bucket filters (``tc qdisc ... tbf``) on both ends of every link cap each direction at the link rate. Nothing
is added to the machine's own network namespace, so all traffic stays inside namespaces of the run.

Use::

    with NamespaceHosts(2, rate="1gbit") as hosts:
        results = hosts.run_torchrun(["-m", "tensorpar", "generate", "--model", folder], nproc=1)

Every host runs one torchrun agent: c10d rendezvous on host 0's address (:meth:`NamespaceHosts.torchrun_argv`),
``--local-addr`` the host's address, gloo bound to the host's interface (``GLOO_SOCKET_IFNAME=eth0``), the same
commands as on real machines (docs/hosts.md).

Teardown (:meth:`NamespaceHosts.down`: on leaving the ``with``, also when its body raises, and at interpreter exit)
kills the processes still running in the hosts and deletes the namespaces, which deletes the links. Namespace names
carry the creating pid (``tph<pid>-<random>-...``); :func:`sweep_stale` deletes those left by a run that was killed.
Needs root (``CAP_SYS_ADMIN`` and ``CAP_NET_ADMIN``) and the ``ip``, ``tc``, ``unshare`` and ``mount`` commands;
:func:`unavailable` says why not, in one line."""
from tensorpar.nshosts.hosts import IFNAME, RDZV_PORT, NamespaceHosts, NsHost
from tensorpar.nshosts.machine import (OWNERS, PREFIX, RATE_RANGE, addresses_in_use, netns_names, rate_bits,
                                       sweep_stale, unavailable)

__all__ = ["IFNAME", "OWNERS", "PREFIX", "RATE_RANGE", "RDZV_PORT", "NamespaceHosts", "NsHost", "addresses_in_use",
           "netns_names", "rate_bits", "sweep_stale", "unavailable"]
