"""The decode room: what ``generate``, ``serve`` and ``verify`` run per token on a sharded model.

:mod:`.lean` (the lean decode path, :class:`~tensorpar.decode.lean.LeanDecoder`, with its static KV cache),
:mod:`.prepare` (whether a model can run it, and its fused projections), :mod:`.kernels` (the per-layer calls it
runs instead of the framework's), :mod:`.slot_cache` (the module path's per-slot KV cache), :mod:`.rope` (rotary
factors per row for longrope), :mod:`.int8` (the int8 weight format and its matmul) and :mod:`.quantize`
(``--quantize int8``). It depends on :mod:`tensorpar.hf` (the module classes and family records); nothing in
``hf`` imports it. The decode loop that drives it is :class:`tensorpar.serve.engine.Engine`.
"""
