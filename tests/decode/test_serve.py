"""`tensorpar serve` end to end: a tp=2 server on a random-weight Llama, driven with the `openai` client.

The reference for every greedy token is transformers' single-process `generate` on the same folder; logprobs
are checked against `log_softmax` of the unsharded model's logits. One server is started for the module and
stopped by SIGINT in the last test (which checks exit code 0 and that nothing is left running).
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

VOCAB = [chr(ord("a") + i) for i in range(26)] + [chr(ord("A") + i) for i in range(26)] + ["<eos>"]
MAX_LEN = 64
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}.{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")


def make_folder(path, max_positions=128):
    """A random Llama (9 heads, 3 KV heads: uneven KV split at tp=2) whose greedy outputs vary, with a
    one-character-per-token tokenizer covering its whole vocabulary and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast
    cfg = LlamaConfig(vocab_size=len(VOCAB), hidden_size=36, intermediate_size=40, num_hidden_layers=2,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=4, max_position_embeddings=max_positions,
                      tie_word_embeddings=False, initializer_range=0.5, eos_token_id=len(VOCAB) - 1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).float().save_pretrained(path)
    tk = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<eos>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<eos>")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return str(path)


def start_server(folder, *extra, tp=2, timeout=300):
    env = dict(os.environ, PYTHONPATH=os.getcwd(), TENSORPAR_THREADS="1")
    p = subprocess.Popen([sys.executable, "-m", "tensorpar", "serve", "--model", folder, "--tp", str(tp),
                          "--port", "0", "--fast-collectives", "off", *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if "ready at " in line:
            return p, line.split("ready at ")[1].strip()
        if not line and p.poll() is not None:
            raise AssertionError(f"server exited with {p.returncode}: {p.stderr.read()[-3000:]}")
    p.kill()
    raise AssertionError("server did not become ready")


def stop_server(p):
    p.send_signal(signal.SIGINT)
    rc = p.wait(timeout=90)
    left = ""
    for _ in range(40):
        left = subprocess.run(["pgrep", "-a", "-s", str(p.pid)], capture_output=True, text=True).stdout.strip()
        if not left:
            break
        time.sleep(0.25)
    return rc, left


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = make_folder(tmp_path_factory.mktemp("serve") / "tiny")
    p, url = start_server(folder, "--max-batch", "4", "--max-model-len", str(MAX_LEN), "--max-waiting", "64",
                          "--served-model-name", "tiny")
    yield dict(proc=p, url=url, folder=folder, client=openai.OpenAI(base_url=url, api_key="none", max_retries=0))
    if p.poll() is None:
        p.kill()
        p.wait()


@pytest.fixture(scope="module")
def reference(server):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(server["folder"], dtype=torch.float32).eval()


def hf_greedy(model, ids, n):
    with torch.no_grad():
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                             pad_token_id=0, eos_token_id=None, min_new_tokens=n)
    new = out[0, len(ids):].tolist()
    eos = len(VOCAB) - 1
    return new[:new.index(eos)] if eos in new else new        # the server ends a request at EOS


def post(url, path, body, raw=None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url.rsplit("/v1", 1)[0] + path, data=data,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(url, path):
    try:
        with urllib.request.urlopen(url.rsplit("/v1", 1)[0] + path, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, len(VOCAB) - 1, (n,), generator=g).tolist() for n in (3, 11, 6, 17, 1, 9)]


def complete_ids(client, ids, n, **kw):
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=n, temperature=kw.pop("temperature", 0),
                                  extra_body={"return_token_ids": True, **kw.pop("extra_body", {})}, **kw)
    return r.choices[0].token_ids, r


def test_models_health_and_greedy_equals_transformers(server, reference):
    c = server["client"]
    assert [m.id for m in c.models.list().data] == ["tiny"]
    assert get(server["url"], "/health") == (200, '{"status":"ok"}')
    ids = prompts()[1]
    got, r = complete_ids(c, ids, 20)
    assert got == hf_greedy(reference, ids, 20)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 20
    assert r.choices[0].finish_reason == "length"


