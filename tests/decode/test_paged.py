"""The paged KV cache and its scheduler (issue 24 items 1-3): the block allocator (free list, reference counts,
prefix hash chain, LRU eviction), the scheduler's admission by free blocks, preemption and recompute, prefix
reuse, cancellation and timeouts without processes (a fake engine), and the real engine driven by the real
scheduler at tp 1, 2, 3: paged, prefix-cached and preempted requests give transformers' greedy tokens.
"""
import pytest
import torch

from tensorpar.serve.blocks import BlockAllocator, block_hashes
from tests._ranks import run_tp


# ---------------------------------------------------------------- the allocator

def test_allocate_release_refcounts():
    a = BlockAllocator(4, 2, caching=False)
    x = a.allocate(3)
    assert sorted(x) == [0, 1, 2] and a.available() == 1 and a.used() == 3
    assert a.allocate(2) is None and a.available() == 1          # all or nothing
    a.release(x[:1])
    assert a.available() == 2 and a.used() == 2
    with pytest.raises(ValueError, match="released more often"):
        a.release(x[:1])
    a.release(x[1:])
    assert a.available() == 4 and a.used() == 0
    with pytest.raises(ValueError, match="num_blocks >= 1"):
        BlockAllocator(0, 16)


def test_hash_chain_names_prefix_not_block():
    """A block's hash covers everything before it: the same tokens after a different prefix hash differently;
    a trailing partial block has no hash."""
    a = block_hashes([1, 2, 3, 4, 5], 2)
    b = block_hashes([9, 9, 3, 4], 2)
    c = block_hashes([1, 2, 3, 4], 2)
    assert len(a) == 2 and len(b) == 2
    assert a[0] != b[0] and a[1] != b[1]                         # [3, 4] after [1, 2] vs after [9, 9]
    assert c == a                                                # same prefix, same chain


def test_prefix_match_shares_blocks_and_lru_eviction():
    a = BlockAllocator(4, 2, caching=True)
    h = block_hashes([1, 2, 3, 4], 2)
    x = a.allocate(2)
    a.register(x[0], h[0])
    a.register(x[1], h[1])
    y = a.match(h)                                               # a second holder of both blocks
    assert y == x and a.refs[x[0]] == 2
    a.release(x)
    a.release(y)                                                 # reference count 0: cached, not free
    assert a.used() == 0 and a.available() == 4 and len(a.lru) == 2
    assert a.match(h[:1]) == x[:1]                               # a hit takes it out of the LRU
    a.release(x[:1])
    # evictions: the two free blocks first, then the least recently used cached block (the chain's tail first)
    got = a.allocate(3)
    assert x[1] in got and x[0] not in got
    assert a.match(h) == [x[0]]                                  # the head of the chain survives, the tail not
    a.register(got[0], h[0])                                     # a hash already cached keeps its block
    assert a.by_hash[h[0]] == x[0]
    off = BlockAllocator(2, 2, caching=False)
    b = off.allocate(1)
    off.register(b[0], h[0])
    off.release(b)
    assert off.match(h) == [] and off.available() == 2           # caching off: nothing kept


# ---------------------------------------------------------------- the scheduler, without processes

