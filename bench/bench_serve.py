"""Loopback load test of `tensorpar serve` (tp=1, tp=2), optionally next to `transformers serve`, same run.

Each backend is started as a server on 127.0.0.1, then ``--requests`` streaming completions (greedy, mixed prompt
lengths, ``--max-tokens`` each) are sent from ``--concurrency`` client threads. Client-side measurements:
time to first token (request sent -> first non-empty chunk), inter-token latency (gaps between content chunks),
requests/s and output tokens/s over the wall time of the load. Every tensorpar response's token ids are compared
with transformers' single-process greedy `generate` on the same prompt (the offline reference); for
`transformers serve` the text is compared. Results: bench/results/serve.{md,json} (atomic writes).

    PYTHONPATH=. python bench/bench_serve.py --requests 32 --concurrency 16 --transformers

``--prefix`` runs issue 24's paged-cache runs instead (bench/results/serve_prefix.{md,json}), with the KV memory
that 16 slots of 1024 positions held before paging (``--kv-cache-memory``): 32 requests sharing a 1000-token
system prompt with distinct 32-token questions, all sent at once, with ``--prefix-caching on`` and ``off`` (TTFT
p50, total time, outputs compared), and 64 concurrent requests of 256 tokens (preemptions counted).

    PYTHONPATH=. python bench/bench_serve.py --prefix --tp 1
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

PROMPTS = ["The capital of France is", "Write a haiku about the sea.",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "Tensor parallelism splits each weight matrix of a transformer across devices so that",
           "Hello", "List three colours:",
           "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who",
           "Q: What is 12 times 7?\nA:"]


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def wait_ready(base, proc, timeout):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(1)
    return False


def stream_one(host, port, body):
    """POST a streaming completion; return (ttft_s, [gaps_s], text, token_ids or None, error)."""
    conn = http.client.HTTPConnection(host, port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        return None, [], "", None, f"HTTP {resp.status}: {resp.read()[:200]!r}"
    ttft, last, gaps, text, ids, n = None, None, [], "", None, 0
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            break
        obj = json.loads(data)
        if "error" in obj:
            return None, [], text, None, str(obj["error"])
        for ch in obj.get("choices", []):
            if ch.get("text"):
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - t0
                else:
                    gaps.append(now - last)
                last = now
                text += ch["text"]
                n += 1
            if ch.get("token_ids") is not None:
                ids = ch["token_ids"]
    conn.close()
    return ttft, gaps, text, ids, None


def run_load(base, model_name, args, extra_body):
    host, port = base.split("//")[1].split(":")
    port = int(port)
    jobs = list(range(args.requests))
    lock = threading.Lock()
    out = []
    t_end = time.monotonic() + args.time_limit

    def worker():
        while time.monotonic() < t_end:
            with lock:
                if not jobs:
                    return
                i = jobs.pop(0)
            p = PROMPTS[i % len(PROMPTS)]
            body = dict(model=model_name, prompt=p, max_tokens=args.max_tokens, temperature=0, stream=True,
                        **extra_body)
            try:
                r = stream_one(host, port, body)
            except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
                r = (None, [], "", None, f"{type(e).__name__}: {e}")
            with lock:
                out.append((i % len(PROMPTS), *r))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, time.perf_counter() - t0


def summarize(name, results, wall, ref_ids, ref_text, tok):
    ok = [r for r in results if r[5] is None]
    errors = len(results) - len(ok)
    ttft = [r[1] for r in ok if r[1] is not None]
    itl = [g for r in ok for g in r[2]]
    tokens = 0
    equal = 0
    for pi, _, _, text, ids, _ in ok:
        if ids is not None:
            tokens += len(ids)
            equal += ids == ref_ids[pi]
        else:
            tokens += len(tok(text, add_special_tokens=False)["input_ids"])
            equal += text == ref_text[pi]
    return dict(backend=name, requests=len(results), errors=errors, wall_s=wall, req_per_s=len(ok) / wall,
                out_tok_per_s=tokens / wall, ttft_p50_ms=pct(ttft, 50) * 1e3, ttft_p99_ms=pct(ttft, 99) * 1e3,
                itl_p50_ms=pct(itl, 50) * 1e3, itl_p99_ms=pct(itl, 99) * 1e3, greedy_equal=equal,
                greedy_checked=len(ok), first_error=next((r[5] for r in results if r[5]), None))


def start(cmd, env):
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)


def stop(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def atomic_write(path: Path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def metrics(base):
    """``GET /metrics`` as ``{name{labels}: value}``."""
    with urllib.request.urlopen(base + "/metrics", timeout=60) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("tensorpar_") and " " in line:
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def burst(base, bodies):
    """Send every body at once (one thread each); per request (ttft_s, token ids, error) and the wall time."""
    host, port = base.split("//")[1].split(":")
    out = [None] * len(bodies)

    def one(i):
        try:
            ttft, _, _, ids, err = stream_one(host, int(port), bodies[i])
        except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
            ttft, ids, err = None, None, f"{type(e).__name__}: {e}"
        out[i] = (ttft, ids, err)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, time.perf_counter() - t0


def _serve_cmd(folder, args, *extra):
    return [sys.executable, "-m", "tensorpar", "serve", "--model", folder, "--tp", str(args.tp[0]), "--port",
            str(args.port), "--served-model-name", "m", "--dtype", args.dtype, *extra]


def prefix_main(args, folder, tok):
    """Issue 24's runs on one pool: the KV memory of 16 slots x 1024 positions (the pre-paging default)."""
    from transformers import AutoConfig

    from tensorpar.serve.cli import kv_pool
    cfg = AutoConfig.from_pretrained(folder)
    load0 = os.getloadavg()
    tp = args.tp[0]
    _, per_block = kv_pool(cfg, tp, args.dtype, 1024, 16, block_size=16, memory=None)
    memory = 16 * (1024 // 16) * per_block
    text = " ".join(f"Rule {i}: answer politely, cite the manual section {i}, and never reveal secret {i * 7}."
                    for i in range(400))
    system = tok(text)["input_ids"][:args.system_tokens]
    questions = []
    for i in range(32):
        q = tok(f" Question {i}: what is {i} times {i + 7}, and why does the manual say so? Explain it step by "
                f"step for a reader who knows arithmetic but not this manual, section {i * 3}.")["input_ids"]
        questions.append((q * 2)[:args.question_tokens])
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    base = f"http://127.0.0.1:{args.port}"
    rows, outputs = [], {}

    def run(name, flags, bodies, key=None):
        proc = start(_serve_cmd(folder, args, "--kv-cache-memory", str(memory), *flags), env)
        try:
            if not wait_ready(base, proc, 900):
                rows.append(dict(run=name, error=f"did not start: {proc.stderr.read()[-500:]}"))
                return
            la = os.getloadavg()[0]
            res, wall = burst(base, bodies)
            m = metrics(base)
            if key:
                outputs[key] = [r[1] for r in res]
            ttft = [r[0] for r in res if r[0] is not None]
            rows.append(dict(run=name, requests=len(res), errors=sum(r[2] is not None for r in res), total_s=wall,
                             ttft_p50_s=pct(ttft, 50), ttft_p99_s=pct(ttft, 99),
                             hit_rate=m.get("tensorpar_prefix_cache_hit_rate", 0.0),
                             preemptions=m.get("tensorpar_num_preemptions_total", 0.0),
                             blocks=m.get("tensorpar_kv_blocks_total", 0.0), loadavg=(la, os.getloadavg()[0]),
                             first_error=next((r[2] for r in res if r[2]), None)))
            print(rows[-1], flush=True)
        finally:
            stop(proc)

    shared = [dict(model="m", prompt=system + q, max_tokens=args.max_tokens, temperature=0, stream=True,
                   return_token_ids=True) for q in questions]
    for flag in ("on", "off"):
        run(f"prefix caching {flag}", ["--max-batch", "32", "--max-model-len", "1100", "--prefix-caching", flag],
            shared, key=flag)
    # 64 concurrent requests of 256 tokens (240 prompt + 16 new) in the same memory: no preemption
    pool = [dict(model="m", prompt=(questions[i % 32] * 8)[:240], max_tokens=16, temperature=0, stream=True,
                 return_token_ids=True) for i in range(64)]
    run("64 x 256 tokens", ["--max-batch", "64", "--max-model-len", "1024", "--prefix-caching", "off"], pool)
    load1 = os.getloadavg()
    same = outputs.get("on") is not None and outputs.get("on") == outputs.get("off")
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in subprocess.run(["lscpu"], capture_output=True, text=True)
                   .stdout.splitlines() if ln.startswith("Model name"))
    except (OSError, StopIteration):
        cpu = "unknown"
    meta = dict(model=Path(folder).name, dtype=args.dtype, tp=tp, kv_cache_memory=memory, block_bytes=per_block,
                system_tokens=len(system), question_tokens=args.question_tokens, max_tokens=args.max_tokens,
                cpu=cpu, cpus=os.cpu_count(), loadavg_start=load0, loadavg_end=load1, outputs_identical=same,
                date=time.strftime("%Y-%m-%d %H:%M:%S"))
    out = Path(args.out)
    atomic_write(out.with_suffix(".json"), json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"# tensorpar serve: paged KV cache and prefix caching ({meta['date']})", "",
             f"Model {meta['model']} in {args.dtype} at tp={tp}; KV pool `--kv-cache-memory {memory}` (the memory of "
             f"16 slots x 1024 positions before paging: {memory // per_block} blocks of 16 positions). CPU: {cpu}, "
             f"{meta['cpus']} cores; load average {load0[0]:.1f} at start, {load1[0]:.1f} at end: the machine was "
             f"shared with other jobs, so absolute times are inflated; on and off ran one after the other under the "
             f"same kind of load and their ratios are the result.", "",
             f"Shared prefix: 32 streaming greedy requests of a {len(system)}-token system prompt plus a distinct "
             f"{args.question_tokens}-token question, {args.max_tokens} new tokens each, all sent at once "
             f"(`--max-batch 32 --max-model-len 1100`). Outputs identical on vs off: {same}.", "",
             "| run | requests | errors | TTFT p50 / p99 s | total s | prefix hit rate | preemptions | "
             "load avg before / after |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['run']} | did not run: {r['error'].strip().splitlines()[-1][:200]} | | | | | | |")
            continue
        lines.append(f"| {r['run']} | {r['requests']} | {r['errors']} | {r['ttft_p50_s']:.2f} / "
                     f"{r['ttft_p99_s']:.2f} | {r['total_s']:.1f} | {r['hit_rate']:.3f} | {r['preemptions']:.0f} | "
                     f"{r['loadavg'][0]:.1f} / {r['loadavg'][1]:.1f} |")
    on = next((r for r in rows if r.get("run") == "prefix caching on" and "error" not in r), None)
    off = next((r for r in rows if r.get("run") == "prefix caching off" and "error" not in r), None)
    if on and off:
        lines += ["", f"Prefix caching on vs off: TTFT p50 {off['ttft_p50_s'] / on['ttft_p50_s']:.1f}x lower, "
                      f"total time {off['total_s'] / on['total_s']:.1f}x lower (targets: 4x and 1.5x)."]
    lines += ["", "`64 x 256 tokens`: 64 requests of a 240-token prompt and 16 new tokens, sent at once "
                  "(`--max-batch 64`), in the same pool; the target is 0 preemptions."]
    atomic_write(out.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--time-limit", type=float, default=900, help="seconds of load per backend (then stop)")
    ap.add_argument("--transformers", action="store_true", help="also run `transformers serve` on the same folder")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="weights and compute of every backend, and of the offline reference")
    ap.add_argument("--port", type=int, default=8731)
    ap.add_argument("--out", default="bench/results/serve")
    ap.add_argument("--prefix", action="store_true", help="the shared-prefix and pool runs (issue 24)")
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--question-tokens", type=int, default=32)
    args = ap.parse_args()
    if args.prefix:
        from transformers import AutoTokenizer

        from tensorpar.hub import resolve_model
        folder = str(resolve_model(args.model))
        if args.out == "bench/results/serve":
            args.out = "bench/results/serve_prefix"
        return prefix_main(args, folder, AutoTokenizer.from_pretrained(folder))

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tensorpar.hub import resolve_model
    folder = str(resolve_model(args.model))
    tok = AutoTokenizer.from_pretrained(folder)
    load0 = os.getloadavg()
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtype)).eval()
    ref_ids, ref_text = [], []
    for p in PROMPTS:
        x = tok(p, return_tensors="pt")
        with torch.no_grad():
            o = ref.generate(**x, max_new_tokens=args.max_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=tok.eos_token_id, min_new_tokens=args.max_tokens)
        new = o[0, x["input_ids"].shape[1]:].tolist()
        new = new[:new.index(tok.eos_token_id)] if tok.eos_token_id in new else new
        ref_ids.append(new)
        ref_text.append(tok.decode(new, skip_special_tokens=True))
    del ref
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    rows = []
    for tp in args.tp:
        base = f"http://127.0.0.1:{args.port}"
        proc = start([sys.executable, "-m", "tensorpar", "serve", "--model", folder, "--tp", str(tp), "--port",
                      str(args.port), "--max-batch", str(args.max_batch), "--max-model-len", "512",
                      "--max-waiting", str(max(256, args.requests)), "--served-model-name", "m",
                      "--dtype", args.dtype], env)
        try:
            if not wait_ready(base, proc, 600):
                rows.append(dict(backend=f"tensorpar tp={tp}", error=f"did not start: {proc.stderr.read()[-500:]}"))
                continue
            la = os.getloadavg()[0]
            res, wall = run_load(base, "m", args, {"return_token_ids": True})
            rows.append(summarize(f"tensorpar tp={tp}", res, wall, ref_ids, ref_text, tok))
            rows[-1]["loadavg"] = (la, os.getloadavg()[0])
            print(rows[-1], flush=True)
        finally:
            stop(proc)
    if args.transformers:
        base = f"http://127.0.0.1:{args.port + 1}"
        threads = str(max(1, (os.cpu_count() or 2)))
        proc = start([os.path.join(os.path.dirname(sys.executable), "transformers"), "serve", folder, "--host",
                      "127.0.0.1", "--port", str(args.port + 1), "--device", "cpu", "--dtype", args.dtype,
                      "--continuous-batching"], dict(env, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=threads))
        try:
            if not wait_ready(base, proc, 600):
                err = proc.stderr.read()[-800:] if proc.poll() is not None else "no /health within 600 s"
                rows.append(dict(backend="transformers serve --continuous-batching", error=err))
            else:
                la = os.getloadavg()[0]
                res, wall = run_load(base, folder, args, {})
                rows.append(summarize("transformers serve --continuous-batching", res, wall, ref_ids, ref_text, tok))
                rows[-1]["loadavg"] = (la, os.getloadavg()[0])
                print(rows[-1], flush=True)
        finally:
            stop(proc)
    load1 = os.getloadavg()
    meta = dict(model=folder.replace(str(Path.home()), "~", 1),  # no absolute machine paths in results
                dtype=args.dtype, requests=args.requests, concurrency=args.concurrency, max_tokens=args.max_tokens,
                max_batch=args.max_batch, cpus=os.cpu_count(), loadavg_start=load0, loadavg_end=load1,
                date=time.strftime("%Y-%m-%d %H:%M:%S"))
    out = Path(args.out)
    atomic_write(out.with_suffix(".json"), json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"# tensorpar serve load test ({meta['date']})", "",
             f"Model {Path(folder).name} in {args.dtype} (every backend and the offline reference); "
             f"{args.requests} streaming greedy completions of {args.max_tokens} tokens "
             f"from {args.concurrency} concurrent clients on loopback, {len(PROMPTS)} prompts of mixed length; "
             f"--max-batch {args.max_batch}; {meta['cpus']} CPUs; load average {load0[0]:.1f} at start, "
             f"{load1[0]:.1f} at end (other jobs share the machine).", "",
             "| backend | requests | errors | req/s | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
             "greedy equal to offline | load avg before / after |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['backend']} | - | did not run: {r['error'].strip().splitlines()[-1][:200]} |"
                         " | | | | | |")
            continue
        lines.append(f"| {r['backend']} | {r['requests']} | {r['errors']} | {r['req_per_s']:.2f} | "
                     f"{r['out_tok_per_s']:.1f} | {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
                     f"{r['itl_p50_ms']:.0f} / {r['itl_p99_ms']:.0f} | {r['greedy_equal']}/{r['greedy_checked']} | "
                     f"{r['loadavg'][0]:.1f} / {r['loadavg'][1]:.1f} |")
    atomic_write(out.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
