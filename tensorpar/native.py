"""Building and loading our C++ kernels: one source file each, no torch headers, compiled once per machine with the
system's C++ compiler and loaded with ctypes.

Used by :mod:`tensorpar.decode.q8_kernel` (int8 matmul), :mod:`tensorpar.decode.gemv_kernel` (GEMV),
:mod:`tensorpar.decode.fused` (the row step's element-wise kernels) and :mod:`tensorpar.comm.compress` (the int8
all-reduce's quantization). It imports nothing of tensorpar, so every room may use it.

A library goes into torch's extension cache (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) under
a name carrying the kernel, its target and a hash of the source, compiler and flags, written atomically (ranks
starting at once may build it together). Where a kernel cannot run (no compiler, a failed build, a CPU without the
target's features, its environment switch at ``0``) :func:`load_kernel` returns None and the caller runs the same
math in PyTorch.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path


def cpu_has_features(features) -> bool:
    """Whether /proc/cpuinfo's ``flags`` line lists every one of ``features`` (False where it cannot be read; True
    for no features, a build for any CPU)."""
    if not features:
        return True
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return all(f in flags for f in features)


def build(src_path: Path, flags: list[str], name: str) -> Path | None:
    """The shared library's path (``src_path`` compiled with ``flags``), compiling it on first use; ``None`` if no
    C++ compiler works or the build fails."""
    cxx = shlex.split(os.environ.get("CXX", "")) or [c for c in (shutil.which("g++") or shutil.which("c++"),) if c]
    if not cxx:
        return None
    src = Path(src_path).read_bytes()
    tag = hashlib.sha256(src + " ".join(cxx + list(flags)).encode()).hexdigest()[:16]
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    lib = root / f"tensorpar_{name}_{tag}.so"
    if lib.exists():
        return lib
    tmp = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=root)
        os.close(fd)
        r = subprocess.run([*cxx, *flags, str(src_path), "-o", tmp], capture_output=True, timeout=300)
        if r.returncode != 0:
            return None
        os.replace(tmp, lib)            # atomic: concurrent ranks may build at once
        tmp = None
    except (OSError, subprocess.SubprocessError):
        return None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def load_kernel(src_path: Path, flags: list[str], name: str, features, env: str):
    """The ctypes library of one of our C++ kernels, or None where it cannot run: ``env`` set to ``0`` in the
    environment, a CPU without ``features`` (/proc/cpuinfo flags), no compiler or a failed build, a load error."""
    if os.environ.get(env, "1") == "0" or not cpu_has_features(features):
        return None
    path = build(src_path, flags, name)
    if path is None:
        return None
    try:
        return ctypes.CDLL(str(path))
    except OSError:
        return None


def pick_target(targets):
    """The first ``(name, features, compiler flags)`` of ``targets`` whose features /proc/cpuinfo lists, or None."""
    return next((t for t in targets if cpu_has_features(t[1])), None)


def load_target(target, src_path: Path, flags: list[str], prefix: str, env: str):
    """:func:`load_kernel` of ``src_path`` for ``target`` (``(name, features, extra compiler flags)``, as
    :func:`pick_target` gives; None: no target, None back), built with ``flags`` and the target's, named
    ``prefix_name``."""
    if target is None:
        return None
    name, features, extra = target
    return load_kernel(src_path, [*flags, *extra], f"{prefix}_{name}", features, env)