def test_batch_invariant_greedy(server, reference):
    """Alone, sequentially, then 6 at once on 4 slots (two wait for a slot): the same tokens as transformers."""
    c = server["client"]
    ps = prompts()
    want = [hf_greedy(reference, p, 24) for p in ps]
    alone = [complete_ids(c, p, 24)[0] for p in ps]
    together = [None] * len(ps)

    def one(i):
        together[i] = complete_ids(c, ps[i], 24)[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(ps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert alone == want
    assert together == want


def test_streaming_equals_non_streaming(server):
    c = server["client"]
    ids = prompts()[3]
    _, full = complete_ids(c, ids, 12)
    chunks = list(c.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full.choices[0].text and len(text) > 0
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12


def test_seeded_sampling_reproducible_and_position_independent(server):
    c = server["client"]
    ids = prompts()[2]
    kw = dict(temperature=0.9, top_p=0.95, seed=1234, extra_body={"top_k": 20})
    a, _ = complete_ids(c, ids, 16, **dict(kw, extra_body=dict(kw["extra_body"])))
    b, _ = complete_ids(c, ids, 16, **dict(kw, extra_body=dict(kw["extra_body"])))
    assert a == b
    other = [None] * 3

    def one(i):   # the same request among others (it may land in any slot / batch row)
        if i == 1:
            other[i] = complete_ids(c, ids, 16, **dict(kw, extra_body=dict(kw["extra_body"])))[0]
        else:
            other[i] = complete_ids(c, prompts()[i + 3], 16)[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert other[1] == a
    c2, _ = complete_ids(c, ids, 16, **dict(kw, seed=99, extra_body=dict(kw["extra_body"])))
    assert c2 != a                      # a different seed samples differently (for this model and prompt)


def test_logprobs_match_unsharded_model(server, reference):
    c = server["client"]
    ids = prompts()[0]
    got, r = complete_ids(c, ids, 6, logprobs=3)
    with torch.no_grad():
        lp = torch.log_softmax(reference(torch.tensor([ids + got])).logits[0].double(), -1)
    for j, t in enumerate(got):
        row = lp[len(ids) - 1 + j]
        assert r.choices[0].logprobs.token_logprobs[j] == pytest.approx(float(row[t]), abs=1e-4)
        top = r.choices[0].logprobs.top_logprobs[j]
        want = row.topk(3)
        assert sorted(top.values(), reverse=True) == pytest.approx(want.values.tolist(), abs=1e-4)
        # the chosen token's value is the one its top_logprobs entry lists (review: SmolLM2 at tp=2 gave the two
        # from two reductions, 1e-6 apart)
        name = r.choices[0].logprobs.tokens[j]
        if name in top:
            assert top[name] == r.choices[0].logprobs.token_logprobs[j], (name, top)


def test_chat_template_and_stream(server, reference):
    c = server["client"]
    msgs = [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "de"}, {"role": "user", "content": "f"}]
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0,
                                  extra_body={"return_token_ids": True})
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(server["folder"])
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
    want = hf_greedy(reference, ids, 10)
    assert r.choices[0].token_ids == want[:len(r.choices[0].token_ids)]
    assert r.usage.prompt_tokens == len(ids)
    chunks = list(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == r.choices[0].message.content


def test_stop_string(server):
    c = server["client"]
    ids = prompts()[1]
    _, full = complete_ids(c, ids, 12)
    text = full.choices[0].text
    stop = text[4:7]                      # appears in the text: the output is cut before its first occurrence
    r = c.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[:text.find(stop)]
    chunks = list(c.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0, stop=stop, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == r.choices[0].text


@pytest.mark.parametrize("body,status,needle", [
    ({"prompt": "ab", "frequency_penalty": 0.5, "echo": True}, 400, "echo, frequency_penalty"),
    ({"max_tokens": 3}, 400, "missing required field 'prompt'"),
    ({"prompt": 5}, 400, "'prompt' must be a string"),
    ({"prompt": "ab", "max_tokens": "3"}, 400, "'max_tokens' must be an integer"),
    ({"prompt": "ab", "max_tokens": 0}, 400, "'max_tokens' must be >= 1"),
    ({"prompt": "ab", "max_tokens": MAX_LEN}, 400, "at most 62 tokens"),
    ({"prompt": "a" * MAX_LEN}, 400, "--max-model-len is 64"),
    ({"prompt": "ab", "n": 2}, 400, "'n' must be 1"),
    ({"prompt": "ab", "temperature": -1}, 400, "'temperature' must be >= 0"),
    ({"prompt": "ab", "model": "gpt-4"}, 404, "use \"tiny\""),
    ({"prompt": [1, 999]}, 400, "token id 999 is outside the vocabulary"),
    # a fresh-user review crashed the server with these two before they were checked
    ({"prompt": "ab", "seed": 2 ** 64}, 400, "'seed' must be <= 18446744073709551615"),
    ({"prompt": "ab", "top_p": float("nan")}, 400, "'top_p' must be a finite number"),
    ({"prompt": "ab", "temperature": float("inf")}, 400, "'temperature' must be a finite number"),
    ({"prompt": "ab", "stream_options": {"include_usage": True}}, 400, "only allowed with 'stream': true"),
    ({"prompt": "ab", "stream": True, "stream_options": {"include_usage": "x"}}, 400, "include_usage"),
    ({"prompt": "ab", "user": 5}, 400, "'user' must be a string"),
])
def test_bad_requests(server, body, status, needle):
    code, out = post(server["url"], "/v1/completions", body)
    assert code == status and needle in out["error"]["message"], out
    assert set(out["error"]) == {"message", "type", "param", "code"}


def test_bad_json_and_chat_fields_then_still_serving(server):
    code, out = post(server["url"], "/v1/completions", None, raw=b"{not json")
    assert code == 400 and "not valid JSON" in out["error"]["message"]
    code, out = post(server["url"], "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]})
    assert code == 400 and "messages[0]" in out["error"]["message"]
    code, out = post(server["url"], "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                             "tools": []})
    assert code == 400 and "tools" in out["error"]["message"]
    code, out = post(server["url"], "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                             "max_completion_tokens": 2, "max_tokens": 0})
    assert code == 400 and "'max_tokens' must be >= 1" in out["error"]["message"]
    for path, method in (("/v1/nothing", "GET"), ("/v1/completions", "GET")):       # unknown route, wrong method
        req = urllib.request.Request(server["url"].rsplit("/v1", 1)[0] + path, method=method)
        try:
            urllib.request.urlopen(req, timeout=30)
            raise AssertionError(f"{method} {path} answered 2xx")
        except urllib.error.HTTPError as e:
            err = json.loads(e.read())["error"]
            assert e.code in (404, 405) and err["code"] == e.code and path in err["message"], err
    code, out = post(server["url"], "/v1/completions", {"prompt": "ab", "max_tokens": 2, "temperature": 0,
                                                        "seed": -2 ** 63, "logprobs": 1})
    assert code == 200 and out["usage"]["completion_tokens"] == 2
    lp = out["choices"][0]["logprobs"]
    assert lp["text_offset"] == [0, len(lp["tokens"][0])]


def _metric(text, name):
    """The value of metric ``name`` (with its labels, e.g. ``x{a="b"}``) in Prometheus text, 0 when absent."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def _idle(url, timeout=60, also=lambda text: True):
    """Poll /metrics until no request runs or waits, no KV block is held and ``also(text)``; return the text."""
    deadline, text = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        _, text = get(url, "/metrics")
        if all(_metric(text, m) == 0 for m in ("tensorpar_num_requests_running", "tensorpar_num_requests_waiting",
                                               "tensorpar_kv_blocks_used")) and also(text):
            break
        time.sleep(0.1)
    return text


def test_disconnect_frees_slot_and_metrics(server):
    """A client that goes away mid-stream: its request ends (or had ended) and its blocks are freed. Whether the
    server ends it as "abort" depends on whether it noticed before the 60 tokens were done (it flaked under load
    when this test required it); the storm below checks aborts over many streams."""
    import http.client
    host, port = server["url"].split("//")[1].split("/")[0].split(":")
    _, before = get(server["url"], "/metrics")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": [1, 2, 3], "max_tokens": 60, "temperature": 0,
                                                        "stream": True}), {"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.readline().startswith(b"data: ")          # the first chunk arrived: the request holds blocks
    conn.close()                                           # client goes away mid-stream

    def ended(text):
        return sum(_metric(text, f'tensorpar_requests_total{{finish_reason="{r}"}}') -
                   _metric(before, f'tensorpar_requests_total{{finish_reason="{r}"}}') for r in ("abort", "length"))

    text = _idle(server["url"], also=lambda t: ended(t) >= 1)
    assert ended(text) == 1, [ln for ln in text.splitlines() if ln.startswith("tensorpar_") and "bucket" not in ln]
    assert _metric(text, "tensorpar_num_requests_running") == 0 and _metric(text, "tensorpar_kv_blocks_used") == 0
    for name in ("tensorpar_generation_tokens_total", "tensorpar_time_to_first_token_seconds_bucket",
                 "tensorpar_inter_token_latency_seconds_bucket", "tensorpar_num_requests_waiting",
                 "tensorpar_batch_size_bucket", "tensorpar_prompt_tokens_total", "tensorpar_kv_blocks_total",
                 "tensorpar_kv_cache_usage", "tensorpar_prefix_cache_hit_rate", "tensorpar_num_preemptions_total"):
        assert name in text


def test_prefix_cache_hits_equal_transformers(server, reference):
    """Five prompts sharing a 40-token prefix (two full 16-position blocks): the first computes it, the other
    four (at once) reuse its blocks; every output equals transformers' greedy tokens of the prompt alone, and
    /metrics counts the hits."""
    c = server["client"]
    g = torch.Generator().manual_seed(8)
    shared = torch.randint(0, len(VOCAB) - 1, (40,), generator=g).tolist()
    ps = [shared + torch.randint(0, len(VOCAB) - 1, (3,), generator=g).tolist() for _ in range(5)]
    want = [hf_greedy(reference, p, 8) for p in ps]
    _, before = get(server["url"], "/metrics")
    got = [complete_ids(c, ps[0], 8)[0]] + [None] * 4

    def one(i):
        got[i] = complete_ids(c, ps[i], 8)[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want
    text = _idle(server["url"])
    hits = _metric(text, "tensorpar_prefix_cache_hits_total") - _metric(before, "tensorpar_prefix_cache_hits_total")
    assert hits >= 4 * 32, hits                             # four requests x two cached blocks of 16
    assert 0 < _metric(text, "tensorpar_prefix_cache_hit_rate") <= 1


def _storm(url, n, seed):
    """``n`` completions (most streamed) closed by the client at random points: right after sending (during
    prefill or while waiting), after some chunks, or after all but the last token's chunk (during the final
    step); some non-streamed ones closed while waiting for the answer. 16 at a time."""
    import http.client
    import random
    from concurrent.futures import ThreadPoolExecutor
    host, port = url.split("//")[1].split("/")[0].split(":")
    rng = random.Random(seed)
    plans = []
    for i in range(n):
        mt = rng.randint(2, 40)
        plans.append(dict(prompt=[rng.randrange(len(VOCAB) - 1) for _ in range(rng.randint(1, 20))], mt=mt,
                          stream=rng.random() < 0.8, when=rng.choice(["send", "some", "last"]),
                          k=rng.randint(1, mt - 1)))

    def one(p):
        conn = http.client.HTTPConnection(host, int(port), timeout=120)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": p["prompt"], "max_tokens": p["mt"],
                                                            "temperature": 0, "stream": p["stream"]}),
                     {"content-type": "application/json"})
        if p["when"] != "send" and p["stream"]:
            resp = conn.getresponse()
            for _ in range(p["k"] if p["when"] == "some" else p["mt"] - 1):   # one event: "data: ..." + ""
                resp.readline()
                resp.readline()
        elif p["when"] != "send":
            time.sleep(0.05 * p["k"])
        conn.close()

    with ThreadPoolExecutor(16) as ex:
        list(ex.map(one, plans))


@pytest.mark.parametrize("streams,after", [(20, 8), pytest.param(100, 32, marks=pytest.mark.slow)])
def test_cancellation_storm_frees_every_block(server, reference, streams, after):
    """Issue 24's storm: streams closed at random points (also during prefill and the final step), then
    concurrent requests: each equals transformers' greedy output alone; no request runs or waits and no KV block
    is held afterwards (the pool back to its idle value), and the server counted aborted requests. CI: 20
    streams then 8 requests; slow: 100 then 32."""
    _, before = get(server["url"], "/metrics")
    _storm(server["url"], streams, seed=streams)
    c = server["client"]
    g = torch.Generator().manual_seed(4)
    ps = [torch.randint(0, len(VOCAB) - 1, (int(n),), generator=g).tolist()
          for n in torch.randint(1, 20, (after,), generator=g)]
    got = [None] * after

    def one(i):
        got[i] = complete_ids(c, ps[i], 10)[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(after)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [hf_greedy(reference, p, 10) for p in ps]
    text = _idle(server["url"])
    assert _metric(text, "tensorpar_num_requests_running") == 0
    assert _metric(text, "tensorpar_num_requests_waiting") == 0
    assert "tensorpar_kv_blocks_used " in text and _metric(text, "tensorpar_kv_blocks_total") > 0
    assert _metric(text, "tensorpar_kv_blocks_used") == 0              # idle: only cached prefixes, none held
    aborted = _metric(text, 'tensorpar_requests_total{finish_reason="abort"}') - \
        _metric(before, 'tensorpar_requests_total{finish_reason="abort"}')
    assert aborted >= 1, aborted


def test_zz_sigint_stops_every_rank_with_exit_0(server):
    rc, left = stop_server(server["proc"])
    assert rc == 0, server["proc"].stderr.read()[-3000:]
    assert left == ""


class _FakeEngine:
    """Records plans; the 'model' returns token = slot * 100 + position of the next token."""

    def __init__(self, max_batch=2, max_len=32):
        self.max_batch, self.max_len, self.plans = max_batch, max_len, []

    def exchange(self, plan):
        return plan

    def step(self, plan, samplers):
        from tensorpar.serve.engine import StepResult
        self.plans.append(plan)
        toks = [r.slot * 100 + r.start + len(r.tokens) for r in plan.rows]
        return StepResult(toks, [None] * len(toks), [None] * len(toks))


def test_scheduler_slots_waiting_and_queue_limit():
    """Iteration-level scheduling: a request joins at the next step, waits while no slot is free, leaves when
    done; beyond max_waiting, submit refuses."""
    from tensorpar.serve.scheduler import QueueFull, Request, Scheduler
    eng = _FakeEngine(max_batch=2)
    s = Scheduler(eng, eos=set(), max_waiting=3, heartbeat_s=0.01)
    events = {i: [] for i in range(4)}
    reqs = [Request(prompt=[7] * (i + 1), max_tokens=2 + i, emit=events[i].append) for i in range(3)]
    for r in reqs:
        s.submit(r)
    with pytest.raises(QueueFull):
        s.submit(Request(prompt=[1], max_tokens=1, emit=events[3].append))
    steps = 0
    while any(not e or e[-1][0] != "done" for e in list(events.values())[:3]):
        s._drain(block=False)
        plan, order = s._plan()
        res = eng.step(plan, None)
        for i, req in enumerate(order):
            s._deliver(req, res.tokens[i], None, None, 0.0)
        steps += 1
    first = eng.plans[0].rows
    assert [(r.slot, r.start, len(r.tokens)) for r in first] == [(0, 0, 1), (1, 0, 2)]   # two prefills, one waits
    # request 0 (2 tokens) ends after step 2; request 2 takes its slot at step 3 (prefill next to a decode)
    third = eng.plans[2].rows
    assert sorted((r.slot, r.start) for r in third) == [(0, 0), (1, 3)]
    assert [e[1] for e in events[0] if e[0] == "token"] == [1, 2]          # slot 0: positions 1, 2
    assert [e[1] for e in events[2] if e[0] == "token"] == [3, 4, 5, 6]     # slot 0 again, its own positions
    assert all(e[-1] == ("done", "length") for e in list(events.values())[:3])
    assert s.running == [] and s._pending == 0


def test_chat_prompt_ids_are_apply_chat_templates(tmp_path):
    """The chat endpoint's prompt ids are apply_chat_template(tokenize=True)'s, for a tokenizer that adds BOS and
    a template that writes it (one BOS, not two) and for this module's template (no BOS at all)."""
    from transformers import AutoTokenizer

    from tensorpar.serve.api import Api
    from tests.decode.test_generate import bos_chat_folder
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat"}]
    for folder in (bos_chat_folder(tmp_path / "bos"), make_folder(tmp_path / "plain")):
        tok = AutoTokenizer.from_pretrained(folder)
        want = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
        req, _ = Api(None, tok, "tiny", 64, None).parse({"messages": msgs, "temperature": 0}, chat=True)
        assert req.prompt == want
        if tok.bos_token_id is not None:
            assert req.prompt.count(tok.bos_token_id) == 1


@pytest.mark.parametrize("args,msg", [(["--tp", "0"], "--tp must be a positive integer"),
                                      (["--host", "foo"], "--host must be an IP address"),
                                      (["--port", "70000"], "--port must be in [0, 65535]"),
                                      (["--max-batch", "0"], "--max-batch must be >= 1"),
                                      (["--max-model-len", "1000"], "--max-model-len must be in [2, 128]"),
                                      # tp=2: rank 0 holds 2 of the 3 KV heads (a GQA group straddles the ranks)
                                      (["--kv-cache-memory", "10000"], "--kv-cache-memory 10000 holds 4 KV block.s. "
                                       "of 16 positions .2048 bytes each on a rank at tp=2.; one request of "
                                       "--max-model-len 128 needs 8: give at least 16384 bytes, or lower"),
                                      (["--kv-cache-memory", "lots"], "--kv-cache-memory must be bytes"),
                                      (["--kv-cache-memory", "0"], "--kv-cache-memory must be positive"),
                                      (["--request-timeout", "0"], "--request-timeout must be a positive number"),
                                      (["--request-timeout", "-5"], "--request-timeout must be a positive number"),
                                      (["--block-size", "0"], "--block-size must be in [1, --max-model-len 128]"),
                                      (["--served-model-name", " "], "--served-model-name must not be empty"),
                                      (["--host", "192.0.2.1", "--port", "8001"], "cannot listen there")])
def test_bad_options_refused_before_launch(tmp_path_factory, args, msg):
    import argparse

    from tensorpar.serve import cli
    folder = make_folder(tmp_path_factory.mktemp("opts") / "tiny")
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        cli.validate(p.parse_args(["--model", folder, *args]))


def test_more_ranks_than_gpus_refused_before_the_kv_pool(tmp_path_factory, monkeypatch):
    """On a CUDA host with fewer GPUs than ranks (a pretend CUDA of one GPU), ``serve --tp 2`` and ``serve --plan auto
    --nproc 2`` are refused by the launcher's GPU-count rule before the KV pool's size (of each candidate layout)
    asks the GPU for its free memory (a CUDA context in the launching process)."""
    import argparse

    import torch

    from tensorpar.serve import cli
    folder = make_folder(tmp_path_factory.mktemp("gpus") / "tiny")
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: pytest.fail("the KV pool asked the GPU first"))
    for args in (["--tp", "2"], ["--plan", "auto", "--nproc", "2"]):     # --plan auto: before each candidate's pool
        with pytest.raises(ValueError, match=r"^2 ranks on this host but CUDA sees 1 GPU: NCCL needs one GPU per rank"):
            cli.validate(p.parse_args(["--model", folder, *args]))


def test_bad_option_exit_code_2(tmp_path_factory):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    r = subprocess.run([sys.executable, "-m", "tensorpar", "serve", "--model", "/nonexistent/model"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("tensorpar serve: error:"), r.stderr[-2000:]


def test_port_in_use_refused_before_launch(tmp_path_factory):
    import argparse
    import socket

    from tensorpar.serve import cli
    folder = make_folder(tmp_path_factory.mktemp("port") / "tiny")
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ValueError, match=f"--port {port}: cannot listen there .*another process listens there"):
            cli.validate(p.parse_args(["--model", folder, "--port", str(port)]))
    from tensorpar.serve.params import url_host
    assert url_host("::1") == "[::1]" and url_host("127.0.0.1") == "127.0.0.1"


def test_module_path_refuses_prefix_caching_and_block_size(tmp_path):
    """Families without the lean decode path keep one KV slot of --max-model-len per request (not paged):
    --prefix-caching on and a --block-size are refused with one line naming why; left out, they serve."""
    import argparse

    from tensorpar.serve import cli
    from tests.decode.test_generate import make_model_folder
    folder = str(make_model_folder(tmp_path / "gpt2", "gpt2"))
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    with pytest.raises(ValueError, match=r"--prefix-caching on needs the paged KV cache of the lean decode path; "
                                         r"this model has none \(model_type='gpt2' has no fast decode path"):
        cli.validate(p.parse_args(["--model", folder, "--prefix-caching", "on"]))
    with pytest.raises(ValueError, match="--block-size 16: this model's KV cache keeps one slot"):
        cli.validate(p.parse_args(["--model", folder, "--block-size", "16"]))


def test_kv_pool_sizes():
    """--kv-cache-memory: bytes with units or a fraction; by default max_batch requests of max_model_len."""
    from transformers import LlamaConfig

    from tensorpar.serve.pool import kv_pool, parse_memory
    assert parse_memory("96MiB") == ("bytes", 96 * 2**20) and parse_memory("2GB") == ("bytes", 2e9)
    assert parse_memory("0.5") == ("fraction", 0.5) and parse_memory("1000") == ("bytes", 1000)
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=3)
    # tp=2: one KV head per rank; a block: 2 (k, v) x 3 layers x 1 head x 16 positions x 8 dims x 4 bytes
    assert kv_pool(cfg, 2, "float32", 1024, 16, block_size=16, memory=None) == (16 * 64, 3072)
    # the memory of 16 requests of 1024 positions holds 64 requests of 256
    assert kv_pool(cfg, 2, "float32", 256, 64, block_size=16, memory=str(16 * 64 * 3072))[0] == 64 * 16
    # review: TiB and negative exponents parse; a pool larger than the memory here is refused before any rank
    # starts, naming the setting (it failed inside the rank with "DefaultCPUAllocator: can't allocate memory")
    assert parse_memory("1TiB") == ("bytes", 2**40) and parse_memory("5e-1") == ("fraction", 0.5)
    with pytest.raises(ValueError, match=r"--kv-cache-memory 999TiB is more than the .* available per rank here"):
        kv_pool(cfg, 2, "float32", 256, 64, block_size=16, memory="999TiB")
    with pytest.raises(ValueError, match=r"optional unit: KB, MB, GB, TB, KiB, MiB, GiB, TiB"):
        parse_memory("64XB")
    # a plain 1.5 was 1.5 bytes, refused later as "holds 0 KV blocks": now named at once, with what would work
    with pytest.raises(ValueError, match=r"^--kv-cache-memory 1.5: a plain number .* \(e.g. 0.5\) or bytes with a "
                                         r"unit \(e.g. 1.5GiB\)$"):
        parse_memory("1.5")
    # review (2026-12-02 08:00): a plain 1 was the fraction 1.0, every rank's whole share of the memory for its pool
    # before its weights, and `serve --pp 2 --kv-cache-memory 1` launched and lost a rank to the OOM killer; now 1 is
    # one byte (refused: no block), and a fraction's pool is what the rank's weights leave of its share
    assert parse_memory("1") == ("bytes", 1)
    with pytest.raises(ValueError, match=r"--kv-cache-memory 1 holds 0 KV block"):
        kv_pool(cfg, 2, "float32", 256, 64, block_size=16, memory="1")
    from tensorpar.serve import pool
    big = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                      num_hidden_layers=80, vocab_size=128256)   # Llama-3-70B's shape: ~70.6e9 parameters
    assert 2.7e11 < pool.weight_bytes_per_rank(big, "float32", 1) < 2.9e11      # fp32 at tp=1: ~282 GB
    with pytest.raises(ValueError, match=r"--kv-cache-memory 0.5: that share .* leaves 0 bytes for the KV pool "
                                         r"beside the rank's weights"):
        kv_pool(big, 1, "float32", 256, 4, block_size=16, memory="0.5")   # on any host with < 564 GB
    # review (2026-12-02): the default pool of --max-batch x --max-model-len is checked too (--max-batch 100000
    # failed inside the ranks with "DefaultCPUAllocator: can't allocate memory")
    with pytest.raises(ValueError, match=r"--max-batch 100000000 x --max-model-len 1024 needs a KV pool of .* per rank "
                                         r"at tp=2, more than the .* available per rank here beside its weights .*; lower --max-batch"):
        kv_pool(cfg, 2, "float32", 1024, 100_000_000, block_size=16, memory=None)


def test_kv_pool_at_pp_holds_the_largest_stage_and_shares_the_host(monkeypatch):
    """Issue 23: at --pp P a rank's KV pool holds only its stage's layers (the ranks' LeanKVCache is allocated for
    len(stage.layers)), and on a CPU the host's memory is shared by every rank started on it. The old rule sized a
    block for every layer and divided the memory among tp x ep ranks only. Exact integer arithmetic, by hand."""
    from transformers import LlamaConfig

    from tensorpar.serve import pool
    for k in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(pool, "weight_bytes_per_rank", lambda *a, **k: 0)   # the pool's own share only
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=5)
    # training's cut of 5 layers in 2 stages: 2 and 3 (the larger last); tp=2: 1 KV head of 8 dims per rank; a
    # block: 2 (k, v) x 3 layers x 1 head x 16 positions x 8 dims x 4 bytes = 3072 (5 layers: 5120)
    assert pool.kv_pool(cfg, 2, "float32", 1024, 16, block_size=16, memory=None, pp=2) == (16 * 64, 3072)
    assert pool.kv_pool(cfg, 2, "float32", 1024, 16, block_size=16, memory=None, pp=5) == (16 * 64, 1024)
    assert pool.kv_pool(cfg, 2, "float32", 1024, 16, block_size=16, memory=None) == (16 * 64, 5120)
    if torch.cuda.is_available():
        return       # a GPU rank's memory is its device's, not shared
    monkeypatch.setattr(pool, "_mem_available", lambda: 3072 * 4000)
    # one host, tp=2 x pp=2: 4 ranks share 3072 x 4000 bytes; half of a rank's 3072 x 1000 holds 500 blocks
    assert pool.kv_pool(cfg, 2, "float32", 64, 1, block_size=16, memory="0.5", pp=2)[0] == 500
    assert pool.kv_pool(cfg, 2, "float32", 64, 1, block_size=16, memory="0.5", pp=2, ep=2)[0] == 250
    # torchrun with 2 ranks per node (--nproc-per-node 2): the stages on two hosts, 2 ranks share this one
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert pool.kv_pool(cfg, 2, "float32", 64, 1, block_size=16, memory="0.5", pp=2)[0] == 1000
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"--max-batch 1001 x --max-model-len 16 needs a KV pool of 3075072 bytes "
                                         r"\(2.9 MiB\) per rank at tp=2, pp=2, more than the 3072000 bytes"):
        pool.kv_pool(cfg, 2, "float32", 16, 1001, block_size=16, memory=None, pp=2)


def test_serve_takes_a_plan_file(tmp_path_factory):
    """Review: serve refused a model without a table pointing at --plan-file / --discover-plan, flags it did not
    take. It takes both now (the one path generate takes): a plan file reaches the job and makes its plan."""
    import argparse

    from transformers import AutoConfig

    from tensorpar.hf.discover import discover_plan, save_plan
    from tensorpar.serve import cli
    folder = make_folder(tmp_path_factory.mktemp("planfile") / "tiny")
    path = str(tmp_path_factory.mktemp("plans") / "plan.json")
    save_plan(discover_plan(AutoConfig.from_pretrained(folder)), path)
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    job = cli.validate(p.parse_args(["--model", folder, "--tp", "2", "--port", "0", "--plan-file", path]))
    assert job.user_plan == path and all(f"plan file '{path}'" in e.notes for e in job.plan.entries)
    with pytest.raises(ValueError, match="--save-plan p.json: needs --discover-plan"):
        cli.validate(p.parse_args(["--model", folder, "--port", "0", "--save-plan", "p.json"]))
