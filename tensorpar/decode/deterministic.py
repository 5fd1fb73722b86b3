"""The lean path's batch-invariant mode (``generate --deterministic``, ``serve --deterministic``): its tile size and
the rule the launcher and the ranks apply before running it (:class:`~tensorpar.decode.lean.LeanDecoder`'s
``deterministic``; the mode itself is in :meth:`~tensorpar.decode.lean.LeanDecoder.forward_segments`)."""
from __future__ import annotations

from tensorpar.comm.compress import BLOCK as COMPRESS_BLOCK

#: tokens per tile of the batch-invariant mode (``LeanDecoder(deterministic=True)``): every matmul, norm,
#: element-wise op and all-reduce of the token-wise work runs on ``[DETERMINISTIC_TILE, ...]`` tensors (the last
#: tile padded with zero rows), so the kernels, their blocking and their thread split are the same whatever the
#: step's token count; 16 = serve's default ``--max-batch`` (a full decode batch is one tile)
DETERMINISTIC_TILE = 16


def deterministic_unsupported(config, *, lean_why: str | None, pp: int, tp_comm: str) -> str | None:
    """Why ``serve --deterministic`` cannot run ``config`` with these settings (``None``: it can): the rule the
    launcher applies before any rank starts; the ranks apply the same one to the loaded model
    (:class:`~tensorpar.serve.engine.Engine`, :class:`LeanDecoder`). ``lean_why``: why the model has no lean
    decode path (:func:`tensorpar.hf.families.why_not` of ``"fast_decode"``), ``pp``: ``--pp``, ``tp_comm``:
    ``--tp-comm``."""
    from tensorpar.hf.families.moe import moe_layers
    if lean_why is not None:
        return f"it needs the lean decode path, which this model has not ({lean_why})"
    if pp > 1:
        return f"it runs the whole model on each rank: --pp {pp} is not supported, use --pp 1"
    if moe_layers(config):
        return "this model has mixture-of-experts blocks, which route the step's tokens together"
    h = config.hidden_size
    if tp_comm == "int8" and h % COMPRESS_BLOCK:
        return (f"--tp-comm int8 quantizes blocks of {COMPRESS_BLOCK} values, which would span two tokens of this "
                f"model's hidden size {h}; use --tp-comm fp32")
    return None
