"""Pipeline parallelism on ``torch.distributed.pipelining``: stage modules cut from a tensor-parallel decoder.

:mod:`tensorpar.pipeline.stages` cuts a sharded Hugging Face decoder into stage modules that keep the
original parameter names; :mod:`tensorpar.pipeline.trainer` runs (tp, pp, dp) training steps with torch's
pipeline schedules (GPipe, 1F1B, interleaved 1F1B).
"""
from tensorpar.pipeline.stages import DecoderStage, chunk_ranges, cut_stages

__all__ = ["DecoderStage", "chunk_ranges", "cut_stages"]
