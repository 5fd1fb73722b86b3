"""Prompts and mixed serving steps as rows of one token in the row step (tensorpar/decode/step_rows.py): the logits of
every step within fp32 rounding of the general loop's, which rows run where, and the segments the conversion
refuses."""
import pytest
import torch

from tensorpar.decode import fused, gemv_kernel
from tensorpar.decode.kv_cache import Segment
from tensorpar.decode.step_rows import as_rows, merge
from tests.decode.test_generate import ARCHS, make_model_folder

needs_kernels = pytest.mark.skipif(not (gemv_kernel.available() and fused.available()),
                                   reason="no AVX-512 / AVX2 CPU or no C++ compiler for the fused kernels")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return str(make_model_folder(tmp_path_factory.mktemp("step_rows") / "llama", "llama"))


def _steps(vocab):
    """Three steps of a paged server (blocks of 4 positions, 16 per slot): three new prompts (one padded group,
    17 tokens); their decodes beside a 40-token prompt (more than the row step's 32 rows: the general loop); four
    decodes beside a 30-token prompt (34 rows: the decodes in one program, the prompt alone in a second)."""
    g = torch.Generator().manual_seed(3)
    p = {n: torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 9, 3, 40, 30)}
    return p


def _run(folder, row_step: bool):
    from tensorpar.decode.row_step import RowStep
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.parallel import ParallelContext
    from tensorpar.serve.engine import Engine
    from tensorpar.serve.plan import Row, StepPlan
    ctx = ParallelContext.single()
    model, _ = build_parallel_model(folder, ctx.tp, dtype=torch.float32)
    engine = Engine(model, ctx.tp, max_batch=32, max_len=64, block_size=4, num_blocks=32 * 16)
    assert engine.lean.row_step is not None
    if not row_step:
        engine.lean.row_step = None
    calls = []
    call = RowStep.__call__

    def counted(self, ids, pos, g, **k):
        calls[-1].append(g.b)
        return call(self, ids, pos, g, **k)
    p = _steps(ARCHS["llama"]["vocab_size"])
    table = lambda slot: list(range(slot * 16, slot * 16 + 16))                  # noqa: E731
    plans = [[Row(0, p[5], 0, blocks=table(0)), Row(1, p[9], 0, blocks=table(1)), Row(2, p[3], 0, blocks=table(2))]]
    out = []
    RowStep.__call__ = counted
    try:
        lens = [5, 9, 3]
        for step in range(3):
            calls.append([])
            rows = plans[step] if step == 0 else None
            if step == 1:
                rows = [Row(i, [int(out[-1][i].argmax())], lens[i], blocks=table(i)) for i in range(3)]
                rows.append(Row(3, p[40], 0, blocks=table(3)))
            if step == 2:
                lens = [n + 1 for n in lens] + [40]
                rows = [Row(i, [int(out[-1][i].argmax())], lens[i], blocks=table(i)) for i in range(4)]
                rows.append(Row(4, p[30], 0, blocks=table(4)))
            out.append(engine._compute(StepPlan("step", rows)))
    finally:
        RowStep.__call__ = call
    return out, calls


@needs_kernels
def test_prompts_and_mixed_steps_as_rows_equal_the_general_loop(llama):
    """A padded group of three prompts runs as one program of their 17 tokens (the pads left out); a 40-token prompt
    goes to the general loop beside the decodes' program; a 30-token prompt that does not fit beside four decodes
    runs in a second program; every step's logits within 1e-5 of the largest of the general loop's (the fused norms
    and attention sum in another order; the GEMV is the same kernel), argmax equal."""
    rows, calls = _run(llama, True)
    ref, ref_calls = _run(llama, False)
    assert calls == [[17], [3], [4, 30]], calls
    assert ref_calls == [[], [], []]
    for step, (a, b) in enumerate(zip(rows, ref)):
        assert a.shape == b.shape, (step, a.shape, b.shape)
        err = (a - b).abs().max().item()
        assert err <= 1e-5 * b.abs().max().item(), f"step {step}: {err}"
        assert torch.equal(a.argmax(-1), b.argmax(-1)), step


@pytest.fixture(scope="module")
def qllama(tmp_path_factory):
    """The llama of test_quant.py (hidden 288: whole blocks of 32 for int8)."""
    from tests.decode import test_generate as tg
    from tests.decode.test_quant import QARCHS
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(tg.ARCHS, "llama", QARCHS["llama"])
        return str(make_model_folder(tmp_path_factory.mktemp("step_rows_q") / "llama", "llama"))


