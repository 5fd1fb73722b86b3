"""The serve engine without HTTP: batched prefill of several new prompts equals each prompt prefilled alone, and
the int64 step-plan message round-trips every :class:`StepPlan` field (encoding alone, and broadcast over a tp
group: gloo and shared memory).

References: the same engine running each request alone (one request per step, as a request sent by itself is
served), and transformers' single-process greedy ``generate`` on the same folder.
"""
import sys

import pytest
import torch

from tensorpar.decode import fused, gemv_kernel
from tests._ranks import run_tp
from tests.decode.test_generate import make_model_folder

# prompts of different lengths (one of a single token) that land in one padded prefill forward
LENGTHS = (3, 11, 6, 17, 1, 9)
NEW = 6


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_engine")
    # llama: the lean decode path (LeanDecoder); gpt2: the module path (SlotKVCache)
    return {a: str(make_model_folder(root / a, a)) for a in ("llama", "gpt2")}


def _prompts(vocab):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def _drive(engine, schedule, rank0: bool, blocks_per_slot: int = 0):
    """Run requests ``schedule`` = [(join_step, slot, prompt)] for ``NEW`` tokens each, continuous-batching style
    (each joins with its prefill at its step, next to the decodes of the running ones); every plan goes through
    ``engine.exchange`` (rank 0 sends, the others receive). ``blocks_per_slot``: a paged engine, slot ``i`` owning
    blocks ``[i * n, (i + 1) * n)``. Returns per request (tokens, logprobs, top-3)."""
    n = blocks_per_slot
    table = (lambda slot: list(range(slot * n, (slot + 1) * n))) if n else (lambda slot: None)
    from tensorpar.serve.plan import Row, StepPlan
    out = {i: ([], [], []) for i in range(len(schedule))}
    step = 0
    while any(len(o[0]) < NEW for o in out.values()):
        rows, who = [], []
        for i, (join, slot, prompt) in enumerate(schedule):
            toks = out[i][0]
            if join == step:
                rows.append(Row(slot, list(prompt), 0, False, 3, blocks=table(slot)))
            elif join < step and len(toks) < NEW:
                rows.append(Row(slot, toks[-1:], len(prompt) + len(toks) - 1, False, 3, blocks=table(slot)))
            else:
                continue
            who.append(i)
        plan = engine.exchange(StepPlan("step", rows) if rank0 else None)
        assert plan == StepPlan("step", rows)
        res = engine.step(plan, None)
        for j, i in enumerate(who):
            out[i][0].append(res.tokens[j])
            out[i][1].append(res.logprobs[j])
            out[i][2].append(res.top[j])
        step += 1
    return [out[i] for i in range(len(schedule))]


def job_batched_vs_alone(ctx, folder, vocab):
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.serve.engine import Engine, prefill_groups
    model, _ = build_parallel_model(folder, ctx.tp, dtype=torch.float32)
    engine = Engine(model, ctx.tp, max_batch=len(LENGTHS) + 1, max_len=64)
    rank0 = ctx.tp.rank == 0
    ps = _prompts(vocab)
    # alone: one request at a time, always slot 0 (the cache holds the previous request's entries: stale data)
    alone = [_drive(engine, [(0, 0, p)], rank0)[0] for p in ps]
    # all six new prompts prefilled in one step, in slots that are not their index
    together = _drive(engine, [(0, (i + 3) % 7, p) for i, p in enumerate(ps)], rank0)
    # joining a running batch: two start, the others join at step 2 (their prefill next to two decodes)
    joining = _drive(engine, [(0 if i < 2 else 2, 6 - i, p) for i, p in enumerate(ps)], rank0)
    # a step with two decode rows and two new prompts (one padded prefill group): on the lean path one forward,
    # 1 + 2 * layers all-reduces of all its tokens (the row step: the decode rows and the prompts' tokens as rows
    # of one program, step_rows.run_split); the module path one forward per group
    from tensorpar import comm
    from tensorpar.serve.plan import Row, StepPlan
    plan = StepPlan("step", [Row(0, ps[1][:8], 0), Row(1, ps[4], 0), Row(2, [5], 9), Row(3, [7], 4)])
    assert len(prefill_groups([8, 1])) == 1
    with comm.counting(ctx.tp) as c:
        engine.step(plan, None)
    layers = model.config.num_hidden_layers
    all_reduces = c.calls["all_reduce"] if ctx.tp.size > 1 else None
    split = engine.lean is not None and engine.lean.row_step is not None
    return alone, together, joining, engine.lean is not None, all_reduces, layers, split


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_batched_prefill_equals_prefill_alone(pools, folders, arch, tp):
    """Several new prompts of different lengths prefilled in one padded forward, and new prompts joining running
    requests in one forward with their decodes (tiny random model, fp32): the same greedy tokens as each prompt
    alone and as transformers, log-probabilities equal within 1e-5 (the matmuls see other row counts: the last
    bits may differ)."""
    from transformers import AutoModelForCausalLM

    from tensorpar.serve.engine import prefill_groups
    assert prefill_groups(list(LENGTHS)) == [[3, 1, 5, 2, 0, 4]]        # really one forward, longest first
    from tests.decode.test_generate import ARCHS
    vocab = ARCHS[arch]["vocab_size"]
    results = run_tp(pools, tp, job_batched_vs_alone, folders[arch], vocab)
    ref = AutoModelForCausalLM.from_pretrained(folders[arch], dtype=torch.float32).eval()
    want = []
    for p in _prompts(vocab):
        x = torch.tensor([p])
        with torch.no_grad():
            g = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, min_new_tokens=NEW,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
        want.append(g[0, len(p):].tolist())
    for alone, together, joining, lean, all_reduces, layers, split in results:
        # the row step exists where its kernels build (AVX2 / AVX-512 and a C++ compiler, TENSORPAR_GEMV_KERNEL
        # not 0); without it the general loop runs the step as one forward too
        assert lean == (arch == "llama") and split == (lean and gemv_kernel.available() and fused.available())
        if tp > 1:          # embedding + 2 per layer per forward; the argmax is an all-gather
            assert all_reduces == (1 + 2 * layers) * (1 if lean else 2), all_reduces
        assert [a[0] for a in alone] == want
        for other in (together, joining):
            assert [o[0] for o in other] == want
            for a, o in zip(alone, other):
                assert o[1] == pytest.approx(a[1], abs=1e-5)
                for ta, to in zip(a[2], o[2]):
                    assert [t for t, _ in to] == [t for t, _ in ta]
                    assert [v for _, v in to] == pytest.approx([v for _, v in ta], abs=1e-5)


