"""``tensorpar serve --pp 2``: two pipeline stages (one rank each) of the random Llama of tests/decode/test_serve.py
serve transformers' greedy tokens alone and in a batch, log-probabilities of the unsharded model, and seeded sampling
that draws what one process draws; SIGINT stops every rank with exit 0. The scheduler keeps one batch of requests
per stage in flight (:meth:`tensorpar.serve.engine.Engine.tick`): both stages compute in the same ticks, and every
request's tokens are those of pp 1."""
import threading

import pytest
import torch

from tensorpar.parallel import ParallelConfig
from tensorpar.testing import WorkerPool

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from tests.decode.test_serve import (complete_ids, hf_greedy, make_folder, prompts, start_server,  # noqa: E402
                                     stop_server)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_serve_pp2_greedy_logprobs_sampling(tmp_path, tp):
    """The launched server at (tp, pp 2), six concurrent requests on 4 slots per batch (two batches in flight):
    transformers' greedy tokens, log-probabilities of the unsharded model, a seeded request's one-process draws."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tensorpar.generate import SamplingConfig, generate_tokens
    from tensorpar.job import Job, load_model
    from tensorpar.parallel import ParallelContext
    folder = make_folder(tmp_path / "tiny")
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ps = prompts()
    want = [hf_greedy(ref, p, 12) for p in ps]
    kw = dict(temperature=0.9, top_p=0.95, seed=1234, extra_body={"top_k": 20})
    # one process, the same seeded sampler (serve seeds one generator per request, generate one per call)
    ctx = ParallelContext.single()
    model, _ = load_model(Job(parallel=ctx.config, timeout_s=60.0, folder=folder,
                              model_config=AutoConfig.from_pretrained(folder)), ctx)
    sampled = generate_tokens(model, ctx.tp, torch.tensor([ps[2]]), sampling=SamplingConfig(
        max_new_tokens=12, temperature=0.9, top_k=20, top_p=0.95, seed=1234)).tokens[0].tolist()
    eos = ref.config.eos_token_id
    sampled = sampled[:sampled.index(eos)] if eos in sampled else sampled

    p, url = start_server(folder, "--pp", "2", "--max-batch", "4", "--max-model-len", "64", "--served-model-name",
                          "tiny", tp=tp)
    try:
        c = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        together = [None] * len(ps)

        def one(i):
            together[i] = complete_ids(c, ps[i], 12)[0]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(ps))]   # 6 requests on 4 slots
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # exact: fp32, logits that differ from one process by reordered sums only (~1e-6)
        assert together == want
        got, r = complete_ids(c, ps[0], 6, logprobs=3)
        with torch.no_grad():
            lp = torch.log_softmax(ref(torch.tensor([ps[0] + got])).logits[0].double(), -1)
        for j, t in enumerate(got):          # 1e-4: fp32 log-softmax over 53 logits, computed vocab-parallel
            row = lp[len(ps[0]) - 1 + j]
            assert r.choices[0].logprobs.token_logprobs[j] == pytest.approx(float(row[t]), abs=1e-4)
            assert sorted(r.choices[0].logprobs.top_logprobs[j].values(), reverse=True) == pytest.approx(
                row.topk(3).values.tolist(), abs=1e-4)
        assert complete_ids(c, ps[2], 12, **kw)[0] == sampled
    finally:
        rc, left = stop_server(p)
    assert rc == 0, p.stderr.read()[-3000:]
    assert left == ""


NEW = [12, 5, 9, 3, 12, 7, 10, 4, 8, 6]       # tokens per request: the batches change under the running ones


def _requests():
    """Ten prompts of 1 to 17 tokens (two share a 9-token prefix: a prefix-cache hit across batches); request 3 is
    sampled with a seed, request 5 asks for log-probabilities (top 3)."""
    from tests.decode.test_serve import VOCAB
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(0, len(VOCAB) - 1, (n,), generator=g).tolist() for n in (3, 11, 6, 17, 1, 9, 14, 2, 5, 8)]
    ps[6] = ps[1][:9] + ps[6][9:]
    return ps


def job_serve(ctx, folder, num_blocks):
    """Rank 0 runs the serve scheduler on :func:`_requests` (all submitted at once, 4 per batch at most, a pool of
    ``num_blocks`` blocks of 4 positions), the other ranks follow its plans (tensorpar.serve.engine.follow), as in
    ``tensorpar serve``. Returns rank 0's events per request and preemptions (``None``, 0 elsewhere) and this
    rank's :class:`~tensorpar.serve.ticks.PipelineStats`."""
    from transformers import AutoConfig

    from tensorpar.job import Job, load_model
    from tensorpar.serve.engine import Engine, follow
    from tensorpar.serve.scheduler import Request, Scheduler
    model, _ = load_model(Job(parallel=ctx.config, timeout_s=60.0, folder=folder,
                              model_config=AutoConfig.from_pretrained(folder)), ctx)
    engine = Engine(model, ctx.tp, max_batch=4, max_len=64, pp=ctx.pp, block_size=4, num_blocks=num_blocks)
    if ctx.rank != 0:
        follow(engine)
        return None, 0, engine.stats
    sched = Scheduler(engine, eos=set(), prefix_caching=True)
    ps, left = _requests(), [len(NEW)]
    outs = [[] for _ in ps]

    def emit(ev, out):
        out.append(ev[1:] if ev[0] == "token" else ev)
        if ev[0] in ("done", "error"):
            left[0] -= 1
            if not left[0]:
                sched.stop()
    for i, p in enumerate(ps):
        kw = dict(temperature=0.9, top_k=20, top_p=0.95, seed=1234) if i == 3 else {}
        sched.submit(Request(p, NEW[i], lambda ev, out=outs[i]: emit(ev, out), logprobs=3 if i == 5 else -1, **kw))
    sched.run()
    return outs, sched.preemptions, engine.stats


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.decode.test_serve import make_folder
    return make_folder(tmp_path_factory.mktemp("serve_pp") / "tiny")


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_pipelined_batches_overlap_and_equal_pp1(tiny, tp):
    """Ten concurrent requests of different lengths through the real scheduler and engine at (tp, pp 2), with a
    pool that holds them all and with one of 12 blocks that preempts: every request's tokens are those of pp 1
    (greedy ones also transformers' greedy tokens; the seeded sampled one draws what it draws at pp 1),
    log-probabilities within 1e-5 of pp 1 (fp32; other rows in the batch change the matmuls' summation order,
    ~1e-6); and the schedule overlaps: ticks in which both stages computed, counted on each rank (with one
    micro-batch in flight, as before this schedule, there are none)."""
    from transformers import AutoModelForCausalLM

    from tensorpar.parallel import ParallelContext
    ref = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    pool = WorkerPool(2 * tp, ParallelConfig(tp=tp, pp=2), collective_timeout_s=60.0)
    try:
        for num_blocks in (64, 12):
            want, pre1, _ = job_serve(ParallelContext.single(), tiny, num_blocks)
            res = pool.run(job_serve, tiny, num_blocks)
            _check(want, res, ref if num_blocks == 64 else None)
            if num_blocks == 12:
                assert pre1 > 0 and res[0][1] > 0, (pre1, res[0][1])     # both preempted
    finally:
        pool.close()


