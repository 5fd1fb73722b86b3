"""Language-model batches over a token stream, deterministic and resumable.

The stream is cut into fixed windows of ``seq_len + 1`` tokens starting every ``seq_len`` tokens (so
window k's last token is window k+1's first, and every token but the first is a label exactly once per
epoch). Each epoch visits the windows in an order drawn from a private ``torch.Generator`` seeded from
``(seed, epoch)``, never from the global RNG: tensor-parallel dropout needs every rank's global RNG to
stay in step, and a data loader that drew from it on some ranks only would silently break that.

Because an epoch's order is a pure function of ``(seed, epoch)``, the iterator's whole state is three
integers; ``state_dict()``/``load_state_dict()`` save and restore them so a resumed run gets exactly the
batch the interrupted run would have got next.
"""
from __future__ import annotations

import hashlib

import torch


class LMBatches:
    """Iterator of ``(input_ids, labels)``, both int64 of shape ``[batch_size, seq_len]``, ``labels`` being
    ``input_ids`` shifted left by one token (``labels[b, t] == input_ids[b, t + 1]``).

    ``tokens`` is a 1-D integer tensor (or anything ``torch.as_tensor`` turns into one). With
    ``shuffle=False`` windows come in stream order (for evaluation). ``epochs=None`` iterates forever;
    an int stops after that many epochs. Each epoch yields ``batches_per_epoch`` full batches; the
    windows left over after the last full batch are skipped that epoch (with shuffling, different
    ones each epoch). Raises ``ValueError`` for bad sizes or a stream too short for one batch.
    """

    def __init__(self, tokens, *, batch_size: int, seq_len: int, seed: int, shuffle: bool = True,
                 epochs: int | None = None):
        tokens = torch.as_tensor(tokens)
        if tokens.ndim != 1 or tokens.is_floating_point() or tokens.is_complex():
            raise ValueError(f"tokens must be a 1-D integer tensor, got shape {tuple(tokens.shape)} "
                             f"and dtype {tokens.dtype}")
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(seed, int):
            raise ValueError(f"seed must be an int (an explicit seed keeps runs reproducible), got {seed!r}")
        if epochs is not None and (not isinstance(epochs, int) or epochs < 1):
            raise ValueError(f"epochs must be None (endless) or a positive int, got {epochs!r}")
        self.tokens = tokens
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.shuffle, self.epochs = shuffle, epochs
        self.num_windows = (len(tokens) - 1) // seq_len
        self.batches_per_epoch = self.num_windows // batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"{len(tokens)} tokens make {self.num_windows} windows of seq_len={seq_len}, fewer than "
                f"batch_size={batch_size}; lower batch_size or seq_len, or use more data"
            )
        self.epoch = 0
        self.batch_in_epoch = 0
        self._order: torch.Tensor | None = None  # window order of self.epoch, computed on first use

    def __iter__(self) -> "LMBatches":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.batch_in_epoch == self.batches_per_epoch:
            self.epoch, self.batch_in_epoch, self._order = self.epoch + 1, 0, None
        if self.epochs is not None and self.epoch >= self.epochs:
            raise StopIteration
        if self._order is None:
            self._order = self._epoch_order(self.epoch)
        first = self.batch_in_epoch * self.batch_size
        starts = self._order[first:first + self.batch_size] * self.seq_len  # [batch]
        offsets = torch.arange(self.seq_len + 1)  # [seq + 1]
        windows = self.tokens[starts[:, None] + offsets[None, :]].long()  # [batch, seq + 1]
        self.batch_in_epoch += 1
        return windows[:, :-1], windows[:, 1:]

    def __len__(self) -> int:
        """Batches left in a finite iterator. Raises ``TypeError`` for an endless one."""
        if self.epochs is None:
            raise TypeError("an endless LMBatches (epochs=None) has no length")
        return max(0, (self.epochs - self.epoch) * self.batches_per_epoch - self.batch_in_epoch)

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_windows)
        generator = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
        return torch.randperm(self.num_windows, generator=generator)

    def state_dict(self) -> dict[str, int | bool]:
        """Position and settings, as plain ints/bools (JSON-serialisable): where the next batch comes from."""
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "seed": self.seed,
                "batch_size": self.batch_size, "seq_len": self.seq_len, "shuffle": self.shuffle,
                "num_tokens": len(self.tokens)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (from ``state_dict()`` of an iterator over the same data and settings).

        Raises ``ValueError`` naming every setting that differs, since resuming with another batch size,
        sequence length, seed or token stream would not continue the same run.
        """
        mine = self.state_dict()
        settings = ("seed", "batch_size", "seq_len", "shuffle", "num_tokens")
        missing = [k for k in (*settings, "epoch", "batch_in_epoch") if k not in state]
        if missing:
            raise ValueError(f"data state is missing {missing}; expected a dict from LMBatches.state_dict()")
        differ = [f"{k}: saved {state[k]!r}, now {mine[k]!r}" for k in settings if state[k] != mine[k]]
        if differ:
            raise ValueError("cannot resume the data iterator with different settings (" + "; ".join(differ)
                             + "); resume with the settings and corpus of the saved run")
        if not 0 <= state["batch_in_epoch"] <= self.batches_per_epoch or state["epoch"] < 0:
            raise ValueError(f"data state position epoch={state['epoch']}, batch_in_epoch="
                             f"{state['batch_in_epoch']} is out of range ({self.batches_per_epoch} per epoch)")
        self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])
        self._order = None


def _epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit seed for one epoch, the same on every platform and Python version (unlike ``hash``)."""
    digest = hashlib.sha256(f"tensorpar.LMBatches:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