def _plans():
    from tensorpar.serve.plan import PLAN_WORDS, Row, StepPlan
    long = list(range(7, 7 + PLAN_WORDS + 300))                          # longer than one message
    return [StepPlan("stop"), StepPlan("noop"), StepPlan("step"),
            StepPlan("step", [Row(3, [1, 2, 3], 0, True, 5), Row(0, [9], 17, False, -1),
                              Row(31, [0], 1023, True, 0), Row(2, [2**40, 5], 4, False, 20)]),
            StepPlan("step", [Row(1, long, 0, False, -1), Row(5, [4], 9, True, 2)]),
            # block tables (paged serving): with the tokens, between rows of the static layout
            StepPlan("step", [Row(4, [1, 2], 20, False, -1, [4, 9, 2, 40]), Row(0, [3], 5, True, 0),
                              Row(7, [8], 70, False, 3, list(range(100, 100 + PLAN_WORDS)))])]


def test_plan_encoding_round_trips_every_field():
    from tensorpar.serve.plan import decode_plan, encode_plan, Row, StepPlan
    for plan in _plans():
        t = encode_plan(plan)
        assert t.dtype == torch.int64 and t.dim() == 1
        back = decode_plan(t)
        assert back == plan and type(back.rows[0].sampled if back.rows else True) is bool
        assert decode_plan(torch.cat([t, torch.zeros(10, dtype=torch.int64)])) == plan   # padding ignored
    with pytest.raises(ValueError, match="out of step"):
        decode_plan(torch.zeros(16, dtype=torch.int64))
    with pytest.raises(ValueError, match="op must be one of"):
        encode_plan(StepPlan("pause", [Row(0, [1], 0)]))


def job_exchange(ctx, fast: bool):
    from tensorpar.serve.engine import Engine
    group = ctx.tp
    if fast:
        from tests._shm import fast_twin
        group = fast_twin(ctx)
    eng = Engine.__new__(Engine)                 # exchange needs only the groups and the device
    eng.tp, eng.plans, eng.device = group, group, torch.device("cpu")
    try:
        return [eng.exchange(p if group.rank == 0 else None) for p in _plans()]
    finally:
        if fast:
            from tensorpar.shm import disable_fast_collectives
            disable_fast_collectives(group)


@pytest.mark.parametrize("fast", [False, True], ids=["gloo", "shm"])
def test_exchange_delivers_every_plan(pools, fast):
    for got in run_tp(pools, 2, job_exchange, fast):
        assert got == _plans()


