"""The KV block pool a serving rank allocates (``--kv-cache-memory``, ``--max-batch``, ``--max-model-len``), sized
and checked in the launching process with the rule the ranks use."""
from __future__ import annotations


def parse_memory(text: str) -> tuple[str, float]:
    """``--kv-cache-memory``: ``("bytes", n)`` for ``12345``, ``96MiB``, ``2GB`` ... or ``("fraction", f)`` for a
    plain number in (0, 1) (``0.5``, ``5e-1``; a plain ``1`` is one byte, not all the memory). Raises ValueError
    naming the setting."""
    import re

    units = {"": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if m is None or m.group(2) not in units:
        raise ValueError(f"--kv-cache-memory must be bytes (a number with an optional unit: KB, MB, GB, TB, KiB, MiB, "
                         f"GiB, TiB; e.g. 96MiB, 2GiB, 100000000) or a fraction in (0, 1) of the available memory, "
                         f"got {text!r}")
    v = float(m.group(1))
    if not m.group(2) and 0 < v < 1:
        return "fraction", v
    if not m.group(2) and v != int(v):
        raise ValueError(f"--kv-cache-memory {text}: a plain number of 1 or more is a count of bytes, which is whole; "
                         f"give a fraction in (0, 1) of the available memory (e.g. 0.5) or bytes with a unit "
                         f"(e.g. {text.strip()}GiB)")
    n = v * units[m.group(2)]
    if n < 1:
        raise ValueError(f"--kv-cache-memory must be positive, got {text!r}")
    return "bytes", n


def _size(n: int) -> str:
    return f"{n} bytes" if n < 2**20 else f"{n} bytes ({n / 2**20:.1f} MiB)"


def ranks_on_host(world: int) -> int:
    """The ranks of a launch of ``world`` ranks (``tp x pp x ep``) that share this host's memory: under torchrun its
    ``LOCAL_WORLD_SIZE`` (``--nproc-per-node``; the other nodes' ranks are on other hosts), else all of them (the
    elastic launcher starts every rank here)."""
    import os

    from tensorpar.rank_errors import under_torchrun

    if under_torchrun():
        return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ["WORLD_SIZE"])
    return world


def stage_layers_max(config, pp: int) -> int:
    """Decoder layers of the largest pipeline stage at ``pp`` stages (the ranks' cut,
    :func:`tensorpar.pipeline.inference.stage_of`): what the KV cache of a rank holds; every layer at ``pp = 1``."""
    if pp <= 1:
        return config.num_hidden_layers
    from tensorpar.pipeline.inference import stage_of

    return max(len(stage_of(config, r, pp).layers) for r in range(pp))


def _mem_available() -> int:
    """The host's available memory, bytes (``MemAvailable`` of /proc/meminfo)."""
    with open("/proc/meminfo") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:"))


def _available(ranks_here: int) -> int:
    """Bytes a rank may take: the device's free memory, or on a CPU the host's available memory shared by the
    ``ranks_here`` ranks on it."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0]
    return _mem_available() // max(ranks_here, 1)


def weight_bytes_per_rank(config, dtype: str, tp: int, pp: int = 1) -> int:
    """An estimate of one rank's weight bytes: the model's parameters (:func:`~tensorpar.planner.model_spec.
    from_hf_config`, embedding and LM head included) in ``dtype``, split evenly over ``tp x pp`` (uneven splits and
    ``--quantize`` hold at most about this); 0 for a model the planner's spec does not describe."""
    import torch

    from tensorpar.planner.model_spec import from_hf_config
    try:
        n = from_hf_config(config.to_dict()).total_params()
    except (ValueError, KeyError, TypeError):
        return 0
    return int(n * torch.empty(0, dtype=getattr(torch, dtype)).element_size() // (max(tp, 1) * max(pp, 1)))


def kv_pool(config, tp: int, dtype: str, max_len: int, max_batch: int, *, block_size: int, memory: str | None,
            weights=None, pp: int = 1, ep: int = 1) -> tuple[int, int]:
    """``(num_blocks, bytes_per_block)`` of the KV pool each rank allocates: ``memory`` (``--kv-cache-memory``)
    divided by the bytes of a block on the rank holding the most KV heads and, at ``pp`` stages, the most layers
    (:func:`stage_layers_max`; :func:`~tensorpar.decode.kv_cache.block_bytes`, the rule the ranks' pool is allocated
    with, :class:`~tensorpar.decode.kv_cache.LeanKVCache` of their stage's layers), or by default ``max_batch``
    requests of ``max_len`` positions. The memory available per rank (:func:`_available`) is shared by the ranks of
    the ``tp x pp x ep`` launch on this host (:func:`ranks_on_host`), and holds the rank's weights
    (:func:`weight_bytes_per_rank`) besides its pool: a fraction is of that memory for both, as vLLM's
    ``--gpu-memory-utilization``. Raises ValueError, naming the setting and what works, when the pool cannot hold
    one request of ``max_len`` or does not fit beside the weights in the memory available per rank."""
    import torch

    from tensorpar.decode.kv_cache import block_bytes
    from tensorpar.layers.attention import HeadLayout

    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    d = getattr(config, "head_dim", None) or config.hidden_size // heads
    lay = HeadLayout.make(heads, kv, d, tp, split_weights=weights)
    kv_local = max(lay.local_kv_heads(r) for r in range(tp))
    per_block = block_bytes(stage_layers_max(config, pp), kv_local, block_size, d,
                            torch.empty(0, dtype=getattr(torch, dtype)).element_size())
    per_request = -(-max_len // block_size)
    avail = _available(ranks_on_host(tp * max(pp, 1) * max(ep, 1)))
    wts = weight_bytes_per_rank(config, dtype, tp, pp)
    free = avail - wts                                  # what a rank has for its pool once its weights are loaded
    at = f"tp={tp}" + (f", pp={pp}" if pp > 1 else "")
    if memory is None:
        need = max_batch * per_request * per_block
        if need > free:         # else the allocation fails inside every rank after launch
            raise ValueError(f"--max-batch {max_batch} x --max-model-len {max_len} needs a KV pool of {_size(need)} per "
                             f"rank at {at}, more than the {_size(max(int(free), 0))} available per rank here beside its "
                             f"weights (~{_size(wts)}); lower --max-batch or --max-model-len, or size the pool with "
                             f"--kv-cache-memory")
        return max_batch * per_request, per_block
    kind, v = parse_memory(memory)
    if kind == "fraction":
        v = v * avail - wts
        if v < per_request * per_block:
            raise ValueError(f"--kv-cache-memory {memory}: that share of the {_size(int(avail))} available per rank "
                             f"here leaves {_size(max(int(v), 0))} for the KV pool beside the rank's weights "
                             f"(~{_size(wts)}); one request of --max-model-len {max_len} needs "
                             f"{_size(per_request * per_block)}: give a larger fraction or bytes")
    elif v > free:              # else the allocation fails inside every rank (or the OOM killer ends one)
        raise ValueError(f"--kv-cache-memory {memory} is more than the {_size(max(int(free), 0))} available per rank "
                         f"here beside its weights (~{_size(wts)}); give at most that, or a fraction such as 0.5")
    n = int(v // per_block)
    if n < per_request:
        raise ValueError(f"--kv-cache-memory {memory} holds {n} KV block(s) of {block_size} positions "
                         f"({per_block} bytes each on a rank at {at}); one request of --max-model-len {max_len} "
                         f"needs {per_request}: give at least {_size(per_request * per_block)}, or lower "
                         f"--max-model-len")
    return n, per_block
