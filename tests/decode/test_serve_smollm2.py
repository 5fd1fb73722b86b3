"""`tensorpar serve --model smollm2 --tp 2`: greedy tokens equal transformers' `generate`, alone and batched."""
import threading

import pytest
import torch

from tests.decode.test_serve import start_server, stop_server

openai = pytest.importorskip("openai")

PROMPTS = ["The capital of France is", "Write a haiku about the sea.",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "Tensor parallelism splits each weight matrix of a transformer across devices so that",
           "Hello", "List three colours:"]
N = 32


@pytest.mark.slow
@pytest.mark.network
def test_smollm2_tp2_greedy_equals_transformers_alone_and_batched():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tensorpar.hub import resolve_model
    folder = str(resolve_model("smollm2"))
    tok = AutoTokenizer.from_pretrained(folder)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    eos = tok.eos_token_id
    want = []
    for p in PROMPTS:
        x = tok(p, return_tensors="pt")
        with torch.no_grad():
            out = ref.generate(**x, max_new_tokens=N, do_sample=False, eos_token_id=None, pad_token_id=eos,
                               min_new_tokens=N)
        new = out[0, x["input_ids"].shape[1]:].tolist()
        want.append(new[:new.index(eos)] if eos in new else new)
    del ref
    proc, url = start_server(folder, "--max-batch", "16", "--max-model-len", "256", "--served-model-name", "smollm2")
    try:
        c = openai.OpenAI(base_url=url, api_key="none", max_retries=0)

        def run(p):
            r = c.completions.create(model="smollm2", prompt=p, max_tokens=N, temperature=0,
                                     extra_body={"return_token_ids": True})
            return r.choices[0].token_ids

        alone = [run(p) for p in PROMPTS]
        together = [None] * len(PROMPTS)

        def one(i):
            together[i] = run(PROMPTS[i])

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        chat = c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Say hi."}],
                                         max_tokens=8, temperature=0)
    finally:
        rc, left = stop_server(proc)
    assert alone == want
    assert together == want
    assert chat.choices[0].message.content.strip()
    assert rc == 0 and left == ""
