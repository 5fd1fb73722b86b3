"""The shared-memory segment: its layout, creation, attachment, and the process facts peers need.

Layout of one segment shared by ``n`` ranks (all offsets in bytes)::

    [0, 128)                  global line: magic, n, slot_bytes, abort (rank+1), abort reason,
                              rank the aborter waited for
    [128 (r+1), 128 (r+2))    control line of rank r: arrival counter, state, pid, start time,
                              metadata of the step on buffer 0 (2 words) and buffer 1 (2 words)
    data_offset + (2 r + p) slot_bytes    rank r's data slot for buffer parity p (p = 0, 1)

Control lines are 128 bytes apart so that two ranks' counters never share a cache line or an
adjacent-line prefetch pair. Every word is an aligned int64, so a single store or load of it is
atomic on x86-64. The data region starts on a page boundary and every slot is a multiple of 4096
bytes, so a slot's address modulo any SIMD width is the same in every process: vectorised kernels
split every slot identically, which keeps reductions bit-identical across ranks.

Lifetime: the creator makes a file in ``/dev/shm`` with ``O_EXCL``, reserves its pages with
``posix_fallocate`` (so that a full tmpfs is an error at creation, not a SIGBUS on first touch),
and unlinks it as soon as every peer has mapped it. From then on the segment has no name; the
kernel frees it when the last process unmaps it or exits, whether by ``close()``, an exception,
Ctrl-C or SIGKILL. Only a crash inside the few milliseconds between creation and unlink can
leave a file behind; :func:`sweep_stale` removes such files when their creator is dead.
"""
from __future__ import annotations

import mmap
import os
import secrets
import socket
import time
import types
from dataclasses import dataclass

import torch

SHM_DIR = "/dev/shm"
PREFIX = "tensorpar-"
LINE_WORDS = 16                      # 128 bytes per control line
MAGIC = 0x7470_73686D_0001           # "tp" "shm" version 1

# Words of the global line.
G_MAGIC, G_SIZE, G_SLOT, G_ABORT_RANK, G_ABORT_WHY, G_ABORT_PEER = 0, 1, 2, 3, 4, 5
# Words of a rank's control line, relative to the line start.
W_ARRIVED, W_STATE, W_PID, W_START, W_META = 0, 1, 2, 3, 4   # W_META + 2 * parity + {0, 1}

STATE_ACTIVE, STATE_CLOSED, STATE_BROKEN = 1, 2, 3
# Reasons written to G_ABORT_WHY by the rank that broke the protocol.
ABORT_REASONS = types.MappingProxyType({
    1: "gave up waiting for rank {peer}", 2: "was interrupted (KeyboardInterrupt or a signal)",
    3: "raised an error in the middle of a collective"})


