"""The engine :func:`tensorpar.generate.generate_tokens` keeps on a model between calls.

A call reuses the kept :class:`~tensorpar.serve.engine.Engine` when it has the same batch size, path, pp group,
deterministic mode, tp group (its communicator and compression included) and thread count, needs at most the
engine's positions (a new engine's ``s + max_new_tokens`` is rounded up to :data:`ENGINE_LEN_STEP`), and the model's
parameters and buffers are unchanged (:func:`_model_state`: a LoRA merge, ``quantize_int8``, ``.to()`` or
``load_state_dict`` change them); otherwise the old engine is freed and a new one built. The KV cache of the last
call's shape stays allocated between calls: :func:`release_engine` frees it (:func:`cached_engine` reads it). Only an
engine on plain weights is kept: one that packed them (more rows) is dropped at its call's end (:func:`settle`),
unless the model was marked :func:`inference_only`: then the engine holds fp32 weights in our GEMV's blocked layout
(faster) and keeps every packed layout between calls. Settings that are no tensors (a norm's ``eps``, the config) are not checked: call :func:`release_engine` after one."""
from __future__ import annotations

import torch

from tensorpar.comm import Group


#: the model's ``__dict__`` entry marking it :func:`inference_only`
INFERENCE_KEY = "_tensorpar_inference_only"
#: the model's ``__dict__`` entry holding the engine :func:`generate_tokens` reuses (:func:`cached_engine`)
ENGINE_KEY = "_tensorpar_generate_engine"
#: a new engine's ``max_len`` is the call's rounded up to a multiple of this (at most the model's
#: ``max_position_embeddings``), so a later call with a prompt a few tokens longer reuses it
ENGINE_LEN_STEP = 64


def inference_only(model) -> None:
    """Mark ``model`` as used only for inference from now on (what the ``generate`` command and the benchmarks do
    with the model they load): :func:`~tensorpar.generate.generate_tokens` may then hold its fp32 matmul weights in
    our GEMV's blocked layout (:func:`tensorpar.decode.matmuls.use_blocked`: 1.02-1.85x the plain layout's rate
    per matmul here) and keep them, and any oneDNN-packed ones, between calls, with the engine. Packed weights replace the
    plain ones: ``model.parameters()`` no longer lists them (an optimizer built then would not train them) and
    ``weight`` reads a converted copy; ``.to()`` and ``load_state_dict`` of those weights raise until
    :func:`tensorpar.decode.packed.unpack_weights` gives them back (``apply_quantize`` calls it itself). Unmarked,
    a call leaves the model's parameters as they were (it runs our GEMV on the plain weights). No collectives."""
    model.__dict__[INFERENCE_KEY] = True


