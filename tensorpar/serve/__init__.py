"""``tensorpar serve``: an OpenAI-compatible HTTP server over tensor-parallel ranks, with continuous batching.

:mod:`~tensorpar.serve.engine` (per-slot KV cache and the batched step every rank runs),
:mod:`~tensorpar.serve.scheduler` (rank 0's iteration-level scheduler), :mod:`~tensorpar.serve.api`
(the OpenAI wire format on FastAPI), :mod:`~tensorpar.serve.cli` (the command). See docs/serve.md.
"""
