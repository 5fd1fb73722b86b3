"""Export a training checkpoint as a Hugging Face model folder (``from_pretrained`` loads it).

A checkpoint already stores full-shape weights under the model's own parameter names, so export is:
build the transformers model from the checkpoint's ``config.json``, load ``model.safetensors`` into it
(strictly: only a tied LM head may be absent), ``save_pretrained`` into a temporary folder next to the
destination, add the tokenizer files, and rename the folder into place.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from tensorpar.train.checkpoint import MODEL_FILE, latest_checkpoint, read_state

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja")


def export_hf(ckpt: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write the checkpoint at ``ckpt`` (or the latest one under it) as a Hugging Face folder ``out``.

    The weights are saved in fp32; the model's tokenizer files are copied when the run used a model
    folder's tokenizer (a byte-level run has none: ids are UTF-8 bytes). Returns ``out``.

    Raises:
        FileExistsError: ``out`` exists and ``overwrite`` is false.
        ValueError: the checkpoint's tensors do not fit its config (naming them).
    """
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt = latest_checkpoint(ckpt)
    state = read_state(ckpt)
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; choose another folder or pass overwrite=True (--overwrite)")
    config = AutoConfig.from_pretrained(ckpt)
    config.use_cache = True
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_file(str(ckpt / MODEL_FILE))
    result = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise ValueError(f"checkpoint {ckpt} does not fit its config: missing {missing[:5]}, "
                         f"unexpected {result.unexpected_keys[:5]}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        tok = state.get("tokenizer")
        if tok and tok != "bytes" and Path(tok).is_dir():
            for name in TOKENIZER_FILES:
                if (Path(tok) / name).is_file():
                    shutil.copy2(Path(tok) / name, tmp / name)
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