def _chunked(folder, row_step: bool, b: int, fmt: str, steps: int = 3):
    """Greedy decode of ``b`` rows (5-token prompts) by a LeanDecoder of ``max_batch`` b, fp32 weights (blocked) or
    ``--quantize fmt``'s: each step's logits and the row counts of the row step's programs."""
    from tensorpar.decode.lean import LeanDecoder
    from tensorpar.decode.quantize import apply_quantize
    from tensorpar.decode.row_step import RowStep
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.parallel import ParallelContext
    ctx = ParallelContext.single()
    model, _ = build_parallel_model(folder, ctx.tp, dtype=torch.float32)
    if fmt != "none":
        apply_quantize(model, ctx.tp, fmt)
    dec = LeanDecoder(model, ctx.tp, max_batch=b, max_len=16)
    assert dec.blocked == (fmt == "none") and dec.row_step is not None
    if not row_step:
        dec.row_step = None
    ids = torch.randint(3, ARCHS["llama"]["vocab_size"], (b, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    pos = mask.cumsum(-1) - 1
    calls, call = [], RowStep.__call__
    RowStep.__call__ = lambda self, ids, p, g, **k: calls.append(g.b) or call(self, ids, p, g, **k)
    try:
        out = [dec.prefill(ids, mask, pos)]
        for t in range(steps):
            out.append(dec.decode(out[-1].argmax(-1).view(b, 1), pos[:, -1:] + 1 + t, 5 + t))
    finally:
        RowStep.__call__ = call
    return out, calls


@needs_kernels
@pytest.mark.parametrize("fmt", ["none", "bf16", "int8"])
def test_decode_rows_beyond_the_row_step_run_in_chunks(llama, qllama, fmt):
    """A decoder of 40 rows, more than the row step's MAX_ROWS (32), keeps the blocked fp32 weights (or the stored
    weights of ``--quantize``) and runs each decode step as two row-step programs, 32 rows then 8 (before: fp32
    weights prepacked for oneDNN, and every format in the general loop); fp32 and bf16 weights: every step's logits
    within 1e-5 of the largest of the general loop's on the same weights, argmax equal (int8: the row step and the
    general loop may round an activation to the other quantization step, test_row_step.py's INT8_TOL); and each
    row's logits bitwise those of the same row in a decoder of 8 rows (the row step's sums do not depend on the
    rows beside it)."""
    b = gemv_kernel.MAX_ROWS + 8
    folder = qllama if fmt == "int8" else llama
    rows, calls = _chunked(folder, True, b, fmt)
    ref, ref_calls = _chunked(folder, False, b, fmt)
    assert calls == [gemv_kernel.MAX_ROWS, 8] * 3, calls
    assert ref_calls == []
    for step, (a, r) in enumerate(zip(rows, ref)):
        assert a.shape == r.shape == (b, ARCHS["llama"]["vocab_size"]), (step, a.shape)
        if fmt != "int8":
            assert (a - r).abs().max().item() <= 1e-5 * r.abs().max().item(), step
            assert torch.equal(a.argmax(-1), r.argmax(-1)), step
    small, _ = _chunked(folder, True, 8, fmt)
    for step in range(1, 4):                # the decode steps (the prefill is the general loop's, at its rows)
        assert torch.equal(rows[step][:8], small[step]), step


def _segment(b, s, length, mask=None, write=None):
    pos = torch.arange(length - s, length).expand(b, s).contiguous()
    return Segment(b, s, mask, length, blocks=torch.zeros(b, 2, dtype=torch.long), cache_pos=pos, write=write)


def test_as_rows_takes_the_stored_tokens_and_refuses_what_it_cannot_run():
    """The stored tokens become rows (each row's logits its last token's); refused: a row whose last token is not
    stored, a query that does not attend to its own position, several tokens per row under longrope."""
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    mask = causal.expand(2, 1, 4, 4).contiguous()
    write = torch.tensor([[False, True, True, True], [True, True, True, True]])
    ids, pos = torch.arange(8), torch.arange(8)
    r = as_rows(ids, pos, _segment(2, 4, 4, mask, write), per_row_rope=False)
    assert r.n == 7 and r.ids.tolist() == [1, 2, 3, 4, 5, 6, 7] and r.last.tolist() == [2, 6] and not r.whole
    assert r.cache_pos.tolist() == [1, 2, 3, 0, 1, 2, 3] and r.mask[0].tolist() == [True, True, False, False]
    last_unstored = torch.tensor([[True, True, True, False], [True, True, True, True]])
    assert as_rows(ids, pos, _segment(2, 4, 4, mask, last_unstored), per_row_rope=False) is None
    blind = mask.clone()
    blind[1, 0, 2, 2] = False                                  # row 1's third token does not see itself
    assert as_rows(ids, pos, _segment(2, 4, 4, blind), per_row_rope=False) is None
    assert as_rows(ids, pos, _segment(2, 4, 4, mask), per_row_rope=True) is None
    one = as_rows(torch.arange(2), torch.arange(2), _segment(2, 1, 4), per_row_rope=True)
    assert one is not None and one.whole and one.mask is None


def test_merge_widens_each_rows_mask_to_the_longest_part():
    """Parts of other lengths: one segment of their rows, a part without a mask attending to its own length only,
    block tables padded with block 0; ``last`` indexes the merged rows."""
    decode = as_rows(torch.arange(2), torch.arange(2), _segment(2, 1, 3), per_row_rope=False)
    causal = torch.ones(2, 2, dtype=torch.bool).tril().view(1, 1, 2, 2)
    prompt = as_rows(torch.arange(2), torch.arange(2), _segment(1, 2, 2, causal), per_row_rope=False)
    ids, pos, seg, last = merge([decode, prompt])
    assert seg.b == 4 and seg.s == 1 and seg.length == 3 and seg.blocks.shape == (4, 2)
    assert seg.mask.view(4, 3).tolist() == [[True, True, True], [True, True, True], [True, False, False],
                                            [True, True, False]]
    assert seg.cache_pos.view(-1).tolist() == [2, 2, 0, 1] and last.tolist() == [0, 1, 3]