class _Engine:
    """Records plans; 'the model' answers token = 1000 + the position after the row's last token, and checks
    that every row's block table covers its positions and that no two rows write a block."""

    def __init__(self, max_batch=4, max_len=32, block_size=4, num_blocks=8):
        self.max_batch, self.max_len, self.block_size, self.num_blocks = max_batch, max_len, block_size, num_blocks
        self.plans = []

    def exchange(self, plan):
        return plan

    def step(self, plan, samplers):
        from tensorpar.serve.engine import StepResult
        written = set()
        for r in plan.rows:
            end = r.start + len(r.tokens)
            assert len(r.blocks) >= -(-end // self.block_size) and all(0 <= b < self.num_blocks for b in r.blocks)
            mine = set(r.blocks[r.start // self.block_size:(end - 1) // self.block_size + 1])
            assert not mine & written
            written |= mine
        self.plans.append(plan)
        toks = [1000 + r.start + len(r.tokens) for r in plan.rows]
        return StepResult(toks, [None] * len(toks), [None] * len(toks))


def _run(s, eng, reqs_events, limit=200):
    for _ in range(limit):
        if all(e and e[-1][0] in ("done", "error") for e in reqs_events):
            return
        s._drain(block=False)
        plan, order = s._plan()
        if not plan.rows:
            continue
        res = eng.step(plan, None)
        for i, req in enumerate(order):
            s._deliver(req, res.tokens[i], None, None, 0.0)
    raise AssertionError("requests did not finish")


def test_admission_bounded_by_blocks_and_preemption_recomputes():
    """7 blocks of 4: three of four requests of 6-token prompts (2 blocks each) start; as they grow past 8 positions
    (3 blocks each) the newest is preempted, waits at the head of the queue, and is recomputed from its prompt and
    the tokens it already produced (same tokens as if it had never stopped); nothing is refused; every block is
    free at the end."""
    from tensorpar.serve.scheduler import Request, Scheduler
    eng = _Engine(max_batch=4, num_blocks=7)
    s = Scheduler(eng, eos=set(), heartbeat_s=0.01)
    ev = [[] for _ in range(4)]
    reqs = [Request(prompt=[7] * 6, max_tokens=8, emit=ev[i].append) for i in range(4)]
    for r in reqs:
        s.submit(r)
    _run(s, eng, ev)
    first = eng.plans[0].rows
    assert [len(r.tokens) for r in first] == [6, 6, 6]            # the fourth waits for blocks
    assert s.preemptions >= 1
    for e in ev:                                                  # every request: positions 6 .. 13, no error
        assert [x[1] for x in e if x[0] == "token"] == [1000 + p for p in range(6, 14)]
        assert e[-1] == ("done", "length")
    # a preempted request comes back as one row of its prompt and produced tokens (start 0, recomputed)
    assert any(r.start == 0 and len(r.tokens) > 6 for p in eng.plans for r in p.rows)
    assert s.blocks.used() == 0 and s.blocks.available() == 7 and s.running == [] and s.waiting == []


def test_prefix_hit_computes_only_the_rest():
    from tensorpar.serve.scheduler import Request, Scheduler
    eng = _Engine(max_batch=4, num_blocks=16)
    s = Scheduler(eng, eos=set(), heartbeat_s=0.01, prefix_caching=True)
    shared = list(range(1, 11))                                   # 10 tokens: two full blocks of 4
    ev = [[], []]
    s.submit(Request(prompt=shared + [50], max_tokens=2, emit=ev[0].append))
    _run(s, eng, ev[:1])
    first = eng.plans[0].rows[0]
    s.submit(Request(prompt=shared + [60, 61], max_tokens=2, emit=ev[1].append))
    n = len(eng.plans)
    _run(s, eng, ev)
    row = eng.plans[n].rows[0]
    assert row.start == 8 and row.tokens == [9, 10, 60, 61]        # two cached blocks, the rest computed
    assert row.blocks[:2] == first.blocks[:2]                     # the same physical blocks
    assert s.blocks.hits == 8 and s.blocks.queries == 11 + 12
    assert s.blocks.used() == 0 and len(s.blocks.lru) == 3       # idle: full prompt blocks stay cached
    # a prompt that is entirely cached still computes its last block (its logits are needed)
    ev.append([])
    s.submit(Request(prompt=shared[:8], max_tokens=1, emit=ev[2].append))
    n = len(eng.plans)
    _run(s, eng, ev)
    assert eng.plans[n].rows[0].start == 4 and eng.plans[n].rows[0].tokens == shared[4:8]


def test_cancel_timeout_and_too_large_free_everything():
    import time

    from tensorpar.serve.scheduler import Request, Scheduler
    eng = _Engine(max_batch=2, num_blocks=6)
    s = Scheduler(eng, eos=set(), heartbeat_s=0.01, prefix_caching=True, timeout_s=30)
    with pytest.raises(ValueError, match="needs 20 \\+ 10 tokens: 8 KV blocks of 4; the pool has 6"):
        s.submit(Request(prompt=[1] * 20, max_tokens=10, emit=lambda e: None))
    ev = [[] for _ in range(4)]
    reqs = [Request(prompt=[i + 1] * 5, max_tokens=12, emit=ev[i].append) for i in range(4)]
    for r in reqs:
        s.submit(r)
    s._drain(block=False)
    plan, order = s._plan()
    res = eng.step(plan, None)
    for i, req in enumerate(order):
        s._deliver(req, res.tokens[i], None, None, 0.0)
    assert len(s.running) == 2 and len(s.waiting) == 2
    reqs[0].cancel()                                              # running
    reqs[2].cancel()                                              # waiting
    reqs[1].arrived -= 60                                         # running past its timeout
    plan, _ = s._plan()
    assert ev[0][-1] == ("done", "abort") and ev[2] == []
    assert ev[1][-1][0] == "error" and "--request-timeout 30 s" in ev[1][-1][1] and ev[1][-1][2] == 504
    assert [len(r.tokens) for r in plan.rows] == [5]              # only request 3, admitted in the freed blocks
    reqs[3].cancel()
    plan, _ = s._plan()
    assert plan.rows == [] and s.running == [] and s.waiting == [] and s._pending == 0
    assert s.blocks.used() == 0
    with pytest.raises(ValueError, match="--request-timeout must be > 0"):
        Scheduler(eng, eos=set(), timeout_s=0)
    assert time.perf_counter() > 0


# ---------------------------------------------------------------- the real engine and scheduler at tp 1, 2, 3

SHARED = 21          # a shared prefix of 21 tokens: 5 full blocks of 4


def _requests(vocab):
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(0, vocab, (SHARED,), generator=g).tolist()
    return [shared + torch.randint(0, vocab, (n,), generator=g).tolist() for n in (3, 1, 6, 2, 5, 4)]


def job_paged(ctx, folder, prompts, n, num_blocks):
    """Every rank runs the same scheduler on the same requests (greedy tokens are the same on every rank, so
    are the plans): two rounds of the six shared-prefix prompts, the second all prefix hits."""
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.serve.engine import Engine
    from tensorpar.serve.scheduler import Request, Scheduler
    model, _ = build_parallel_model(folder, ctx.tp, dtype=torch.float32)
    engine = Engine(model, ctx.tp, max_batch=len(prompts), max_len=64, block_size=4, num_blocks=num_blocks)
    s = Scheduler(engine, eos=set(), heartbeat_s=0.01, prefix_caching=True)
    outs = []
    for _ in range(2):
        ev = [[] for _ in prompts]
        for i, p in enumerate(prompts):
            s.submit(Request(prompt=list(p), max_tokens=n, emit=ev[i].append))
        for _ in range(500):
            if all(e and e[-1][0] in ("done", "error") for e in ev):
                break
            s._drain(block=False)
            plan, order = s._plan()
            res = engine.step(plan, None)
            for i, req in enumerate(order):
                s._deliver(req, res.tokens[i], None, None, 0.0)
        outs.append([[x[1] for x in e if x[0] == "token"] for e in ev])
    return outs, s.preemptions, s.blocks.hits, s.blocks.used()


def _hf_greedy(folder, prompts, n):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            x = torch.tensor([p])
            g = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0, eos_token_id=None)
            out.append(g[0, len(p):].tolist())
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from tests.decode.test_generate import make_model_folder
    return str(make_model_folder(tmp_path_factory.mktemp("paged") / "llama", "llama"))


@pytest.mark.parametrize("tp,num_blocks", [(1, 16), pytest.param(2, 40, marks=pytest.mark.slow),
                                           pytest.param(3, 40, marks=pytest.mark.slow),
                                           pytest.param(4, 40, marks=pytest.mark.slow),
                                           pytest.param(2, 16, marks=pytest.mark.slow)])
def test_paged_prefix_cached_greedy_equals_transformers(pools, llama, tp, num_blocks):
    """Blocks of 4 positions, a shared 21-token prefix: the first round computes it (in one padded prefill of six
    prompts), the second reuses its 5 cached blocks; 16 blocks also preempt. Tokens equal transformers' greedy
    generate of each prompt alone (exact: greedy tokens; fp32). CI: tp=1 with 16 blocks (in process; tp=2 paged
    and prefix-cached is the launched server of tests/decode/test_serve.py); tp 2 and 3: slow."""
    prompts = _requests(53)
    want = _hf_greedy(llama, prompts, 12)
    for r, (outs, pre, hits, used) in enumerate(run_tp(pools, tp, job_paged, llama, prompts, 12, num_blocks)):
        assert outs[0] == want, f"tp={tp} rank {r}: first round"
        assert outs[1] == want, f"tp={tp} rank {r}: prefix-cached round"
        assert hits >= 6 * 20, f"tp={tp}: {hits} prompt tokens hit"     # the second round: 5 blocks each
        assert used == 0
        if num_blocks == 16:
            assert pre > 0


def test_burst_sharing_a_prefix_computes_it_once():
    """Requests sent together with the same system prompt: the first computes its blocks, the others wait one
    step (the blocks are being computed) and then reuse them, instead of all computing the prefix at once."""
    from tensorpar.serve.scheduler import Request, Scheduler
    eng = _Engine(max_batch=4, num_blocks=32)
    s = Scheduler(eng, eos=set(), heartbeat_s=0.01, prefix_caching=True)
    shared = list(range(1, 13))                                   # 12 tokens: three full blocks of 4
    ev = [[] for _ in range(4)]
    for i in range(4):
        s.submit(Request(prompt=shared + [100 + i], max_tokens=2, emit=ev[i].append))
    _run(s, eng, ev)
    assert [(r.start, len(r.tokens)) for r in eng.plans[0].rows] == [(0, 13)]       # one computes the prefix
    assert sorted((r.start, len(r.tokens)) for r in eng.plans[1].rows) == [(12, 1)] * 3 + [(13, 1)]   # 3 hits, 1 decode
    assert s.blocks.hits == 3 * 12 and s.blocks.used() == 0


def test_request_larger_than_the_pool_is_a_400():
    """The API answers a request the scheduler can never run (more KV blocks than the pool) with a 400 naming
    the sizes, instead of queueing it forever."""
    import asyncio

    from tensorpar.serve.api import Api, BadRequest
    from tensorpar.serve.scheduler import Request, Scheduler
    s = Scheduler(_Engine(max_batch=2, num_blocks=3), eos=set())
    api = Api(s, None, "m", 32, None)

    async def go():
        return api.run(Request(prompt=[1] * 10, max_tokens=8, emit=None), dict(stop=[]))

    with pytest.raises(BadRequest, match="needs 10 \\+ 8 tokens: 5 KV blocks of 4; the pool has 3") as e:
        asyncio.run(go())
    assert e.value.status == 400


# ---------------------------------------------------------------- decode attention over the blocks in place

@pytest.mark.skipif(not __import__("tensorpar.decode.fused", fromlist=["available"]).available(),
                    reason="the fused decode kernels do not run on this CPU")
def test_fused_decode_attention_reads_scattered_blocks():
    """The fused decode attention (tensorpar.decode.fused.decode_attention) over a paged pool, rows in scattered
    blocks of different lengths (a mask), query heads mapped unevenly onto KV heads, equals attention over the
    gathered keys and values in float64 within fp32 rounding (1e-5 relative: the kernel sums in fp32 in its own
    order and uses expf)."""
    from tensorpar.decode import fused
    g = torch.Generator().manual_seed(0)
    n_kv, num_blocks, bs, d, nq = 2, 11, 4, 64, 5
    kpool = torch.randn(n_kv, num_blocks, bs, d, generator=g)
    vpool = torch.randn(n_kv, num_blocks, bs, d, generator=g)
    kv_of = torch.tensor([0, 0, 0, 1, 1])                          # uneven: 3 query heads on KV head 0, 2 on 1
    tables = torch.tensor([[7, 2, 9], [0, 10, 3], [5, 1, 8]])      # [rows, blocks], scattered
    lengths = [10, 12, 5]
    b, L = len(lengths), max(lengths)
    mask = torch.arange(L)[None, None, None, :] < torch.tensor(lengths)[:, None, None, None]     # [b, 1, 1, L]
    q = torch.randn(b, nq, d, generator=g)
    out = torch.empty(b, nq * d)
    scratch = torch.empty(L)
    scale = d ** -0.5
    fused.decode_attention((q.data_ptr(), b, nq, d, kpool.data_ptr(), vpool.data_ptr(), kpool.stride(0),
                            tables.data_ptr(), tables.stride(0), bs, L, mask.data_ptr(), mask.stride(0),
                            kv_of.data_ptr(), scale, scratch.data_ptr(), out.data_ptr()))
    for r in range(b):
        n = lengths[r]
        for h in range(nq):
            k = kpool[kv_of[h], tables[r]].reshape(-1, d)[:n].double()          # [n, d] in position order
            v = vpool[kv_of[h], tables[r]].reshape(-1, d)[:n].double()
            p = torch.softmax(k @ q[r, h].double() * scale, 0)
            want = (p[:, None] * v).sum(0)
            torch.testing.assert_close(out[r, h * d:(h + 1) * d].double(), want, rtol=1e-5, atol=1e-6)
