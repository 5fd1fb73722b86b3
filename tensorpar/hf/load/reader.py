"""Reading safetensors files with plain reads: a rank's slice of a tensor, straight into its parameter.

:func:`read_header` parses a file's header, :func:`weight_map` maps every tensor of a checkpoint folder to its
file, and :class:`SafetensorsReader` reads a tensor, or the contiguous runs of one slice of it (:func:`_runs`),
with ``readinto`` into a preallocated tensor, through a bounded bounce buffer (``BOUNCE_BYTES``) when the dtype
or the device differs; :func:`read_shard` reads the slice a parameter's ``tp_dim`` and ``tp_partition`` name.
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch
import torch.nn as nn


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
