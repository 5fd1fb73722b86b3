"""``tensorpar serve --pp 2``: two pipeline stages (one rank each) of the random Llama of tests/decode/test_serve.py
serve transformers' greedy tokens alone and in a batch, log-probabilities of the unsharded model, and seeded sampling
that draws what one process draws; SIGINT stops every rank with exit 0."""
import threading

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from tests.decode.test_serve import (complete_ids, hf_greedy, make_folder, prompts, start_server,  # noqa: E402
                                     stop_server)


@pytest.mark.slow
def test_serve_pp2_greedy_logprobs_sampling(tmp_path):
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
                          "tiny", tp=1)
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
