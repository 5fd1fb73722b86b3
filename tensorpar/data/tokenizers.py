"""Tokenizers for the training corpus: raw UTF-8 bytes, or a Hugging Face model folder's tokenizer.

Both expose the same small interface, which is all the data code relies on:
``encode(text) -> list[int]``, ``decode(ids) -> str``, ``vocab_size``, ``eos_token_id`` (or None) and
``identity``, a string that changes whenever the text -> ids mapping could change (it keys the token cache).
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable, Protocol

BYTE_ALIASES = ("bytes", "byte")


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_id: int | None
    identity: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """Each UTF-8 byte is one token: ids 0..255, vocabulary 256, no special tokens.

    No end-of-text token on purpose: 256 divides by every tensor-parallel degree a vocabulary-parallel
    embedding would use (2, 4, 8, ...), where 257 would need padding. Documents are separated by text
    instead (see ``document_separator``).
    """

    vocab_size = 256
    eos_token_id = None
    identity = "bytes-v1"

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes of ``text`` as ints in [0, 256)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """Inverse of ``encode``; byte sequences that are not valid UTF-8 decode to U+FFFD.

        Raises ``ValueError`` for an id outside [0, 256).
        """
        ids = list(ids)
        bad = [i for i in ids if not 0 <= int(i) < 256]
        if bad:
            raise ValueError(f"ByteTokenizer ids must be in [0, 256); got {bad[:5]}")
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def to_transformers(self):
        """This tokenizer as a ``transformers.PreTrainedTokenizerFast`` (what an export saves, so that
        ``AutoTokenizer.from_pretrained`` loads a byte-level model): a ``tokenizers`` BPE over the 256
        byte symbols of GPT-2's byte-to-unicode table (:func:`bytes_to_unicode`) with no merges, the symbol
        of byte ``b`` at id ``b``, behind a ByteLevel normalizer and decoder. So ``encode(text)`` is the
        UTF-8 bytes of ``text``, as here, and ``decode`` their text.

        No special tokens, not even a padding token: transformers registers any declared special token in
        the backend, which then matches its text in the input (a pad of byte 0xFF's symbol would turn
        "\u00ff" into one id instead of its two UTF-8 bytes), so padding is left to the caller
        (``tensorpar generate`` pads such a tokenizer's prompts itself). ``clean_up_tokenization_spaces``
        is off, so ``decode`` gives the bytes' text unchanged.
        """
        from tokenizers import Tokenizer as Backend
        from tokenizers import decoders, models, normalizers
        from transformers import PreTrainedTokenizerFast

        symbols = bytes_to_unicode()
        backend = Backend(models.BPE(vocab={symbols[b]: b for b in range(256)}, merges=[]))
        backend.normalizer = normalizers.ByteLevel()   # text -> one symbol per UTF-8 byte
        backend.decoder = decoders.ByteLevel()         # symbols -> bytes -> text (invalid UTF-8 -> U+FFFD)
        return PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False)

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=256)"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table of the 256 bytes to printable characters (Radford et al. 2019, ``encoder.py``), which
    the ``tokenizers`` ByteLevel normalizer, pre-tokenizer and decoder use: printable Latin-1 bytes map to
    themselves, the other 68 to U+0100 onwards, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class HFTokenizer:
    """The tokenizer saved in a Hugging Face model folder (``tokenizer.json``), loaded offline.

    ``encode`` adds no special tokens (no BOS), so a document's ids are exactly its text's ids.
    ``vocab_size`` is ``len(tokenizer)`` (base vocabulary plus added tokens): every id it can emit
    is below it. ``identity`` hashes the folder's tokenizer files.
    """

    FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")

    def __init__(self, folder: str | os.PathLike):
        from transformers import AutoTokenizer

        self.folder = Path(folder)
        if not (self.folder / "tokenizer.json").is_file():
            raise ValueError(f"{self.folder} has no tokenizer.json; expected a Hugging Face model folder "
                             "with a fast tokenizer (see tensorpar.hub.resolve_model)")
        self._tok = AutoTokenizer.from_pretrained(str(self.folder), local_files_only=True)
        self.vocab_size = len(self._tok)
        self.eos_token_id = self._tok.eos_token_id
        digest = hashlib.sha256()
        for name in self.FILES:
            path = self.folder / name
            if path.is_file():
                digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
        self.identity = f"hf-{digest.hexdigest()[:16]}"

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without special tokens."""
        # The backend tokenizer, not `self._tok(...)`: that warns for texts longer than the model's context.
        return self._tok.backend_tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (special tokens included as their text)."""
        return self._tok.decode([int(i) for i in ids])

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.folder)!r}, vocab_size={self.vocab_size})"


def load_tokenizer(spec: str | os.PathLike | None = None, *, cache_dir: str | os.PathLike | None = None,
                   progress: bool = True) -> ByteTokenizer | HFTokenizer:
    """``None`` or ``"bytes"`` -> ``ByteTokenizer``; anything ``tensorpar.hub.resolve_model`` accepts
    (``"smollm2"``, a model folder, a ``.gguf`` file) -> that model's ``HFTokenizer``.

    Raises what ``resolve_model`` raises for a bad spec.
    """
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in BYTE_ALIASES):
        return ByteTokenizer()
    from tensorpar.hub import resolve_model

    return HFTokenizer(resolve_model(str(spec), cache_dir=cache_dir, progress=progress))


def document_separator(tokenizer: Tokenizer) -> list[int]:
    """Ids placed between documents: the EOS token if the tokenizer has one, else a blank line's ids."""
    if tokenizer.eos_token_id is not None:
        return [int(tokenizer.eos_token_id)]
    return tokenizer.encode("\n\n")
