"""Sharded loading: build a Hugging Face model on the meta device, shard it by its plan, and let
each rank read only its own slices of the safetensors files.

The slice a rank reads for a parameter is given by the parameter's own ``tp_dim`` and
``tp_partition`` (set by the plan at module replacement), so the plan is the one source of
truth for both.

Files are read with plain reads (:class:`SafetensorsReader`), not memory-mapped: a safetensors file
is an 8-byte little-endian header length, a JSON header (``dtype``, ``shape``, ``data_offsets``
per tensor) and the row-major data, so the bytes of a rank's slice are a list of contiguous runs
(one per selected block of rows, times the product of the dimensions before the split one). Each
run is read with ``readinto`` straight into the preallocated, contiguous parameter; when the file's
dtype differs from the model's or the parameter lives on an accelerator, runs go through a bounded
bounce buffer (``BOUNCE_BYTES``) and are converted by ``copy_`` chunk by chunk. A rank's memory
therefore grows by its shard (plus the bounce buffer), never by the whole file, and no parameter is
a view into a mapping of the file (see ``bench/bench_load.py`` for the measurement).

Before any weight is read, :func:`check_checkpoint` compares the checkpoint's headers with the
model the config describes, in both directions (missing tensors, unused tensors, wrong shapes).
"""
from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

import torch
import torch.nn as nn

from tensorpar.comm import Group
from tensorpar.hf.apply import parallelize
from tensorpar.hf.plan import ShardingPlan, make_plan

_META_ATTRS = ("tp_dim", "tp_partition", "sequence_parallel", "ep_dim", "ep_partition")

#: bytes of the staging buffer used when a read needs a dtype conversion or a device copy
BOUNCE_BYTES = 8 << 20