@dataclass(frozen=True)
class Layout:
    """Byte offsets of the control lines and data slots for ``size`` ranks and ``slot_bytes`` slots."""

    size: int
    slot_bytes: int

    @property
    def data_offset(self) -> int:
        header = (self.size + 1) * LINE_WORDS * 8
        return -(-header // 4096) * 4096

    @property
    def total_bytes(self) -> int:
        return self.data_offset + 2 * self.size * self.slot_bytes

    def line(self, rank: int) -> int:
        """Index (in int64 words) of ``rank``'s control line."""
        return (rank + 1) * LINE_WORDS

    def slot(self, rank: int, parity: int) -> int:
        """Byte offset of ``rank``'s data slot for buffer ``parity``."""
        return self.data_offset + (2 * rank + parity) * self.slot_bytes


class Segment:
    """One mapping of a shared segment: the mmap, an int64 view of the control words, a byte tensor.

    Attributes:
        name: file name under ``/dev/shm`` (gone once unlinked; kept for messages and tests).
        layout: the :class:`Layout`.
        ctl: ``memoryview`` of the header as int64 words; item reads and writes are single
            aligned 8-byte loads and stores.
        data: ``torch.uint8`` tensor over the whole segment (slots are views of it).
        base: address of the first byte of the mapping.
    """

    def __init__(self, name: str, layout: Layout, fd: int):
        self.name, self.layout = name, layout
        try:
            self._mm = mmap.mmap(fd, layout.total_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.ctl = memoryview(self._mm)[: layout.data_offset].cast("q")
        self.data = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.base = self.data.data_ptr()

    @classmethod
    def create(cls, layout: Layout) -> "Segment":
        """Create a new zero-filled segment with a unique name (the caller must :meth:`unlink` it).

        Raises:
            OSError: ``/dev/shm`` is missing, not writable, or has no room for ``layout.total_bytes``.
        """
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, layout.total_bytes)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        seg = cls(name, layout, fd)
        seg.ctl[G_SIZE], seg.ctl[G_SLOT] = layout.size, layout.slot_bytes
        seg.ctl[G_MAGIC] = MAGIC
        return seg

    @classmethod
    def attach(cls, name: str, layout: Layout) -> "Segment":
        """Map an existing segment by name and check that its header matches ``layout``.

        Raises:
            OSError: no such segment (for instance ``/dev/shm`` is not shared with the creator).
            RuntimeError: the header does not describe ``layout``.
        """
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        if os.fstat(fd).st_size < layout.total_bytes:
            os.close(fd)
            raise RuntimeError(f"shared segment {name} is smaller than the {layout.total_bytes} bytes expected")
        seg = cls(name, layout, fd)
        got = (seg.ctl[G_MAGIC], seg.ctl[G_SIZE], seg.ctl[G_SLOT])
        if got != (MAGIC, layout.size, layout.slot_bytes):
            seg.close()
            raise RuntimeError(f"shared segment {name} has header (magic, size, slot_bytes) = {got}, expected "
                               f"{(MAGIC, layout.size, layout.slot_bytes)}")
        return seg

    def unlink(self) -> None:
        """Remove the name from ``/dev/shm`` (mappings stay valid). Idempotent."""
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unmap. Views handed out earlier must be gone; if one survives, the unmap waits for GC."""
        self.ctl.release()
        self.data = None
        try:
            self._mm.close()
        except BufferError:  # a view still exists; the mapping goes when it is collected
            pass


# ---------------------------------------------------------------- host and process identity

def host_identity() -> str:
    """``hostname/boot_id/net-namespace``: equal only for processes that may share ``/dev/shm`` *and* a network.

    The boot id separates two machines that happen to share a hostname. The network namespace (the
    inode of ``/proc/self/ns/net``) separates "hosts" that share one kernel but not a network, e.g.
    network-namespace hosts (:mod:`tensorpar.nshosts`) or containers: the boot id is the same for all
    of them, and the hostname is too unless each also has its own UTS namespace, yet ranks there talk
    through their own link and shared memory would bypass it. Whether processes with one identity
    really share ``/dev/shm`` (containers) is verified afterwards by attaching the segment.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    try:
        net = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        net = "no-netns"
    return f"{socket.gethostname()}/{boot}/{net}"


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of ``/proc/pid/stat``), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()
    return int(fields[19])


def process_alive(pid: int, start_time: int | None) -> bool:
    """False if ``pid`` has exited, is a zombie, or is now another process (its start time changed).

    With ``start_time`` None (the peer's ``/proc`` entry was not visible at set-up, e.g. another
    PID namespace) liveness is unknown and this returns True: only the timeout applies.
    """
    if start_time is None:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    fields = stat[stat.rindex(b")") + 2:].split()
    return fields[0] not in (b"Z", b"X") and int(fields[19]) == start_time


def sweep_stale(min_age_s: float = 60.0) -> list[str]:
    """Delete ``/dev/shm/tensorpar-<pid>-*`` files whose creator is gone and that are older than ``min_age_s``.

    Returns the names removed. Segments are normally unlinked milliseconds after creation, so
    only a creator killed during set-up leaves one; the age guard spares segments being set up.
    """
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        if not name.startswith(PREFIX):
            continue
        try:
            pid = int(name[len(PREFIX):].split("-")[0])
            path = os.path.join(SHM_DIR, name)
            if now - os.stat(path).st_mtime < min_age_s or os.path.exists(f"/proc/{pid}"):
                continue
            os.unlink(path)
            removed.append(name)
        except (ValueError, OSError):
            continue
    return removed
