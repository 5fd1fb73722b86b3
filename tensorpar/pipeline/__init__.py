"""Pipeline parallelism on ``torch.distributed.pipelining``: stage modules cut from a tensor-parallel decoder.

:mod:`tensorpar.pipeline.stages` cuts a sharded Hugging Face decoder into stage modules that keep the
original parameter names, and :func:`~tensorpar.pipeline.stages.build_schedule` makes torch's pipeline schedule
(GPipe, 1F1B, interleaved 1F1B) over them, which :class:`tensorpar.train.loop.Trainer` runs at pp > 1.
:mod:`tensorpar.pipeline.inference` holds the stages of ``generate`` and ``serve --pp`` (the same cut; the
residual stream sent stage to stage by the decode engine).
"""
from tensorpar.pipeline.stages import DecoderStage, build_schedule, chunk_ranges, cut_stages

__all__ = ["DecoderStage", "build_schedule", "chunk_ranges", "cut_stages"]