#: safetensors dtype strings (https://github.com/huggingface/safetensors, ``Dtype``) -> torch dtypes
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def read_header(path: str | Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file (``__metadata__`` removed) and the byte offset of its data.

    Reads only ``8 + header length`` bytes. Raises ValueError naming the file when the header is
    truncated or not JSON.
    """
    path = Path(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path}: too short for a safetensors header; the file is truncated or corrupt")
        (n,) = struct.unpack("<Q", prefix)
        raw = f.read(n)
    if len(raw) < n:
        raise ValueError(f"{path}: header claims {n} bytes but the file is shorter; the file is truncated")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: safetensors header is not valid JSON ({e})") from None
    header.pop("__metadata__", None)
    return header, 8 + n


class SafetensorsReader:
    """One safetensors file opened for plain (unmapped) reads of whole tensors or of slices.

    Use as a context manager or call :meth:`close`. ``keys()``, ``shape(name)`` and ``dtype(name)``
    come from the header; :meth:`read` reads data. Only little-endian hosts are supported (the format
    is little-endian; every platform torch ships for is).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.header, self.data_start = read_header(self.path)
        self._f = open(self.path, "rb", buffering=0)
        self._bounce: torch.Tensor | None = None

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        code = self.header[name]["dtype"]
        if code not in DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has dtype {code}, which tensorpar cannot read "
                             f"(readable: {', '.join(DTYPES)})")
        return DTYPES[code]

    def close(self) -> None:
        self._f.close()
        self._bounce = None

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _read_exact(self, offset: int, view: memoryview) -> None:
        self._f.seek(offset)
        done = 0
        while done < len(view):
            n = self._f.readinto(view[done:])
            if not n:
                raise ValueError(f"{self.path}: unexpected end of file at byte {offset + done}; the file is truncated")
            done += n

    def read(self, name: str, *, dim: int | None = None, indices=None, out: torch.Tensor | None = None,
             dtype: torch.dtype | None = None, device=None, bounce_bytes: int | None = None) -> torch.Tensor:
        """Read tensor ``name``, or its rows ``indices`` along ``dim``, into a contiguous tensor.

        Args:
            name: tensor name in the header.
            dim: the dimension to select along; ``None`` reads the whole tensor.
            indices: increasing global indices along ``dim`` (any iterable of ints).
            out: contiguous destination of the selected shape (allocated if ``None``), any dtype/device.
            dtype / device: of the allocated ``out`` (default: the file's dtype, CPU).
            bounce_bytes: staging buffer size when ``out`` is not CPU memory of the file's dtype
                (default ``BOUNCE_BYTES``).

        Returns ``out``. Memory used beyond ``out``: at most ``bounce_bytes``. Raises ValueError for a
        dtype it cannot read, an ``out`` of the wrong shape or not contiguous, or a truncated file.
        """
        info = self.header[name]
        src_dtype = self.dtype(name)
        shape = tuple(info["shape"])
        item = torch.empty((), dtype=src_dtype).element_size()
        begin = self.data_start + info["data_offsets"][0]
        if dim is None:
            runs, want = [(0, shape[0])] if shape else [(0, 1)], shape
            dim_ = 0
        else:
            dim_ = dim % len(shape)
            runs = _runs(list(indices))
            want = shape[:dim_] + (sum(b - a for a, b in runs),) + shape[dim_ + 1:]
        if out is None:
            out = torch.empty(want, dtype=dtype or src_dtype, device=device or "cpu")
        if tuple(out.shape) != tuple(want) or not out.is_contiguous():
            raise ValueError(f"destination for {name!r} must be a contiguous tensor of shape {tuple(want)}, "
                             f"got shape {tuple(out.shape)} (contiguous={out.is_contiguous()})")
        if out.numel() == 0:
            return out
        segments = _segments(shape, item, dim_, runs) if shape else iter([(0, item)])
        if out.dtype == src_dtype and out.device.type == "cpu":
            dest = memoryview(out.view(-1).view(torch.uint8).numpy())
            pos = 0
            for off, n in segments:
                self._read_exact(begin + off, dest[pos:pos + n])
                pos += n
            return out
        # conversion or device copy: stage through a bounded buffer, converting chunk by chunk
        flat = out.view(-1)
        bounce_bytes = BOUNCE_BYTES if bounce_bytes is None else bounce_bytes
        cap = max(item, min(bounce_bytes, out.numel() * item) // item * item)
        if self._bounce is None or self._bounce.numel() < cap:  # one buffer per reader, reused by every read
            self._bounce = torch.empty(cap, dtype=torch.uint8)
        bounce = self._bounce
        staged = memoryview(bounce.numpy())
        fill = 0
        done = 0  # elements of ``out`` written

        def flush():
            nonlocal fill, done
            k = fill // item
            flat[done:done + k].copy_(bounce[:fill].view(src_dtype))
            done += k
            fill = 0

        for off, n in segments:
            while n:
                take = min(n, cap - fill)
                self._read_exact(begin + off, staged[fill:fill + take])
                fill += take
                off += take
                n -= take
                if fill == cap:
                    flush()
        if fill:
            flush()
        return out


def _segments(shape: tuple[int, ...], item: int, dim: int, runs: list[tuple[int, int]]):
    """``(byte offset in the tensor, length)`` of each contiguous piece of the selection, in output
    order; pieces that are adjacent in the file are merged."""
    outer = math.prod(shape[:dim])
    n = shape[dim]
    inner = math.prod(shape[dim + 1:]) * item
    cur = None
    for o in range(outer):
        for a, b in runs:
            off, length = (o * n + a) * inner, (b - a) * inner
            if cur is not None and cur[0] + cur[1] == off:
                cur = (cur[0], cur[1] + length)
            else:
                if cur is not None:
                    yield cur
                cur = (off, length)
    if cur is not None:
        yield cur


def weight_map(folder: str | Path) -> dict[str, Path]:
    """Tensor name -> safetensors file of a Hugging Face-format folder (reads headers only).

    Raises:
        FileNotFoundError: the folder has no ``*.safetensors`` file.
        ValueError: a file's header cannot be read (truncated or corrupt), naming the file.
    """
    from tensorpar.hub import check_safetensors

    folder = Path(folder)
    check_safetensors(folder)  # headers only: truncated or corrupt files fail here, naming the file
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {folder}")
    out: dict[str, Path] = {}
    for f in files:
        for k in read_header(f)[0]:
            out[k] = f
    return out


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def read_shard(handle, name: str, param: nn.Parameter, tp_rank: int, *, out: torch.Tensor | None = None,
               dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
    """Read the part of tensor ``name`` that ``param`` holds on ``tp_rank`` (only those bytes).

    The slice is ``param.tp_partition.indices(tp_rank)`` along ``param.tp_dim`` (the whole tensor
    when the parameter has no ``tp_dim``): a :class:`~tensorpar.shard.Partition` gives one
    contiguous block, a :class:`~tensorpar.shard.UnitSelection` any increasing list of blocks.
    Shapes: stored ``[..., n, ...]`` (``n = tp_partition.n`` at ``tp_dim``) -> ``param.shape``.

    ``handle`` is a :class:`SafetensorsReader` (plain reads into a contiguous tensor, the loader's
    path), a path to a safetensors file, or a ``safetensors.safe_open`` handle (read through its
    memory map with ``get_slice``, then copied into ``out`` if given). ``out``, ``dtype`` and
    ``device`` are as in :meth:`SafetensorsReader.read`. Returns the tensor (``out`` if given).

    Raises:
        ValueError: the stored tensor's shape differs from the model's full shape, naming the tensor.
    """
    if isinstance(handle, (str, Path)):
        with SafetensorsReader(handle) as h:
            return read_shard(h, name, param, tp_rank, out=out, dtype=dtype, device=device)
    reader = isinstance(handle, SafetensorsReader)
    stored = handle.shape(name) if reader else tuple(handle.get_slice(name).get_shape())
    dim = getattr(param, "tp_dim", None)
    full = list(param.shape)
    if dim is not None:
        full[dim] = param.tp_partition.n
    if stored != tuple(full):
        raise ValueError(f"tensor {name!r} has shape {stored} in the checkpoint but the model expects {tuple(full)}")
    indices = None if dim is None else param.tp_partition.indices(tp_rank)
    if reader:
        return handle.read(name, dim=dim, indices=indices, out=out, dtype=dtype, device=device)
    sl = handle.get_slice(name)
    if dim is None:
        t = sl[:]
    else:
        parts = [sl[(slice(None),) * dim + (slice(a, b),)] for a, b in _runs(indices)]
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim)
    if out is not None:
        return out.copy_(t)
    return t.to(dtype=dtype or t.dtype, device=device or t.device)


def _checkpoint_names(model: nn.Module, keys) -> dict[str, str]:
    """Parameter name -> checkpoint key for the checkpoint keys that transformers renames when it loads
    (its ``WeightRenaming`` table for the model, e.g. GPT-NeoX's ``embed_out.*`` -> ``lm_head.*``, as the
    Pythia checkpoints and transformers' own ``save_pretrained`` write it). Keys that need a conversion
    beyond a rename are not mapped (the parameter is then reported missing). ``{}`` if this transformers
    has no such table."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key

        renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
        out: dict[str, str] = {}
        for key in keys:
            new, _ = rename_source_key(key, renamings, [])
            if new != key:
                out.setdefault(new, key)
        return out
    except (ImportError, AttributeError, TypeError):  # a transformers without (this form of) the table
        return {}


# ------------------------------------------------------------------------------------------- checks

def _natural(name: str):
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", name)]


def _few(names, k: int = 3) -> str:
    names = sorted(names, key=_natural)
    more = f", ... {len(names) - k} more" if len(names) > k else ""
    return ", ".join(names[:k]) + more


def _meta_model(config, dtype=torch.float32):
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


class _Expected:
    """What a model (unsharded, on meta) reads from a checkpoint: each parameter under all its
    (tied) names with its full shape, the buffer names, and the patterns transformers ignores."""

    def __init__(self, model: nn.Module):
        self.groups: dict[int, list[str]] = {}
        self.shape: dict[str, tuple[int, ...]] = {}
        self.floating: dict[str, bool] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            self.groups.setdefault(id(p), []).append(name)
            full = list(p.shape)
            if getattr(p, "tp_dim", None) is not None:
                full[p.tp_dim] = p.tp_partition.n
            self.shape[name] = tuple(full)
            self.floating[name] = p.is_floating_point()
        tied = getattr(model, "get_expanded_tied_weights_keys", None)  # transformers >= 5: {alias: source}
        for alias, source in (tied(all_submodels=True) if tied is not None else {}).items():
            # the meta model is not tied yet (init_empty_weights); merge the alias into its source's group
            ga = next((k for k, v in self.groups.items() if alias in v), None)
            gs = next((k for k, v in self.groups.items() if source in v), None)
            if ga is not None and gs is not None and ga != gs:
                self.groups[gs] += self.groups.pop(ga)
        self.buffers = {n for n, _ in model.named_buffers(remove_duplicate=False)}
        self.ignore = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
        self.prefix = getattr(model, "base_model_prefix", "") or ""
        self._model, self._renamed = model, None

    def key(self, name: str, stored) -> str | None:
        """The checkpoint key holding model tensor ``name``: itself, without the base-model prefix, or the key
        transformers renames to it when loading (GPT-NeoX's ``embed_out.weight`` for ``lm_head.weight``)."""
        if name in stored:
            return name
        if self.prefix and name.startswith(self.prefix + "."):
            short = name[len(self.prefix) + 1:]
            if short in stored:
                return short
        if self._renamed is None:
            self._renamed = _checkpoint_names(self._model, stored)
        key = self._renamed.get(name)
        return key if key in stored else None

    def model_name(self, key: str) -> str:
        if key in self.shape or key in self.buffers or not self.prefix:
            return key
        return f"{self.prefix}.{key}"


def _check(folder: Path, expected: _Expected, config, wmap: dict[str, Path]) -> None:
    headers: dict[Path, dict] = {f: read_header(f)[0] for f in sorted(set(wmap.values()))}
    stored = set(wmap)
    missing, wrong, used = [], [], set()
    for names in expected.groups.values():
        keys = [k for k in (expected.key(n, stored) for n in names) if k is not None]
        if not keys:  # a tied parameter needs only one of its names in the checkpoint
            missing.append(names[0])
            continue
        for n in names:
            k = expected.key(n, stored)
            if k is None:
                continue
            used.add(k)
            info = headers[wmap[k]][k]
            got = tuple(info["shape"])
            if got != expected.shape[n]:
                wrong.append(f"{k} {list(got)} (model expects {list(expected.shape[n])})")
            elif expected.floating[n] and not str(info["dtype"]).startswith(("F", "BF")):
                wrong.append(f"{k} stored as {info['dtype']} (a quantized or integer tensor; the model needs "
                             "floating point: dequantize it first)")
    unused = []
    for k in stored - used:
        n = expected.model_name(k)
        if n in expected.buffers or any(p.search(k) for p in expected.ignore):
            continue  # buffers (rotary inv_freq, attention masks) are rebuilt from the config
        unused.append(k)
    from tensorpar.hf.moe_checkpoint import layout as moe_layout
    if moe_layout(getattr(config, "model_type", None)) is not None and any(".experts." in k for k in stored):
        # stacked experts in the model, one tensor per expert in the file: read_moe_shard maps them when loading
        missing = [n for n in missing if ".experts." not in n]
        unused = [k for k in unused if ".experts." not in k]
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensors the model needs are missing ({_few(missing)})")
    if unused:
        problems.append(f"{len(unused)} checkpoint tensors are not used by the model ({_few(unused)})")
    if wrong:
        problems.append(f"{len(wrong)} tensors have the wrong shape or dtype ({_few(wrong, 2)})")
    if problems:
        layers = getattr(config, "num_hidden_layers", None)
        what = f"{getattr(config, 'model_type', '?')}" + (f", num_hidden_layers={layers}" if layers is not None else "")
        raise ValueError(f"checkpoint in {folder} does not match its config ({what}): " + "; ".join(problems)
                         + "; use the config.json the weights were saved with")


def check_checkpoint(folder: str | Path, config=None) -> None:
    """Compare the safetensors headers of ``folder`` with the model ``config`` describes, both ways.

    Reads only headers (no tensor data) and builds the unsharded model on the meta device (no
    memory). Checks that every parameter is stored (a tied parameter under any one of its names,
    e.g. ``lm_head.weight`` may be absent when ``tie_word_embeddings``), that every stored tensor is
    used by the model (buffers such as rotary ``inv_freq`` and the keys transformers itself ignores
    on load are allowed), and that shapes are the full, unsharded ones and floating point. Names may
    omit the base-model prefix (``h.0...`` for ``transformer.h.0...``), as transformers accepts.

    Args:
        folder: a Hugging Face-format folder (``*.safetensors``, optional index).
        config: its ``PretrainedConfig``; default ``AutoConfig.from_pretrained(folder)``.

    Raises:
        ValueError: one line listing each kind of mismatch with its count and a few names (e.g. a
            config of 20 layers over a checkpoint of 30: "60 checkpoint tensors are not used by the
            model (model.layers.20.input_layernorm.weight, ...)"); unreadable headers, naming the file.
        FileNotFoundError: no ``*.safetensors`` file in ``folder``.
    """
    from transformers import AutoConfig

    folder = Path(folder)
    config = config if config is not None else AutoConfig.from_pretrained(folder)
    _check(folder, _Expected(_meta_model(config)), config, weight_map(folder))


# -------------------------------------------------------------------------------------------- load

def _moe_handle(handles: dict, f: Path):
    """A ``safe_open`` handle of ``f``, opened once (per-expert MoE tensors are read through its ``get_slice``)."""
    from safetensors import safe_open

    if f not in handles:
        handles[f] = safe_open(str(f), framework="pt").__enter__()
    return handles[f]


def load_sharded(model: nn.Module, folder: str | Path, tp: Group, *, device=None, dtype=torch.float32) -> nn.Module:
    """Fill every parameter of a sharded ``model`` (meta or real) with its slice from ``folder``.

    Each parameter becomes a new contiguous tensor of exactly its shard (``dtype`` on ``device``),
    read with plain file reads (:class:`SafetensorsReader`); nothing stays mapped. Tied parameters
    are loaded once (from whichever of their names the checkpoint holds). Buffers keep the values
    the model computed from its config and are moved to ``device``.

    Raises ValueError for a missing tensor or a shape mismatch (naming the tensor) and for
    unreadable files (naming the file).
    """
    device = torch.device(device or "cpu")
    wmap = weight_map(folder)
    expected = _Expected(model)
    readers: dict[Path, SafetensorsReader] = {}
    moe_handles: dict[Path, object] = {}
    new: dict[int, nn.Parameter] = {}
    renamed = None  # checkpoint names under transformers' renamings, looked up only if a name is missing
    try:
        for name, p in model.named_parameters():
            names = expected.groups[id(p)]
            key = next((k for k in (expected.key(n, wmap) for n in names) if k is not None), None)
            if key is None:
                renamed = _checkpoint_names(model, wmap) if renamed is None else renamed
                key = renamed.get(name)
            if key is None:  # MoE experts stacked in the model, one tensor per expert in the checkpoint
                from tensorpar.hf.moe_checkpoint import read_moe_shard
                t = read_moe_shard(getattr(getattr(model, "config", None), "model_type", None), name, p, tp.rank,
                                   wmap, lambda k: _moe_handle(moe_handles, wmap[k]).get_slice(k))
                if t is None:
                    raise ValueError(f"tensor {name!r} is missing from the checkpoint in {folder}")
                t = t.to(device=device, dtype=dtype)
            else:
                f = wmap[key]
                if f not in readers:
                    readers[f] = SafetensorsReader(f)
                t = torch.empty(p.shape, dtype=dtype, device=device)
                read_shard(readers[f], key, p, tp.rank, out=t)
            q = nn.Parameter(t, requires_grad=p.requires_grad)
            for a in _META_ATTRS:
                if hasattr(p, a):
                    setattr(q, a, getattr(p, a))
            new[id(p)] = q
    finally:
        for r in readers.values():
            r.close()
        for h in moe_handles.values():
            h.__exit__(None, None, None)
    for m in model.modules():
        for pn, p in list(m._parameters.items()):
            if p is not None and id(p) in new:
                m._parameters[pn] = new[id(p)]
    for m in model.modules():  # real buffers were kept off meta; move them to the device
        for bn, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[bn] = b.to(device)
    return model


def _stored_equal(wmap: dict[str, Path], a: str, b: str, dtype: torch.dtype, chunk_bytes: int = 1 << 26) -> bool:
    """Whether checkpoint tensors ``a`` and ``b`` hold the same values in ``dtype`` (read in row chunks of at most
    ``chunk_bytes``: never two whole tensors in memory)."""
    with SafetensorsReader(wmap[a]) as ra, SafetensorsReader(wmap[b]) as rb:
        shape = ra.shape(a)
        if shape != rb.shape(b):
            return False
        if not shape:
            return torch.equal(ra.read(a, dtype=dtype), rb.read(b, dtype=dtype))
        row = max(1, math.prod(shape[1:]) * torch.empty((), dtype=dtype).element_size())
        step = max(1, chunk_bytes // row)
        for start in range(0, shape[0], step):
            rows = range(start, min(shape[0], start + step))
            if not torch.equal(ra.read(a, dim=0, indices=rows, dtype=dtype), rb.read(b, dim=0, indices=rows,
                                                                                  dtype=dtype)):
                return False
    return True


def stored_untied(folder: str | Path, config, dtype: torch.dtype = torch.float32) -> list[tuple[str, str]]:
    """Tied pairs ``(source, alias)`` (``model.embed_tokens.weight``, ``lm_head.weight``) that the checkpoint in
    ``folder`` stores under both names with different values in ``dtype``.

    transformers' ``from_pretrained`` (5.24, ``PreTrainedModel.tie_weights``) ties such a pair only when the two
    stored tensors are equal; otherwise it keeps them apart and warns. Empty when the config ties nothing or the
    checkpoint stores one name of each pair. Reads the two tensors in row chunks (bounded memory), only then."""
    import copy

    if not getattr(config, "tie_word_embeddings", False):
        return []
    model = _meta_model(copy.deepcopy(config))  # from_config would set the config's attention implementation
    tied = model.get_expanded_tied_weights_keys(all_submodels=True)  # {alias: source}
    wmap = weight_map(folder)
    expected = _Expected(model)
    out = []
    for alias, source in tied.items():
        ka, ks = expected.key(alias, wmap), expected.key(source, wmap)
        if ka is not None and ks is not None and ka != ks and not _stored_equal(wmap, ks, ka, dtype):
            out.append((ks, ka))
    return out


def follow_stored_ties(folder: str | Path, config, dtype: torch.dtype = torch.float32, *, warn: bool = True) -> None:
    """Apply transformers' loading rule for tied weights to ``config`` (in place): a checkpoint that stores a tied
    pair under both names with different values (:func:`stored_untied`) gets ``tie_word_embeddings = False``, as
    ``from_pretrained`` unties such a model (with the same warning, when ``warn``)."""
    import warnings

    pairs = stored_untied(folder, config, dtype)
    if pairs and warn:
        warnings.warn(f"{folder}: config.json ties {pairs[0][1]} to {pairs[0][0]} but the checkpoint stores both "
                      f"with different values; they are kept apart, as transformers does (set "
                      f"tie_word_embeddings=false to silence this)", stacklevel=2)
    if pairs:
        config.tie_word_embeddings = False


def resolve_attn_implementation(config) -> str:
    """The attention kernel transformers' ``from_pretrained`` gives the model of ``config``: the one the config
    names (the user's), else sdpa where the model class supports it, else eager (gemma2: its soft-capping has no
    sdpa path). Decided by transformers itself, on the meta device (no memory); the launching process and every
    rank get the same answer from the same config.

    Raises:
        ValueError: (one line) the config names an implementation the model class does not support.
    """
    import copy

    try:
        return _meta_model(copy.deepcopy(config)).config._attn_implementation
    except ValueError as e:
        raise ValueError(f"{getattr(config, 'model_type', '?')}: attention implementation "
                         f"{getattr(config, '_attn_implementation', None)!r}: {' '.join(str(e).split())[:300]}") \
            from None


def build_parallel_model(folder: str | Path, tp: Group, *, sequence_parallel: bool = False, dtype=torch.float32,
                         device=None, attn_implementation: str | None = None,
                         dropout_seed: int | None = None, user_plan=None,
                         tp_weights=None, keep=None) -> tuple[nn.Module, ShardingPlan]:
    """Meta-initialise the model of ``folder``, check the checkpoint, shard it by its plan, load this rank's slices.

    ``attn_implementation`` (``"sdpa"``, ``"eager"``, or any name transformers' attention registry
    knows) is the attention every sharded layer runs; None: the one transformers picks for the folder's config
    (:func:`resolve_attn_implementation`: sdpa, or eager for gemma2). ``tp_weights``: relative speed of each tp rank
    (:mod:`tensorpar.capacity`; ``ctx.tp_weights``), ``None`` for an even split. Returns ``(model, plan)``; the model is in
    eval mode. Raises the ValueErrors of :func:`~tensorpar.hf.plan.make_plan` (at plan time, before
    any weight is read), of :func:`check_checkpoint` (headers only) and of :func:`load_sharded`.

    ``keep(model)``, if given, runs on the sharded meta model before any weight is read; the modules it removes
    are never read nor materialised (a pipeline rank keeps only its stage:
    :func:`tensorpar.pipeline.stages.keep_stage_modules`).
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    follow_stored_ties(folder, config, dtype, warn=tp.rank == 0)  # a stored head unlike the embedding: not tied
    plan = make_plan(config, tp.size, sequence_parallel=sequence_parallel, user_plan=user_plan, tp_weights=tp_weights)
    config._attn_implementation = attn_implementation or resolve_attn_implementation(config)
    model = _meta_model(config, dtype)
    _check(Path(folder), _Expected(model), config, weight_map(folder))  # = check_checkpoint, on this meta model
    parallelize(model, plan, tp, dropout_seed=dropout_seed)
    if keep is not None:
        keep(model)
    load_sharded(model, folder, tp, device=device, dtype=dtype)
    return model.eval(), plan
