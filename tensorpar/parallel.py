"""Parallel context: process groups for the (dp, pp, cp, tp) rank grid, built once and passed explicitly.

Ranks are laid out as ``arange(world_size).view(dp, pp, cp, tp)`` (tp fastest, then cp), so the ranks of one
tensor-parallel group are consecutive and, under torchrun, on one host whenever
``tp <= nproc_per_node``; the context-parallel (cp) ranks of one tp rank are ``tp`` apart, next to them (both
axes talk every layer). At cp = 1 the order is the one of the (dp, pp, tp) grid. Nothing here is stored in
module globals: :func:`init_parallel` returns a :class:`ParallelContext` and callers hand it (or its ``tp`` group) to whatever needs it.
"""
from __future__ import annotations

import datetime as _dt
import gc
import os
import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tensorpar.comm import Group
from tensorpar.malloc import HeapState

AXES = ("dp", "pp", "cp", "tp")


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees of each parallel axis; their product must equal the world size.

    Attributes:
        tp: tensor-parallel degree (ranks sharing one layer's weights).
        pp: pipeline-parallel degree (stages).
        dp: data-parallel degree (model replicas).
        cp: context-parallel degree (ranks sharing one sequence: each holds ``seq_len / cp`` positions,
            :mod:`tensorpar.layers.ring_attention`).
        tp_weights: relative speed of each tp rank (one positive number per rank; ``"3,1"`` also accepted), or
            ``"auto"`` (measured by :func:`init_parallel`), or ``None`` (even split). :mod:`tensorpar.capacity`.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    tp_weights: tuple[float, ...] | str | None = None
    cp: int = 1

    def __post_init__(self):
        for axis in AXES:
            v = getattr(self, axis)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{axis} must be a positive integer, got {v!r}")
        if self.tp_weights is not None:
            from tensorpar.shard import check_tp_weights
            object.__setattr__(self, "tp_weights", check_tp_weights(self.tp_weights, self.tp))

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def validate(self, world_size: int) -> None:
        """Raise ValueError unless ``dp * pp * cp * tp == world_size``, listing every degree."""
        if self.world_size != world_size:
            cp = f" x cp={self.cp}" if self.cp > 1 else ""
            raise ValueError(
                f"world size {world_size} is not the product of the parallel degrees "
                f"dp={self.dp} x pp={self.pp}{cp} x tp={self.tp} = {self.world_size}; choose degrees whose product is "
                f"{world_size}"
            )

    @classmethod
    def infer(cls, world_size: int, *, tp: int | None = None, pp: int = 1, dp: int | None = None) -> "ParallelConfig":
        """Fill in the one missing degree (dp by default, else tp) from the world size."""
        if tp is None and dp is None:
            tp = world_size // pp
        if dp is None:
            dp = max(world_size // (tp * pp), 1)
        if tp is None:
            tp = max(world_size // (dp * pp), 1)
        cfg = cls(tp=tp, pp=pp, dp=dp)
        cfg.validate(world_size)
        return cfg


@dataclass(eq=False)
class ParallelContext:
    """Process groups of this rank on every axis, plus the rank grid.

    Attributes:
        config: the degrees.
        rank, world_size: global rank and world size.
        device: the device this rank computes on (``cpu`` or ``cuda:<local_rank>``).
        tp, pp, dp, cp: :class:`~tensorpar.comm.Group` handles for this rank's groups on each axis.
        world: every rank (``"world"``; its ``hosts`` set when the ranks are on several hosts, as on the axes).
        grid: ``LongTensor[dp, pp, cp, tp]`` of global ranks.
        tp_weights: the weights to shard with (``config.tp_weights``, measured when that is ``"auto"``), or
            ``None`` for an even split; the same on every rank.
        heap: this process's glibc malloc thresholds (:class:`~tensorpar.malloc.HeapState`).
    """

    config: ParallelConfig
    rank: int
    world_size: int
    device: torch.device
    tp: Group
    pp: Group
    dp: Group
    grid: torch.Tensor
    tp_weights: tuple[float, ...] | None = None
    cp: Group = field(default_factory=lambda: Group.single("cp"))
    world: Group = field(default_factory=lambda: Group.single("world"))
    heap: HeapState = field(default_factory=HeapState, repr=False)
    _mesh: object = field(default=None, repr=False)

    @property
    def mesh(self):
        """A ``DeviceMesh`` over the same groups, named ("dp", "pp", "cp", "tp"), for FSDP2/DDP/pipelining.

        Built on first use; every rank must access it (it creates process groups for size-1 axes).
        """
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh
            groups = []
            for axis in AXES:
                g = getattr(self, axis)
                if g.pg is None:  # size-1 axis: one single-rank group per rank, created by all ranks in order
                    mine = None
                    for r in range(self.world_size):
                        pg = dist.new_group([r])
                        mine = pg if r == self.rank else mine
                    groups.append(mine)
                else:
                    groups.append(g.pg)
            self._mesh = DeviceMesh.from_group(groups, self.device.type, mesh=self.grid, mesh_dim_names=AXES)
        return self._mesh

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> "ParallelContext":
        """A one-process context (tp = pp = dp = cp = 1) that runs without torch.distributed."""
        return cls(config=ParallelConfig(), rank=0, world_size=1, device=torch.device(device),
                   tp=Group.single("tp"), pp=Group.single("pp"), dp=Group.single("dp"),
                   grid=torch.zeros(1, 1, 1, 1, dtype=torch.long), cp=Group.single("cp"))

    def is_main(self) -> bool:
        return self.rank == 0

    def destroy(self) -> None:
        """Close the shared-memory communicators (peers still waiting fail at once) and the process groups.

        The groups are unusable afterwards (``pg`` is ``None`` on ``tp``, ``pp`` and ``dp``, and on every
        layer that shares these :class:`~tensorpar.comm.Group` objects).

        Why the references are dropped here: ``dist.destroy_process_group`` unregisters the groups but does
        not stop gloo's worker threads while Python objects still refer to the group. A worker thread
        frees each finished collective's work, and with it the last C++ reference to the collective's
        tensors, a moment after ``wait()`` has returned; that release takes the GIL. When the script ends
        right after its last collective, under CPU contention the release can come while the interpreter is
        finalizing: the thread cannot take the GIL, is unwound, and the process aborts ("terminate called
        without an active exception", SIGABRT after all output was printed; seen in CI as rank 1 of
        examples/generate_tp.py). Dropping the last reference destroys the group now, while the interpreter
        is whole: its destructor releases the GIL and joins the worker threads once they are idle.
        """
        for g in (self.tp, self.pp, self.dp, self.cp):
            if g.fast is not None:
                from tensorpar.shm import disable_fast_collectives
                disable_fast_collectives(g)
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
        for g in (self.tp, self.pp, self.dp, self.cp, self.world):
            g.pg = None
        self._mesh = None
        gc.collect()  # a group held only through a reference cycle goes now, not at exit


def set_rank_threads(local_world_size: int, *, cores: int | None = None) -> int:
    """Give each of ``local_world_size`` ranks on this host an equal share of its cores (>= 1).

    Returns the thread count set with ``torch.set_num_threads``. ``TENSORPAR_THREADS`` overrides.
    """
    from tensorpar.launch import rank_thread_count

    n = rank_thread_count(local_world_size, cores)
    torch.set_num_threads(n)
    return n


def attempt_store(rank: int, world_size: int, timeout_s: float, store: dist.Store | None = None) -> dist.Store:
    """A store for this launch attempt only: torchrun's agent store (``MASTER_ADDR:MASTER_PORT``) under a
    prefix that every rank of this attempt agrees on and no earlier attempt used.

    Why: with the c10d rendezvous, torchrun's agent hosts one TCPStore for the whole job and hands the same
    address to every attempt (``--max-restarts``), and ``init_process_group`` writes its keys under fixed
    names (``default_pg/0//cpu/rank_0`` ...). After a restart a rank could read rank 0's *previous* gloo
    (or NCCL) address and fail with ``connectFullMesh ... Connection refused`` (pytorch/pytorch#135712,
    #167288). ``TORCHELASTIC_RESTART_COUNT`` cannot name the attempt: each agent counts its own restarts,
    so on several nodes the counts differ.

    Handshake (only set/get/wait on the store): rank 0 writes a fresh random id ``A`` to
    ``tensorpar/attempt``; every other rank r reads it, writes its own fresh nonce to ``tensorpar/A/ack/r``
    and waits for rank 0 to echo that nonce in ``tensorpar/A/go/r``. A rank that read an id left by an
    earlier attempt finds there no echo of its nonce (a key from before, or none within a second) and reads
    again, so every rank ends on rank 0's current ``A``. Costs a few store round trips (milliseconds).
    ``store`` (tests) replaces the agent store.

    Raises:
        TimeoutError: a rank did not take part within ``timeout_s`` seconds (names the ranks missing).
    """
    import time
    import uuid

    if store is None:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                              is_master=False, timeout=_dt.timedelta(seconds=timeout_s))
    deadline = time.monotonic() + timeout_s

    def poll(key: str) -> bool:  # check(), not wait(): a wait that times out logs a C++ warning
        while not store.check([key]):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    if rank == 0:
        attempt = uuid.uuid4().hex
        store.set("tensorpar/attempt", attempt)
        for r in range(1, world_size):
            if not poll(f"tensorpar/{attempt}/ack/{r}"):
                missing = [q for q in range(r, world_size) if not store.check([f"tensorpar/{attempt}/ack/{q}"])]
                raise TimeoutError(f"ranks {missing} did not join the process group within --timeout "
                                   f"{timeout_s:g} s")
            store.set(f"tensorpar/{attempt}/go/{r}", store.get(f"tensorpar/{attempt}/ack/{r}"))
    else:
        mine = uuid.uuid4().hex
        while True:
            if not poll("tensorpar/attempt"):
                raise TimeoutError(f"rank 0 did not start the process group within --timeout {timeout_s:g} s")
            attempt = store.get("tensorpar/attempt").decode()
            go = f"tensorpar/{attempt}/go/{rank}"
            store.set(f"tensorpar/{attempt}/ack/{rank}", mine)
            echo_by = time.monotonic() + 1.0  # an id of an earlier attempt is never echoed: read it again
            while not store.check([go]) and time.monotonic() < min(echo_by, deadline):
                time.sleep(0.02)
            if store.check([go]) and store.get(go).decode() == mine:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 did not start the process group within --timeout {timeout_s:g} s")
            time.sleep(0.02)
    return dist.PrefixStore(f"tensorpar/{attempt}/", store)


def _hostnames(world_size: int) -> list[str] | None:
    """Every rank's hostname (one all-gather over the world at start-up), or ``None`` for one rank: the groups
    that span several hosts keep theirs for error messages (:attr:`tensorpar.comm.Group.hosts`)."""
    if world_size == 1:
        return None
    names: list = [None] * world_size
    dist.all_gather_object(names, socket.gethostname())
    return names


def init_parallel(
    config: ParallelConfig | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
    timeout_s: float = 120.0,
    backend: str | None = None,
    set_threads: bool = True,
    fast_collectives: str = "off",
    tp_comm: str = "fp32",
) -> ParallelContext:
    """Initialise torch.distributed (if needed) and build the (dp, pp, cp, tp) groups.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT`` (torchrun's environment) unless ``rank``/``world_size``/``init_method``
    are given. The backend is NCCL when CUDA is available, else gloo; ``backend`` overrides.
    ``timeout_s`` bounds every collective, so a rank that never arrives fails the others
    within it instead of hanging. ``config.tp_weights="auto"`` times a GEMM on every rank
    (:func:`tensorpar.capacity.measure_tp_weights`: a barrier and an all-gather) and sets ``ctx.tp_weights``. ``fast_collectives`` ("off", "auto", "on") installs the
    same-host shared-memory path (:mod:`tensorpar.shm`) on every group of more than one rank,
    used for CPU tensors; "auto" uses it only when all of a group's ranks share a host. ``tp_comm`` ("fp32",
    "int8") becomes ``ctx.tp.compression`` (:func:`tensorpar.comm.reduce_partial`). Collectives at start-up
    (world size > 1): one all-gather of hostnames over the world; a group whose ranks are on several hosts keeps
    them (``Group.hosts``), so its failed collectives name this rank's host and the others. First of all, it fixes
    glibc's mmap threshold in this process for the load (``ctx.heap``, :meth:`tensorpar.malloc.HeapState.for_load`:
    freed weights are returned; the engine's builder raises it, :meth:`~tensorpar.malloc.HeapState.for_steady`).

    Raises:
        ValueError: the degrees do not multiply to the world size; ``fast_collectives="on"`` for a
            group whose ranks are on several hosts.
    """
    if fast_collectives not in ("off", "auto", "on"):
        raise ValueError(f"fast_collectives must be 'off', 'auto' or 'on', got {fast_collectives!r}")
    from tensorpar.comm import TP_COMM
    if tp_comm not in TP_COMM:
        raise ValueError(f"tp_comm must be one of {', '.join(TP_COMM)}, got {tp_comm!r}")
    heap = HeapState()
    heap.for_load()                 # before any weight is allocated (a rank's resident memory, docs/memory.md)
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    config = config or ParallelConfig.infer(world_size)
    config.validate(world_size)
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        from tensorpar.launch import check_gpu_count
        here = max(local_rank + 1, local_world)   # ranks on this host (every rank refused alike, none left waiting)
        check_gpu_count(here, backend)       # the launcher's rule: one GPU per rank on this host
    device = torch.device(f"cuda:{local_rank}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if set_threads and device.type == "cpu":
        set_rank_threads(local_world)
    timeout = _dt.timedelta(seconds=timeout_s)
    if backend == "gloo" and not dist.is_initialized():
        from tensorpar.launch import check_socket_ifname
        check_socket_ifname()
    if not dist.is_initialized():
        if init_method is None and "MASTER_ADDR" not in os.environ:
            init_method = "tcp://127.0.0.1:29500"
        if init_method is None and world_size == 1:
            # one rank needs no rendezvous: an in-process store opens no port (a TCPStore listens on every interface)
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        elif init_method is None and world_size > 1 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's agent store outlives a restart: keys of the attempt before must not be read
            dist.init_process_group(backend, store=attempt_store(rank, world_size, timeout_s), rank=rank,
                                    world_size=world_size, timeout=timeout)
        else:
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                    timeout=timeout)
    grid = torch.arange(world_size).view(config.dp, config.pp, config.cp, config.tp)
    hostnames = _hostnames(world_size)
    groups: dict[str, Group] = {}
    for axis_i, axis in enumerate(AXES):
        # Every rank must create every group, in the same order.
        lines = grid.movedim(axis_i, -1).reshape(-1, grid.shape[axis_i])
        for line in lines.tolist():
            pg = dist.new_group(line, timeout=timeout) if len(line) > 1 else None
            if rank in line:
                groups[axis] = (Group(pg=pg, rank=line.index(rank), size=len(line), name=axis) if pg is not None
                                else Group.single(axis))
                names = None if hostnames is None else tuple(hostnames[r] for r in line)
                if rank in line and names is not None and len(set(names)) > 1:
                    groups[axis].hosts = names
    if fast_collectives != "off":
        from tensorpar.shm import enable_fast_collectives
        for axis in AXES:
            enable_fast_collectives(groups[axis], fast_collectives, timeout_s=timeout_s)
    groups["tp"].compression = tp_comm
    if world_size > 1:      # serve's plan broadcasts (stages, ep replicas): a failure names the hosts too
        groups["world"] = Group.from_pg(dist.group.WORLD, name="world")
        if len(set(hostnames)) > 1:
            groups["world"].hosts = tuple(hostnames)
    ctx = ParallelContext(config=config, rank=rank, world_size=world_size, device=device, grid=grid, heap=heap,
                          **groups)
    if config.tp_weights == "auto":  # a GEMM timed on every rank at once, gathered: the same weights everywhere
        from tensorpar.capacity import measure_tp_weights
        ctx.tp_weights = measure_tp_weights(ctx)
    else:
        ctx.tp_weights = config.tp_weights
    return ctx
