"""Token streams for training: the Shakespeare corpus, a text file, or given tokens.

Every rank builds the same :class:`TrainData` and iterates the same batches (tensor parallelism shares
one batch over the ranks of a group). Batches come from :class:`tensorpar.data.LMBatches`, whose window
order is drawn from its own generator, never from the global RNG.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from tensorpar.data import LMBatches


@dataclass(frozen=True)
class TrainData:
    """Train and validation token streams (1-D integer tensors) and the tokenizer's description.

    Attributes:
        train, val: token ids, all below ``vocab_size``.
        vocab_size: the tokenizer's vocabulary (the model's may be larger, never smaller).
        tokenizer: ``"bytes"`` or the folder of the Hugging Face tokenizer (copied into exports).
        source: what the text was (``"shakespeare"``, a file path, ``"tokens"``).
    """

    train: torch.Tensor
    val: torch.Tensor
    vocab_size: int
    tokenizer: str
    source: str

    def train_batches(self, *, batch_size: int, seq_len: int, seed: int) -> LMBatches:
        """Endless shuffled batches ``(input_ids, labels)`` of ``[batch_size, seq_len]``."""
        return LMBatches(self.train, batch_size=batch_size, seq_len=seq_len, seed=seed)

    def val_batches(self, *, batch_size: int, seq_len: int) -> LMBatches:
        """One pass over the validation stream in order. Raises ValueError if it holds less than one batch."""
        try:
            return LMBatches(self.val, batch_size=batch_size, seq_len=seq_len, seed=0, shuffle=False, epochs=1)
        except ValueError as e:
            raise ValueError(f"validation split too small: {e}; raise val_fraction or lower batch_size/seq_len") \
                from e

    @classmethod
    def from_tokens(cls, tokens: torch.Tensor, vocab_size: int, *, val_fraction: float,
                    tokenizer: str = "bytes", source: str = "tokens") -> "TrainData":
        """Split one stream: the last ``val_fraction`` of it is validation."""
        tokens = torch.as_tensor(tokens)
        n_val = max(int(len(tokens) * val_fraction), 2)
        return cls(tokens[:-n_val], tokens[-n_val:], int(vocab_size), tokenizer, source)


def tokenizer_spec(cfg_tokenizer: str, model_folder: Path | None) -> str:
    """Resolve ``tokenizer="auto"``: the model folder's tokenizer if it has one, else bytes."""
    if cfg_tokenizer != "auto":
        return cfg_tokenizer
    if model_folder is not None and (Path(model_folder) / "tokenizer.json").is_file():
        return str(model_folder)
    return "bytes"


def load_data(data: str, tokenizer: str, *, val_fraction: float, progress: bool = True) -> TrainData:
    """``data="shakespeare"`` (held-out whole plays for validation) or a UTF-8 text file (its tail).

    ``tokenizer`` is ``"bytes"``, ``"smollm2"`` or a model folder. Raises ValueError for a data spec that
    is neither, naming it; FileNotFoundError for a missing file.
    """
    from tensorpar.data import load_corpus, load_tokenizer

    tok = load_tokenizer(tokenizer, progress=progress)
    tok_desc = "bytes" if tok.identity.startswith("bytes") else str(tok.folder)
    if data == "shakespeare":
        c = load_corpus(tok, val_fraction=val_fraction, progress=progress)
        return TrainData(c.train, c.val, c.vocab_size, tok_desc, "shakespeare")
    path = Path(os.path.expanduser(data))
    if path.suffix != ".txt" and not path.exists():
        raise ValueError(f"--data {data!r}: use 'shakespeare' or the path of a UTF-8 .txt file")
    if not path.is_file():
        raise FileNotFoundError(f"--data {data!r}: no such file")
    ids = torch.tensor(tok.encode(path.read_text(encoding="utf-8")), dtype=torch.int32)
    return TrainData.from_tokens(ids, tok.vocab_size, val_fraction=val_fraction, tokenizer=tok_desc,
                                 source=str(path))
