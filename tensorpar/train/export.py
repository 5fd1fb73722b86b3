"""Export a training checkpoint as a Hugging Face model folder (``from_pretrained`` loads it).

A checkpoint stores its weights under the model's own parameter names at full-shape coordinates, in the
pieces the ranks wrote (any layout), so export is: build the transformers model from the checkpoint's
``config.json``, assemble each full tensor on this process with ``torch.distributed.checkpoint``
(:func:`tensorpar.train.checkpoint.read_full`; export is a one-off that may hold the whole model), load them
into the model (strictly: only a tied LM head may be absent), ``save_pretrained`` into a new temporary
folder next to the destination, add the tokenizer files and a marker (:data:`MARKER`, listing every file written),
and move the result into place.

The destination is never emptied: it must be new, an empty folder, or a previous tensorpar export
(its marker) that ``overwrite`` allows replacing and that holds no file the marker does not list.
Only files a previous export wrote (listed in its marker) are ever removed.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from tensorpar.train.checkpoint import latest_checkpoint, read_full, read_state, tensor_dirs

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja")
MARKER = "tensorpar_export.json"
MARKER_FORMAT = "tensorpar-export-v1"


def _marker_files(folder: Path) -> set[str] | None:
    """The files a previous export listed in ``folder``'s marker, or None if it has no valid marker."""
    try:
        m = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(m, dict) or m.get("format") != MARKER_FORMAT or not isinstance(m.get("files"), list):
        return None
    return {str(f) for f in m["files"] if isinstance(f, str) and "/" not in f and f not in ("", ".", "..")}


def check_export_dir(out: str | os.PathLike, *, overwrite: bool = False) -> None:
    """Raise unless :func:`export_hf` may write ``out`` (run before training, and again by the export).

    Raises:
        FileExistsError: ``out`` is a file; a non-empty folder that is not a tensorpar export; a previous
            export without ``overwrite`` (``--overwrite``); a previous export holding files it did not write.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--export {str(out)!r} is a file; choose a new or empty folder")
    if not out.is_dir():
        return
    entries = sorted(p.name for p in out.iterdir() if p.name != ".lock")   # .lock: the run's (launch.locked_folder)
    if not entries:
        return
    listed = _marker_files(out)
    if listed is None:
        raise FileExistsError(f"--export {str(out)!r} is not empty and is not a tensorpar export "
                              f"(no {MARKER}); nothing in it is touched: choose a new or empty folder")
    if not overwrite:
        raise FileExistsError(f"--export {str(out)!r} holds a previous tensorpar export; pass --overwrite to "
                              f"replace it, or choose another folder")
    foreign = [e for e in entries if e not in listed and e != MARKER]
    if foreign:
        raise FileExistsError(f"--export {str(out)!r} holds files a tensorpar export did not write {foreign[:5]}; "
                              f"move them away or choose another folder")


@contextlib.contextmanager
def _progress_bars(on: bool):
    """transformers' progress bars on or off (its module-wide switch) for the ``with`` block, then as before."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if on == was:
        yield
        return
    (hf_logging.enable_progress_bar if on else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_marker(folder: Path, files: list[str], ckpt: Path) -> None:
    tmp = folder / f".{MARKER}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps({"format": MARKER_FORMAT, "checkpoint": str(ckpt), "files": sorted(files)}, indent=1))
    os.replace(tmp, folder / MARKER)


def export_hf(ckpt: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False,
              progress: bool = True) -> Path:
    """Write the checkpoint at ``ckpt`` (or the latest one under it) as a Hugging Face folder ``out``.

    The weights are saved in fp32; the model's tokenizer files are copied when the run used a model
    folder's tokenizer, and a byte-level run gets :meth:`ByteTokenizer.to_transformers
    <tensorpar.data.tokenizers.ByteTokenizer.to_transformers>` (``tokenizer.json`` and
    ``tokenizer_config.json``: ``AutoTokenizer`` encodes text to its UTF-8 bytes, the ids it was trained on).
    Everything is written into a new temporary sibling folder first; a new ``out`` is then one rename, an
    existing one (empty, or a previous export with ``overwrite``) gets each file by ``os.replace``, the marker last,
    and only then loses the files of the previous export that the new one does not have. ``progress=False`` hides
    transformers' "Writing model shards" bar. Returns ``out``.

    Raises:
        FileExistsError: see :func:`check_export_dir` (nothing is written in that case).
        ValueError: the checkpoint's tensors do not fit its config (naming them).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt = latest_checkpoint(ckpt)
    state = read_state(ckpt)
    out = Path(out)
    check_export_dir(out, overwrite=overwrite)
    config = AutoConfig.from_pretrained(ckpt)
    config.use_cache = True
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = read_full(tensor_dirs(ckpt, state)[0], expect=state.get("tensors") or None)
    result = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise ValueError(f"checkpoint {ckpt} does not fit its config: missing {missing[:5]}, "
                         f"unexpected {result.unexpected_keys[:5]}")
    parent = out.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".tmp-export-{out.name or 'out'}-"))  # new: never someone's
    try:
        with _progress_bars(progress):
            model.save_pretrained(tmp)
        tok = state.get("tokenizer")
        if tok == "bytes":  # ids are UTF-8 bytes: a tokenizer.json that AutoTokenizer loads to the same ids
            from tensorpar.data.tokenizers import ByteTokenizer
            ByteTokenizer().to_transformers().save_pretrained(tmp)
        elif tok and Path(tok).is_dir():
            for name in TOKENIZER_FILES:
                if (Path(tok) / name).is_file():
                    shutil.copy2(Path(tok) / name, tmp / name)
        files = sorted(p.name for p in tmp.iterdir() if p.is_file())
        mask = _umask()  # mkdtemp (0700) and some writers (0600) ignore the umask: give it back its say
        os.chmod(tmp, 0o777 & ~mask)
        for name in files:
            os.chmod(tmp / name, 0o666 & ~mask)
        if any(p.is_dir() for p in tmp.iterdir()):
            raise RuntimeError(f"save_pretrained wrote sub-folders into {tmp}; export expects only files")
        _write_marker(tmp, files, ckpt)
        if not out.exists():
            os.rename(tmp, out)
            return out
        check_export_dir(out, overwrite=overwrite)  # again: the folder may have changed during the save
        previous = _marker_files(out) or set()
        if previous:  # while files move, the marker lists old and new, so a retry after a crash still works
            _write_marker(out, sorted(previous | set(files)), ckpt)
        for name in files:
            os.replace(tmp / name, out / name)
        _write_marker(out, files, ckpt)
        for name in sorted(previous - set(files)):  # written by the previous export, not by this one
            (out / name).unlink(missing_ok=True)
    finally:
        if tmp.exists():  # only our own temporary folder is removed
            shutil.rmtree(tmp, ignore_errors=True)
    return out