def _model_state(model) -> tuple:
    """What an engine built on ``model`` depends on besides its arguments: each parameter and buffer (the object,
    its storage address, dtype, device, shape and version counter: an in-place write such as a LoRA merge
    (:func:`tensorpar.hf.lora.merge_adapter`) or ``load_state_dict`` bumps the counter, ``.to()`` replaces the
    storage, :func:`~tensorpar.decode.quantize.quantize_int8` and packing drop parameters), the quantized
    weights' record, and every module's training flag (the lean path refuses dropout in training mode) and
    number of forward hooks (e.g. the collective fingerprints' call sites, which the decoder's probes see). A write
    through ``param.data`` is not seen (``.data`` has its own version counter): call :func:`release_engine` after
    one. No collectives."""
    out = []
    for n, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        try:
            version = t._version
        except RuntimeError:            # an inference tensor: it cannot be written outside inference mode
            version = None
        out.append((n, id(t), t.data_ptr(), version, t.dtype, t.device, tuple(t.shape)))
    mods = tuple((m.training, len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules())
    return tuple(out), id(model.__dict__.get("_tensorpar_int8")), mods


class _CachedEngine:
    """An engine :func:`generate_tokens` built, with what it was built for: ``args`` (the tp and pp groups, the
    tp group's communicator and compression, the path, the deterministic mode, ``max_batch``, the thread count)
    must be the same for a call to reuse it, its ``max_len`` at least the call's, and ``state``
    (:func:`_model_state`, taken after the engine was built: building fuses and may pack the weights) the model's
    now."""
    __slots__ = ("engine", "args", "state")

    def __init__(self, engine, args: tuple, state: tuple):
        self.engine, self.args, self.state = engine, args, state

    def __deepcopy__(self, memo):
        return None         # a copy of the model builds its own engine (this one points at the original's tensors)

    def __reduce__(self):
        return type(None), ()     # pickled (torch.save of the model) as None: the engine holds C pointers


def cached_engine(model):
    """The :class:`~tensorpar.serve.engine.Engine` the last :func:`generate_tokens` call on ``model`` ran (its next
    call reuses it if it fits, see :func:`generate_tokens`), or ``None``."""
    rec = model.__dict__.get(ENGINE_KEY)
    return None if rec is None else rec.engine


def release_engine(model) -> None:
    """Drop the engine :func:`generate_tokens` keeps on ``model`` (its KV cache, ``2 * layers * max_batch *
    kv_local * max_len * head_dim`` elements per rank, and its references to the weights, e.g. oneDNN-packed
    ones, are freed with it) and give the freed memory back to the system (glibc's ``malloc_trim``: a cache
    under the 32 MiB mmap threshold lives in the heap, which keeps freed pages); the next call builds a new one.
    Call it after changing the weights in a way :func:`generate_tokens` does not see (a write through
    ``param.data``), or to free the cache (SmolLM2 fp32 tp=2 after a batch-32 call: RSS per rank back to 30 MB
    above the loaded model's from 109-132 MB, docs/memory.md). No collectives."""
    import gc
    import weakref

    from tensorpar.decode.quantize import _release_freed_memory

    rec = model.__dict__.pop(ENGINE_KEY, None)
    if rec is None:
        return
    device = rec.engine.device
    ref = weakref.ref(rec.engine)
    del rec
    if ref() is not None:       # held by a reference cycle: collect it now, before a new engine packs the weights
        gc.collect()
    _release_freed_memory(device)   # glibc keeps the freed cache in its heap (malloc_trim), CUDA in its pool


def _engine(model, tp: Group, *, max_batch: int, max_len: int, path: str, pp: Group | None, deterministic: bool):
    """The engine of a :func:`generate_tokens` call: the one the last call on ``model`` built when it fits this
    one (:class:`_CachedEngine`), else a new one, kept on ``model`` (:data:`ENGINE_KEY`) in place of the old,
    which is freed first (a new decoder may pack the weights, and the old one's references would keep a second
    copy alive). Building one fuses (and may repack) the weights, allocates the KV cache and prepares the row
    step's programs: the time-to-first-token cost a repeated call saves. Every rank takes the same decision (the
    same arguments, the same model state). No collectives here (the engine's own: none when built)."""
    from tensorpar.serve.engine import Engine

    block = bool(model.__dict__.get(INFERENCE_KEY))
    args = (tp, pp, tp.fast, tp.compression, path, deterministic, max_batch, torch.get_num_threads(), block)
    rec = model.__dict__.get(ENGINE_KEY)
    if rec is not None:
        same = len(rec.args) == len(args) and all(a is b or (type(a) in (str, int, bool) and a == b)
                                                   for a, b in zip(rec.args, args))
        if same and rec.engine.max_len >= max_len and rec.state == _model_state(model):
            return rec.engine
        del rec                     # the cache's reference only: the old engine is freed before the new is built
        release_engine(model)
    limit = getattr(model.config, "max_position_embeddings", None)
    size = -(-max_len // ENGINE_LEN_STEP) * ENGINE_LEN_STEP
    size = max_len if limit is None else max(max_len, min(size, limit))
    engine = Engine(model, tp, max_batch=max_batch, max_len=size, path=path, warm_up=False, pp=pp,
                    deterministic=deterministic, block=block)
    model.__dict__[ENGINE_KEY] = _CachedEngine(engine, args, _model_state(model))
    return engine


def settle(model) -> None:
    """End of a :func:`~tensorpar.generate.generate_tokens` call: if its engine packed the weights (more than
    :func:`~tensorpar.decode.gemv_kernel.max_rows` rows: oneDNN's layout, whose modules' ``weight`` is a converted
    copy on every access, so a write to it, a LoRA merge, ``quantize_int8`` or ``.to()`` would be lost or fail),
    drop the engine and give the model its plain parameters back (:func:`~tensorpar.decode.packed.unpack_weights`);
    the next such call packs again. An engine on plain weights, or on a model marked :func:`inference_only`, stays
    kept. No collectives."""
    from tensorpar.decode.packed import packed_model, unpack_weights

    if packed_model(model) and not model.__dict__.get(INFERENCE_KEY):
        release_engine(model)
        unpack_weights(model)