def _check(want, res, ref):
    for i, p in enumerate(_requests() if ref is not None else []):
        if i != 3:     # exact: greedy tokens in fp32, logits that differ by reordered sums only
            with torch.no_grad():
                x = torch.tensor([p])
                g = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW[i], do_sample=False,
                                 min_new_tokens=NEW[i], pad_token_id=0, eos_token_id=None)
            assert [e[0] for e in want[i] if len(e) == 4] == g[0, len(p):].tolist(), i
    got = res[0][0]
    for i in range(len(NEW)):
        toks = [(e[0], e[3]) for e in got[i] if len(e) == 4]
        assert toks == [(e[0], e[3]) for e in want[i] if len(e) == 4], f"request {i}"
        assert got[i][-1] == want[i][-1], f"request {i}: {got[i][-1]}"
        if i == 5:
            for (_, lp, top, _), (_, lp1, top1, _) in zip(got[i][:-1], want[i][:-1]):
                assert lp == pytest.approx(lp1, abs=1e-5)
                assert [t for t, _ in top] == [t for t, _ in top1]
                assert [v for _, v in top] == pytest.approx([v for _, v in top1], abs=1e-5)
    stats = [st for _, _, st in res]
    for r, st in enumerate(stats):
        assert st.stages_busy[2] > 0, f"rank {r}: no tick in which both stages computed: {dict(st.stages_busy)}"
        assert st.busy_ticks > 0
    assert stats[0].stages_busy == stats[-1].stages_busy        # every rank ran the same ticks
