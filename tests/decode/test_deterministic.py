"""``serve --deterministic``: a request's greedy tokens and log-probabilities are bitwise the same alone and in a
batch of 16 other concurrent requests (different prompt lengths, one sharing its prompt prefix: a prefix-cache
hit), through the real scheduler (continuous batching, paged KV blocks, prefix caching) at tp=2 on gloo.

The reference is the same server running the request alone; "bitwise" is ``==`` on the floats (no tolerance:
that is the property). Without the flag the same schedule gives log-probabilities that differ in their last bits
(the matmuls see other row counts), which the CI test checks too, so that it proves something on this model.
"""
import argparse

import pytest
import torch

from tests._ranks import run_tp
from tests.decode.test_serve import VOCAB, make_folder

NEW = 12
TARGET = 13             # the request under test: this prompt length


def _prompts():
    g = torch.Generator().manual_seed(7)
    target = torch.randint(0, len(VOCAB) - 1, (TARGET,), generator=g).tolist()
    others = [torch.randint(0, len(VOCAB) - 1, (n,), generator=g).tolist()
              for n in (1, 2, 3, 5, 6, 8, 9, 11, 14, 17, 20, 23, 26, 29, 31)]
    others.append(target[:9] + [3, 1, 4])           # shares 2 blocks of 4 with the target: a prefix-cache hit
    return target, others


def job_alone_vs_batched(ctx, folder, dtype, deterministic):
    """Rank 0 schedules (the serve scheduler), the others follow its plans. Returns rank 0's (tokens, logprobs,
    top-3) of the target alone, then of the target submitted with 16 others (max_tokens differing, so the batch
    changes under it), or ``None`` on the other ranks."""
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.serve.engine import Engine, follow
    from tensorpar.serve.scheduler import Request, Scheduler
    model, _ = build_parallel_model(folder, ctx.tp, dtype=getattr(torch, dtype))
    engine = Engine(model, ctx.tp, max_batch=17, max_len=64, block_size=4, num_blocks=17 * 16,
                    deterministic=deterministic)
    target, others = _prompts()
    results = []
    for batch in ([], others):
        if ctx.tp.rank != 0:
            follow(engine)
            continue
        sched = Scheduler(engine, eos=set(), prefix_caching=True)
        outs, left = [], [1 + len(batch)]

        def emit(ev, out):
            if ev[0] == "token":
                out.append((ev[1], ev[2], ev[3]))
            elif ev[0] in ("done", "error"):
                assert ev[0] == "done", ev
                left[0] -= 1
                if not left[0]:
                    sched.stop()
        for i, p in enumerate([target] + batch):
            out = []
            outs.append(out)
            sched.submit(Request(p, NEW if i == 0 else 3 + i % 11, lambda ev, out=out: emit(ev, out), logprobs=3))
        sched.run()
        results.append(outs[0])
    return results if ctx.tp.rank == 0 else None


def alone_and_batched(pools, tp, dtype, deterministic, tmp_path):
    folder = make_folder(tmp_path / "tiny")
    alone, batched = run_tp(pools, tp, job_alone_vs_batched, folder, dtype, deterministic)[0]
    assert len(alone) == len(batched) == NEW
    return alone, batched


def test_deterministic_alone_equals_batched_tp2(pools, tmp_path):
    """tp=2, fp32: with --deterministic bitwise equal; without it the log-probabilities differ (this test's
    shape is one where batching changes the bits)."""
    alone, batched = alone_and_batched(pools, 2, "float32", True, tmp_path)
    assert batched == alone
    alone, batched = alone_and_batched(pools, 2, "float32", False, tmp_path)
    assert [t for t, *_ in batched] == [t for t, *_ in alone]       # greedy tokens agree on this model ...
    assert batched != alone, "without --deterministic the batch did not change any bit: the test proves nothing"
