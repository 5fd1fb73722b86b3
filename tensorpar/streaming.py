"""Token ids to terminal text while they are generated: complete characters only, and honest stats.

A byte-level BPE tokenizer (GPT-2, Llama 3, SmolLM2, Qwen) can split one character over several tokens:
an emoji is 4 UTF-8 bytes, a CJK character 3, and a token may end in the middle of one. Decoding such
a prefix gives U+FFFD (the replacement character) where the partial character is. ``IncrementalDecoder``
holds text back while it ends in U+FFFD and releases it once the rest of the character arrives, so the
concatenation of what it returns equals the decoding of all ids at once. The method is the "prefix
offset / read offset" incremental detokenization of Hugging Face text-generation-inference and vLLM:
each step decodes a short window of ids (the ids already shown as context, plus the new ones), never the
whole sequence, so a step costs O(window), not O(length).
"""
from __future__ import annotations

import math
import os
from typing import Callable, Iterable, Sequence

REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """Turn a stream of token ids into text pieces that never end inside a character.

    ``decode(ids) -> str`` is the tokenizer's decoding of a list of ids (e.g.
    ``lambda ids: tok.decode(ids, skip_special_tokens=True)``). ``push(id)`` returns the new complete
    text (possibly ``""``); ``flush()`` returns whatever is still held back at the end (a character
    that was never completed is returned as the tokenizer decodes it, i.e. U+FFFD). For a tokenizer whose
    decoding of ``a + b`` is the decoding of ``a`` followed by that of ``b`` whenever ``a`` ends on a
    character boundary (every byte-level BPE), ``"".join(pieces) == decode(all_ids)``.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window: ids already shown, decoded again for context
        self._read = 0    # ids before this index are shown

    def push(self, token_id: int) -> str:
        """Add one id; return the text it completes (``""`` while a character is still partial)."""
        self._ids.append(int(token_id))
        shown = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if len(text) > len(shown) and not text.endswith(REPLACEMENT) and text.startswith(shown):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(shown):]
        return ""

    def push_many(self, token_ids: Iterable[int]) -> list[str]:
        """``[push(i) for i in token_ids]``."""
        return [self.push(i) for i in token_ids]

    def flush(self) -> str:
        """Return the text still held back (at the end of generation) and mark it as shown."""
        shown = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return text[len(os.path.commonprefix([text, shown])):]


def eos_token_ids(folder: str | os.PathLike, tokenizer=None) -> list[int]:
    """Every id that ends a row: ``eos_token_id`` of the folder's ``generation_config.json`` (an int or a
    list, e.g. Llama 3's ``[128001, 128008, 128009]``) and of ``config.json``, plus the tokenizer's
    ``eos_token_id``; sorted, without duplicates. Missing files or fields contribute nothing.
    """
    import json
    from pathlib import Path

    ids: set[int] = set()

    def add(value):
        if isinstance(value, bool) or value is None:
            return
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            for v in value:
                add(v)

    for name in ("generation_config.json", "config.json"):
        path = Path(folder) / name
        if path.is_file():
            try:
                add(json.loads(path.read_text(encoding="utf-8")).get("eos_token_id"))
            except (ValueError, AttributeError):
                pass  # an unreadable file is reported where the model is loaded, not here
    if tokenizer is not None:
        add(getattr(tokenizer, "eos_token_id", None))
    return sorted(ids)


def chat_header(prompt: str) -> str:
    """What is printed before a ``--chat`` answer: the user's prompt and an ``Assistant:`` label, each on
    its own line, so prompt and answer are visibly separate."""
    return f"User: {prompt}\nAssistant: "


def stats_line(tp_size: int, ttft_s: float, decode_s: float, n_tokens: int, pp_size: int = 1, rows: int = 1) -> str:
    """The one-line summary printed after generation; never prints ``nan`` or ``inf``.

    ``ttft_s``: seconds to the first token; ``decode_s``: seconds of the remaining ``n_tokens - 1`` steps.
    With one token (or no measurable decode time) the decode rate is left out and the reason given. ``pp_size``:
    pipeline stages (shown when > 1). ``rows`` > 1 (a batch of prompts): the rate per row and over the batch.
    """
    noun = "token" if n_tokens == 1 else "tokens"
    layout = f"tp={tp_size}" + (f", pp={pp_size}" if pp_size > 1 else "")
    head = f"[{layout}] time to first token {ttft_s * 1e3:.1f} ms"
    steps = n_tokens - 1
    if steps > 0 and math.isfinite(decode_s) and decode_s > 0:
        rate = steps / decode_s
        batch = f" per row, {rate * rows:.1f} over {rows} rows" if rows > 1 else ""
        return f"{head}, decode {rate:.1f} tokens/s{batch} ({n_tokens} {noun})"
    return f"{head} ({n_tokens} {noun}; no decode steps to time)"


class TokenPrinter:
    """The ``on_token`` callback of ``generate_tokens`` for one streamed row: prints complete text.

    ``tokenizer`` decodes with ``skip_special_tokens=True`` (an end-of-sequence token prints nothing);
    ``write`` receives each non-empty piece (default: ``print(piece, end="", flush=True)``). Call
    ``close()`` after generation to print what is held back. ``row`` selects the batch row.
    """

    def __init__(self, tokenizer, write: Callable[[str], None] | None = None, row: int = 0):
        self.decoder = IncrementalDecoder(lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        self.write = write or (lambda s: print(s, end="", flush=True))
        self.row = row
        self.pieces: list[str] = []

    def _emit(self, piece: str) -> None:
        if piece:
            self.pieces.append(piece)
            self.write(piece)

    def __call__(self, step: int, tokens) -> None:
        self._emit(self.decoder.push(int(tokens[self.row])))

    def close(self) -> None:
        self._emit(self.decoder.flush())

    @property
    def text(self) -> str:
        """Everything printed so far."""
        return "".join(self.pieces)


def chat_prompt_ids(tok, messages: list[dict]) -> list[int]:
    """The prompt ids of a chat (``[n]``): exactly ``tok.apply_chat_template(messages, tokenize=True,
    add_generation_prompt=True)``, used by ``generate --chat`` and ``serve``'s chat endpoint.

    The template writes every special token itself; rendering it to text and tokenizing that with the
    tokenizer's defaults would add the tokenizer's BOS in front of the template's (two BOS, sglang PR #888).
    Raises whatever the tokenizer raises when it has no chat template.
    """
    return list(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False))