@pytest.mark.skipif(not (gemv_kernel.available() and fused.available()),
                    reason="no AVX-512 / AVX2 CPU or no C++ compiler for the row step's kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_row_step_equals_one_block_per_row(folders, monkeypatch, dtype):
    """The row step over a paged cache (4-position blocks, the server's block tables; rows reach 28 positions) gives
    the tokens and log-probabilities of the engine with one block of max_len per row, bitwise: attention reads the
    same keys in the same order; requests join next to running decodes, their prompts as rows of one token in the
    same program (RowStep.run_split, step_rows.run_split). bf16 (the row step's 4 rows, ``max_batch`` 4): the
    same, on the bf16 cache."""
    from tensorpar.decode.row_step import RowStep
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.parallel import ParallelContext
    from tensorpar.serve.engine import Engine
    from tests.decode.test_generate import ARCHS
    lengths, call = [], RowStep.__call__
    monkeypatch.setattr(RowStep, "__call__",
                        lambda self, ids, pos, g, **k: lengths.append(g.length) or call(self, ids, pos, g, **k))
    monkeypatch.setattr(sys.modules[__name__], "NEW", 12)                  # longer rows: more blocks each
    ctx = ParallelContext.single()
    model, _ = build_parallel_model(folders["llama"], ctx.tp, dtype=dtype)
    slots = 7 if dtype == torch.float32 else 4
    schedule = [(0 if i < 2 else 2, slots - 1 - i, p)
                for i, p in enumerate(_prompts(ARCHS["llama"]["vocab_size"])[:slots])]
    out, ran = {}, {}
    for name, kw, n in (("static", {}, 0), ("paged", dict(block_size=4, num_blocks=slots * 16), 16)):
        lengths.clear()
        engine = Engine(model, ctx.tp, max_batch=slots, max_len=64, **kw)
        assert engine.lean.row_step is not None
        out[name], ran[name] = _drive(engine, schedule, True, blocks_per_slot=n), max(lengths, default=0)
        del engine
    assert ran["paged"] > 4 and ran["static"] == ran["paged"], ran
    assert out["paged"] == out["static"]


def job_rope(ctx, folder, prompts):
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.serve.engine import Engine
    model, _ = build_parallel_model(folder, ctx.tp, dtype=torch.float32)
    engine = Engine(model, ctx.tp, max_batch=4, max_len=96)
    rank0 = ctx.tp.rank == 0
    alone = [_drive(engine, [(0, 0, p)], rank0)[0][0] for p in prompts]
    together = [o[0] for o in _drive(engine, [(0, i, p) for i, p in enumerate(prompts)], rank0)]
    # the long request joins at step 2, its prefill next to the short ones' decodes
    joining = [o[0] for o in _drive(engine, [(2 if len(p) > 64 else 0, i + 1, p) for i, p in enumerate(prompts)],
                                    rank0)]
    return alone, together, joining


@pytest.mark.parametrize("arch,rope", [("llama", "longrope"), ("phi3", "longrope"), ("llama", "dynamic")])
def test_rope_scaling_request_alone_equals_batched(pools, tmp_path, arch, rope):
    """rope_scaling whose factors depend on the length (longrope: short factors up to 32 tokens, long above): a
    short request's greedy tokens are the same alone, prefilled with a 70-token request, and decoding next to its
    prefill, and equal transformers' generate of it alone (both on the lean path since phi3 has it); tp=2."""
    from tests.decode.test_generate import hf_alone, make_rope_folder, rope_prompts
    folder = make_rope_folder(tmp_path / f"{arch}_{rope}", arch, rope)
    prompts = rope_prompts(arch)
    want = hf_alone(folder, prompts, NEW)
    for r, (alone, together, joining) in enumerate(run_tp(pools, 2, job_rope, folder, prompts)):
        assert alone == want, f"{arch} {rope} rank {r}: alone"
        assert together == want, f"{arch} {rope} rank {r}: prefilled together"
        assert joining == want, f"{arch} {rope} rank {r}: joining a running batch"


def job_argmax(ctx, rows):
    """Each rank's slice of the global ``rows`` ``[b, V]`` (vocab split 5 / 4 at tp=2): the vocab-parallel argmax."""
    from tensorpar.serve.tokens import vocab_parallel_argmax
    V = rows.shape[1]
    part = ctx.tp.partition(V, what="vocab_size")
    lo, hi = part.range(ctx.tp.rank)
    return vocab_parallel_argmax(rows[:, lo:hi].contiguous(), ctx.tp, partition=part)


@pytest.mark.parametrize("tp", [1, 2])
def test_vocab_parallel_argmax_equals_argmax(pools, tp):
    """The vocab-parallel argmax is torch.argmax of the whole row: ties across ranks go to the lowest index, a NaN
    wins (as torch's), -inf rows and one-rank maxima included."""
    nan, inf = float("nan"), float("inf")
    rows = torch.tensor([[0.0, 1.0, 3.0, 2.0, -1.0, 3.0, 0.5, 3.0, 0.0],      # a tie across the ranks: index 2
                         [0.0, 1.0, 1.0, 2.0, 0.0, 1.0, 0.5, 7.0, 0.0],       # on rank 1
                         [-inf] * 9,
                         [0.0, 1.0, 2.0, 0.0, 0.0, nan, 0.5, 9.0, nan],        # the first NaN
                         [nan, 1.0, 2.0, 0.0, 0.0, 0.0, 0.5, 9.0, 0.0]])
    for got in run_tp(pools, tp, job_argmax, rows):
        assert got.tolist() == rows.argmax(-1).tolist()
