"""``serve --deterministic``: a request's greedy tokens and log-probabilities are bitwise the same alone and in a
batch of 16 other concurrent requests (different prompt lengths and output lengths; one, submitted first, shares
two prompt blocks with it, which it then takes from the prefix cache and computes only the rest), through the real
scheduler (continuous batching, paged KV blocks, prefix caching) at tp=2 on gloo.

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
    # first: shares 2 blocks of 4 with the target, which then waits a step and reuses them (a prefix-cache hit)
    return target, [target[:9] + [3, 1, 4]] + others


def job_alone_vs_batched(ctx, folder, dtype, deterministic, quantize="none", row_step=True, block=True):
    """Rank 0 schedules (the serve scheduler), the others follow its plans. Returns rank 0's (tokens, logprobs,
    top-3) of the target alone, then of the target submitted second among 16 others (max_tokens differing, so the
    batch changes under it), and the prompt tokens found in the prefix cache in that second run; ``None`` on the
    other ranks."""
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.serve.engine import Engine, follow
    from tensorpar.serve.scheduler import Request, Scheduler
    model, _ = build_parallel_model(folder, ctx.tp, dtype=getattr(torch, dtype))
    from tensorpar.decode.quantize import apply_quantize
    apply_quantize(model, ctx.tp, quantize)
    engine = Engine(model, ctx.tp, max_batch=17, max_len=64, block_size=4, num_blocks=17 * 16,
                    deterministic=deterministic, block=block)
    if not row_step and engine.lean is not None:
        engine.lean.row_step = None         # the general loop only: one forward of the step's tokens
    target, others = _prompts()
    results = []
    for batch in ([target], others[:1] + [target] + others[1:]):
        if ctx.tp.rank != 0:
            follow(engine)
            continue
        sched = Scheduler(engine, eos=set(), prefix_caching=True)
        outs, left = [], [len(batch)]

        def emit(ev, out):
            if ev[0] == "token":
                out.append((ev[1], ev[2], ev[3]))
            elif ev[0] in ("done", "error"):
                assert ev[0] == "done", ev
                left[0] -= 1
                if not left[0]:
                    sched.stop()
        for i, p in enumerate(batch):
            out = []
            outs.append(out)
            n = NEW if p is target else 3 + i % 11
            sched.submit(Request(p, n, lambda ev, out=out: emit(ev, out), logprobs=3))
        sched.run()
        results.append(next(o for o, p in zip(outs, batch) if p is target))
    return (*results, sched.blocks.hits) if ctx.tp.rank == 0 else None


def alone_and_batched(pools, tp, dtype, deterministic, tmp_path, quantize="none", folder=None, row_step=True,
                      block=True):
    if folder is None:
        folder = make_folder(tmp_path / "tiny") if quantize == "none" else make_q8_folder(tmp_path / "q8")
    alone, batched, hits = run_tp(pools, tp, job_alone_vs_batched, folder, dtype, deterministic, quantize,
                                  row_step, block)[0]
    assert len(alone) == len(batched) == NEW and hits == 8      # the target's first 8 tokens came from the cache
    return alone, batched


def test_deterministic_alone_equals_batched_tp2(pools, tmp_path):
    """tp=2, fp32: with --deterministic bitwise equal; without it, in the general loop (one forward of the step's
    tokens) on the plain weights (``block=False``: ``torch.mm`` for steps of more than 32 tokens), the
    log-probabilities differ (this test's shape is one where batching changes the bits). On our GEMV's blocked
    weights (the default) every matmul sums each row alone at any row count; that general loop and the row step
    (which runs this test's steps: every token its own row of at most 32, the prompts too) give the same greedy
    tokens; their bits are not asserted (not every op is batch-invariant without the flag)."""
    alone, batched = alone_and_batched(pools, 2, "float32", True, tmp_path)
    assert batched == alone
    alone, batched = alone_and_batched(pools, 2, "float32", False, tmp_path, row_step=False, block=False)
    assert [t for t, *_ in batched] == [t for t, *_ in alone]       # greedy tokens agree on this model ...
    assert batched != alone, "without --deterministic the batch did not change any bit: the test proves nothing"
    for row_step in (False, True):
        alone, batched = alone_and_batched(pools, 2, "float32", False, tmp_path, row_step=row_step)
        assert [t for t, *_ in batched] == [t for t, *_ in alone]


@pytest.mark.slow
@pytest.mark.parametrize("tp,dtype", [(1, "float32"), (1, "bfloat16"), (2, "bfloat16"), (3, "float32"),
                                      (3, "bfloat16")])
def test_deterministic_alone_equals_batched(pools, tmp_path, tp, dtype):
    """The other tp degrees and bf16 (tp=3: 3 of the 9 query heads and one KV head per rank; the gloo all-reduce
    of three ranks, replaced by an all-gather summed in rank order)."""
    alone, batched = alone_and_batched(pools, tp, dtype, True, tmp_path)
    assert batched == alone


def make_q8_folder(path):
    """A random Llama whose matmul inputs are whole blocks of 32 (``--quantize int8`` takes it)."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    cfg = LlamaConfig(vocab_size=len(VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                      tie_word_embeddings=False, initializer_range=0.5)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).float().save_pretrained(path)
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_deterministic_int8_weights(pools, tmp_path, tp):
    """``--quantize int8`` (the int8 x int8 matmul per block of 32, on tiles of fixed row count too)."""
    alone, batched = alone_and_batched(pools, tp, "float32", True, tmp_path, quantize="int8")
    assert batched == alone


FAMILIES = {       # a sliding window shorter than the prompts; soft-capping and a window; OLMo 2's q/k norm
    "mistral": dict(sliding_window=8, head_dim=4),
    "gemma2": dict(sliding_window=8, head_dim=4, attn_logit_softcapping=20.0, final_logit_softcapping=10.0,
                   query_pre_attn_scalar=4),
    "olmo2": dict(eos_token_id=None, pad_token_id=None, bos_token_id=None)}


@pytest.mark.slow
@pytest.mark.parametrize("arch,tp", [("mistral", 2), ("gemma2", 2), ("olmo2", 3)])
def test_deterministic_families(pools, tmp_path, arch, tp):
    """Per-token attention over a sliding window (and Gemma 2's soft-capped kernel); OLMo 2's q/k-norm all-reduce
    over three gloo ranks (summed in rank order)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model(arch, vocab_size=len(VOCAB), hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                               num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
                               tie_word_embeddings=False, **FAMILIES[arch])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).float().save_pretrained(tmp_path / arch)
    alone, batched = alone_and_batched(pools, tp, "float32", True, tmp_path, folder=str(tmp_path / arch))
    assert batched == alone


def _args(folder, *extra):
    from tensorpar.serve import cli
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(["--model", folder, "--port", "0", *extra])


def test_deterministic_flag_reaches_the_task_and_bad_combinations_are_refused(tmp_path):
    """--deterministic goes into the job every rank runs (prefix caching stays on: cached blocks are bitwise what
    the request computes alone); what cannot be batch-invariant is one line before launch, and the ranks apply
    the same rule to the loaded model."""
    from transformers import MixtralConfig

    from tensorpar.decode.lean import deterministic_unsupported
    from tensorpar.serve import cli
    from tests.decode.test_generate import make_model_folder
    folder = make_folder(tmp_path / "tiny")
    task = cli.validate(_args(folder, "--deterministic", "--tp", "2")).task
    assert task.deterministic and task.prefix_caching
    assert not cli.validate(_args(folder, "--tp", "2")).task.deterministic
    gpt2 = str(make_model_folder(tmp_path / "gpt2", "gpt2"))
    for folder_, extra, msg in [
            (gpt2, (), r"--deterministic: it needs the lean decode path, which this model has not \("),
            (folder, ("--pp", "2"), r"--deterministic: it runs the whole model on each rank: --pp 2 is not "
                                    r"supported, use --pp 1"),
            (folder, ("--tp", "2", "--tp-comm", "int8"), r"--deterministic: --tp-comm int8 quantizes blocks of 32 "
                                                         r"values, which would span two tokens of this model's "
                                                         r"hidden size 36; use --tp-comm fp32")]:
        with pytest.raises(ValueError, match=msg):
            cli.validate(_args(folder_, "--deterministic", *extra))
    moe = MixtralConfig(hidden_size=32, num_hidden_layers=2, num_local_experts=4)
    assert "mixture-of-experts" in deterministic_unsupported(moe, lean_why=None, pp=1, tp_comm="fp32")
    # the ranks' rule on the loaded model: the module path refuses the mode
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.parallel import ParallelContext
    from tensorpar.serve.engine import Engine
    ctx = ParallelContext.single()
    model, _ = build_parallel_model(gpt2, ctx.tp, dtype=torch.float32)
    with pytest.raises(ValueError, match="deterministic .batch-invariant. decoding needs the lean decode path"):
        Engine(model, ctx.tp, max_batch=2, max_len=16, deterministic=True)


def test_generate_deterministic_batch_equals_alone(tmp_path):
    """``generate --deterministic``: the flag reaches the task (refused where serve refuses it), and a batch of
    prompts of different lengths (left-padded) gives each prompt its tokens alone (tp=1; generate prints tokens
    only, and on this tiny model they agree with the mode off too: the serve test above is the one that shows the
    bits move without it)."""
    from tensorpar import generate as gen
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.parallel import ParallelContext
    from tensorpar.serve.tokens import SamplingConfig
    from tests.decode.test_generate import make_model_folder
    folder = make_folder(tmp_path / "tiny")
    p = argparse.ArgumentParser()
    gen.add_arguments(p)
    assert gen.validate(p.parse_args(["--model", folder, "--deterministic"])).task.deterministic
    gpt2 = str(make_model_folder(tmp_path / "gpt2", "gpt2"))
    with pytest.raises(ValueError, match="--deterministic: it needs the lean decode path"):
        gen.validate(p.parse_args(["--model", gpt2, "--deterministic"]))
    ctx = ParallelContext.single()
    model, _ = build_parallel_model(folder, ctx.tp, dtype=torch.float32)
    target, others = _prompts()
    rows = [target, others[0], others[9]]
    s = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (s - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (s - len(r)) + [1] * len(r) for r in rows])
    sampling = SamplingConfig(NEW)
    batch = gen.generate_tokens(model, ctx.tp, ids, mask, sampling=sampling, deterministic=True).tokens.tolist()
    alone = [gen.generate_tokens(model, ctx.tp, torch.tensor([r]), sampling=sampling,
                                 deterministic=True).tokens[0].tolist() for r in rows]
    assert batch == alone
