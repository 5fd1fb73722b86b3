"""Loopback load test of `tensorpar serve` (tp=1, tp=2), optionally next to `transformers serve`, same run.

Each backend is started as a server on 127.0.0.1, then ``--requests`` streaming completions (greedy, mixed prompt
lengths, ``--max-tokens`` each) are sent from ``--concurrency`` client threads. Client-side measurements:
time to first token (request sent -> first non-empty chunk), inter-token latency (gaps between content chunks),
requests/s and output tokens/s over the wall time of the load. Every tensorpar response's token ids are compared
with transformers' single-process greedy `generate` on the same prompt (the offline reference); for
`transformers serve` the text is compared. Results: bench/results/serve.{md,json} (atomic writes).

    PYTHONPATH=. python bench/bench_serve.py --requests 32 --concurrency 16 --transformers

Each tensorpar rank's main thread (the model's steps; rank 0's also runs the scheduler) is read from
``/proc/PID/task/PID/schedstat`` before and after the load: the share of the load's wall time it ran, waited for a
core, and slept (blocked: on the other ranks, for requests). At ``--pp`` the sleep share of a stage is its bubble.
``--before DIR`` runs every tensorpar backend also on the code in DIR (an older checkout, e.g. ``git archive`` of
the commit before a change), the two interleaved ``--repeats`` times (before, after, before, after ...):

    PYTHONPATH=. python bench/bench_serve.py --tp 1 --pp 2 --before DIR --repeats 2 --requests 64 \
        --concurrency 32 --max-tokens 32 --out bench/results/serve_pp

``--prefix`` runs issue 24's paged-cache runs instead (bench/results/serve_prefix.{md,json}), with the KV memory
that 16 slots of 1024 positions held before paging (``--kv-cache-memory``): 32 requests sharing a 1000-token
system prompt with distinct 32-token questions, all sent at once, with ``--prefix-caching on`` and ``off`` (TTFT
p50, total time, outputs compared), and 64 concurrent requests of 256 tokens (preemptions counted).

    PYTHONPATH=. python bench/bench_serve.py --prefix --tp 1

``--latency`` measures latency under load (issue 24; bench/results/serve_latency.{md,json,png}): every backend
(``--tp`` list, ``--pp`` list at tp=1, ``--transformers``) is started and kept up; each one's saturating rate is
measured closed-loop (``--requests`` from ``--concurrency`` clients), then ``--requests`` requests per rate are sent
open-loop at seeded Poisson arrival times, at ``--rate-factors`` (default 0.5 1 2) x that rate or at the fixed
``--rates``, the backends interleaved per rate: TTFT and TPOT p50/p90/p99, throughput, peak KV block usage from
/metrics, outputs against the offline reference, and a plot of TTFT and TPOT against the request rate.

    PYTHONPATH=. python bench/bench_serve.py --latency --tp 1 2 --pp 2 --transformers --requests 32
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from machine import atomic_write, cpu_model   # bench/machine.py (sys.path[0] is bench/ when run as a script)

PROMPTS = ["The capital of France is", "Write a haiku about the sea.",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "Tensor parallelism splits each weight matrix of a transformer across devices so that",
           "Hello", "List three colours:",
           "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who",
           "Q: What is 12 times 7?\nA:"]


def pct(xs, q: int) -> float:
    """The ``q``-th percentile (integer, 1..99) of ``xs``, linear between order statistics (``statistics.quantiles``
    with ``method="inclusive"``, numpy's default); one value is its own percentile; nan for none. The one
    percentile of this script."""
    xs = list(xs)
    if not xs:
        return float("nan")
    if len(xs) == 1:
        return float(xs[0])
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1]


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send times (seconds after the start) of ``n`` requests arriving as a Poisson process of ``rate`` per second:
    cumulative sums of exponential gaps drawn from ``random.Random(seed)``. One seed gives one pattern at every rate
    (the gaps of rate ``r`` are those of rate 1 divided by ``r``), so the backends see the same arrivals."""
    if rate <= 0 or n < 0:
        raise ValueError(f"request rate must be > 0 and requests >= 0, got rate {rate}, {n} requests")
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def tpot(span_s: float, tokens: int) -> float | None:
    """Time per output token of one streamed request: (last token's time - first token's time) / (tokens - 1);
    None for a request of fewer than two tokens."""
    return span_s / (tokens - 1) if tokens > 1 else None


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


def tokens_equal(pi, text, ids, ref_ids, ref_text, tok):
    """(output tokens, equal to the offline greedy output) of one response to prompt ``pi``: token ids where the
    server returned them (tensorpar), else the text, counted by the tokenizer (`transformers serve`)."""
    if ids is not None:
        return len(ids), ids == ref_ids[pi]
    return len(tok(text, add_special_tokens=False)["input_ids"]), text == ref_text[pi]


def summarize(name, results, wall, ref_ids, ref_text, tok):
    ok = [r for r in results if r[5] is None]
    errors = len(results) - len(ok)
    ttft = [r[1] for r in ok if r[1] is not None]
    itl = [g for r in ok for g in r[2]]
    tokens = 0
    equal = 0
    for pi, _, _, text, ids, _ in ok:
        n, same = tokens_equal(pi, text, ids, ref_ids, ref_text, tok)
        tokens += n
        equal += same
    return dict(backend=name, requests=len(results), errors=errors, wall_s=wall, req_per_s=len(ok) / wall,
                out_tok_per_s=tokens / wall, ttft_p50_ms=pct(ttft, 50) * 1e3, ttft_p99_ms=pct(ttft, 99) * 1e3,
                itl_p50_ms=pct(itl, 50) * 1e3, itl_p99_ms=pct(itl, 99) * 1e3, greedy_equal=equal,
                greedy_checked=len(ok), first_error=next((r[5] for r in results if r[5]), None))


def start(cmd, env, cwd=None):
    """Start a server in its own session (in ``cwd``: ``python -m`` imports the package of its working directory
    first); its stderr goes to a temporary file (a pipe nobody reads would fill up and block a server that logs),
    read back by :func:`err_tail`."""
    err = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True, env=env, start_new_session=True,
                            cwd=cwd)
    proc.errfile = err
    return proc


def err_tail(proc, n=500):
    """The last ``n`` characters the server wrote to stderr."""
    proc.errfile.seek(0)
    return proc.errfile.read()[-n:]


def stop(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    proc.errfile.close()


def _children(pid: int) -> list[int]:
    """Every descendant process of ``pid`` (from /proc's parent links)."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def rank_pids(proc, port: int) -> list[int]:
    """The pids of a tensorpar server's ranks: rank 0 (the process listening on ``port``) first, then the other
    ranks (the launcher's descendants that load torch, by pid: their start order). One rank: the server process
    itself."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "0A":
                    inodes.add(f"socket:[{f[9]}]")
        except OSError:
            pass
    ranks = []
    for pid in _children(proc.pid):
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
            fds = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        except OSError:
            continue
        if "libtorch" in maps:
            ranks.append((not (fds & inodes), pid))
    return [pid for _, pid in sorted(ranks)] or [proc.pid]


def schedstat(pid: int) -> tuple[float, float] | None:
    """Seconds the main thread of ``pid`` has run on a CPU and waited runnable for one (``None``: gone)."""
    try:
        run, wait, _ = Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()
    except (OSError, ValueError):
        return None
    return int(run) / 1e9, int(wait) / 1e9


def thread_shares(before: list, after: list, wall: float) -> list[dict]:
    """Per rank, from :func:`schedstat` before and after ``wall`` seconds: the shares of ``wall`` its main thread
    ran, waited for a core and slept (the rest: blocked on the other ranks or on requests)."""
    out = []
    for a, b in zip(before, after):
        if a is None or b is None:
            out.append(None)
            continue
        run, runq = (b[0] - a[0]) / wall, (b[1] - a[1]) / wall
        out.append(dict(run=run, runq=runq, sleep=max(0.0, 1 - run - runq)))
    return out


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

    from tensorpar.serve.pool import kv_pool
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
                rows.append(dict(run=name, error=f"did not start: {err_tail(proc)}"))
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
    cpu = cpu_model()
    meta = dict(model=Path(folder).name, dtype=args.dtype, tp=tp, kv_cache_memory=memory, block_bytes=per_block,
                system_tokens=len(system), question_tokens=args.question_tokens, max_tokens=args.max_tokens,
                cpu=cpu, cpus=os.cpu_count(), loadavg_start=load0, loadavg_end=load1, outputs_identical=same,
                date=time.strftime("%Y-%m-%d %H:%M:%S"))
    out = Path(args.out)
    atomic_write(out.with_suffix(".json"), json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"# tensorpar serve: paged KV cache and prefix caching ({meta['date']})", "",
             f"Model {meta['model']} in {args.dtype} at tp={tp}; KV pool `--kv-cache-memory {memory}` (the memory of "
             f"16 slots x 1024 positions before paging: {memory // per_block} blocks of 16 positions). CPU: {cpu}, "
             f"{meta['cpus']} cores; load average {load0[0]:.1f} at start, {load1[0]:.1f} after the last server stopped (each row's "
             f"own before / after is in its table): the machine was "
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


def reference(folder, tok, args):
    """Offline greedy outputs of every prompt: transformers' single-process ``generate``, one prompt at a time,
    ``--max-tokens`` tokens cut at the first EOS; (token ids, text) per prompt."""
    import torch
    from transformers import AutoModelForCausalLM

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
    return ref_ids, ref_text


def backends(args, folder):
    """The servers of a run, each on its own port: tensorpar at each ``--tp``, tensorpar ``--tp 1 --pp P`` at each
    ``--pp``, then `transformers serve --continuous-batching` with ``--transformers``. A dict each: name, cmd, env,
    base URL, the model name its API expects, extra request fields, and whether it has tensorpar's /metrics."""
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    out, port = [], args.port
    codes = [("", os.getcwd())]
    if getattr(args, "before", None):       # the older code first, then this checkout's, --repeats times
        codes = [(" (before)", args.before), (" (after)", os.getcwd())] * args.repeats
    for tp, pp in [(tp, 1) for tp in args.tp] + [(1, pp) for pp in args.pp]:
        for tag, code in codes:
            cmd = [sys.executable, "-m", "tensorpar", "serve", "--model", folder, "--tp", str(tp), "--port",
                   str(port), "--max-batch", str(args.max_batch), "--max-model-len", str(args.max_model_len),
                   "--max-waiting", str(max(256, args.requests)), "--served-model-name", "m", "--dtype", args.dtype]
            if pp > 1:
                cmd += ["--pp", str(pp)]
            out.append(dict(name=f"tensorpar tp={tp}" + (f" pp={pp}" if pp > 1 else "") + tag, cmd=cmd,
                            env=dict(env, PYTHONPATH=code), cwd=code, base=f"http://127.0.0.1:{port}", model="m",
                            extra={"return_token_ids": True}, kv=True, port=port))
            port += 1
    if args.transformers:
        threads = str(max(1, (os.cpu_count() or 2)))
        # its KV pool as large as tensorpar's (max_batch x max_model_len positions in blocks of 16): by default it
        # sizes the pool from the free memory (14.5 GB resident on this 23 GB machine), and was killed by the OOM
        # killer under other jobs' memory
        blocks = args.max_batch * -(-args.max_model_len // 16)
        cmd = [os.path.join(os.path.dirname(sys.executable), "transformers"), "serve", folder, "--host", "127.0.0.1",
               "--port", str(port), "--device", "cpu", "--dtype", args.dtype, "--continuous-batching",
               "--cb-block-size", "16", "--cb-num-blocks", str(blocks)]
        out.append(dict(name="transformers serve --continuous-batching", cmd=cmd,
                        env=dict(env, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=threads), base=f"http://127.0.0.1:{port}",
                        model=folder, extra={}, kv=False))
    return out


def launch(b):
    """Start backend ``b``, wait for its /health, then send one short warm-up completion (not measured:
    `transformers serve` loads the model at its first request, which took 30 s here); (process, None) or
    (None, why it did not start)."""
    proc = start(b["cmd"], b["env"], b.get("cwd"))
    if not wait_ready(b["base"], proc, 900):
        why = err_tail(proc, 800) if proc.poll() is not None else "no /health within 900 s"
        stop(proc)
        return None, why
    host, port = b["base"].split("//")[1].split(":")
    try:
        err = stream_one(host, int(port), dict(model=b["model"], prompt=PROMPTS[0], max_tokens=2, temperature=0,
                                               stream=True, **b["extra"]))[4]
    except Exception as e:  # noqa: BLE001 - reported as the backend's failure
        err = f"{type(e).__name__}: {e}"
    if err is not None:
        stop(proc)
        return None, f"warm-up request failed: {err}"
    return proc, None


def closed_loop_main(args, folder, tok):
    """Issue 11's load test: each backend alone, ``--requests`` from ``--concurrency`` client threads."""
    load0 = os.getloadavg()
    ref_ids, ref_text = reference(folder, tok, args)
    rows = []
    for b in backends(args, folder):
        proc, why = launch(b)
        if proc is None:
            rows.append(dict(backend=b["name"], error=f"did not start: {why}"))
            continue
        try:
            la = os.getloadavg()[0]
            pids = rank_pids(proc, b["port"]) if b["kv"] else []
            st0 = [schedstat(p) for p in pids]
            res, wall = run_load(b["base"], b["model"], args, b["extra"])
            rows.append(summarize(b["name"], res, wall, ref_ids, ref_text, tok))
            rows[-1]["loadavg"] = (la, os.getloadavg()[0])
            rows[-1]["ranks"] = thread_shares(st0, [schedstat(p) for p in pids], wall)
            print(rows[-1], flush=True)
        finally:
            stop(proc)
    load1 = os.getloadavg()
    meta = dict(model=folder.replace(str(Path.home()), "~", 1),  # no absolute machine paths in results
                dtype=args.dtype, requests=args.requests, concurrency=args.concurrency, max_tokens=args.max_tokens,
                max_batch=args.max_batch, cpu=cpu_model(), cpus=os.cpu_count(), loadavg_start=load0,
                before=args.before and "an older checkout (--before)", repeats=args.repeats,
                loadavg_end=load1, date=time.strftime("%Y-%m-%d %H:%M:%S"))
    out = Path(args.out)
    atomic_write(out.with_suffix(".json"), json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"# tensorpar serve load test ({meta['date']})", "",
             f"Model {Path(folder).name} in {args.dtype} (every backend and the offline reference); "
             f"{args.requests} streaming greedy completions of {args.max_tokens} tokens "
             f"from {args.concurrency} concurrent clients on loopback, {len(PROMPTS)} prompts of mixed length; "
             f"--max-batch {args.max_batch}; {meta['cpu']}, {meta['cpus']} CPUs; load average {load0[0]:.1f} at "
             f"start, {load1[0]:.1f} after the last server stopped (each row's own in the table; other jobs share the "
             f"machine).", "",
             "Per rank (rank 0 first), the shares of the load's wall time its main thread ran / waited for a core / "
             "slept (blocked on the other ranks or on requests: at --pp, the stage's bubble).", "",
             "| backend | requests | errors | req/s | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
             "greedy equal to offline | load avg before / after | main thread run / runq / sleep, per rank |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['backend']} | - | did not run: {r['error'].strip().splitlines()[-1][:200]} |"
                         " | | | | | | |")
            continue
        lines.append(f"| {r['backend']} | {r['requests']} | {r['errors']} | {r['req_per_s']:.2f} | "
                     f"{r['out_tok_per_s']:.1f} | {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
                     f"{r['itl_p50_ms']:.0f} / {r['itl_p99_ms']:.0f} | {r['greedy_equal']}/{r['greedy_checked']} | "
                     f"{r['loadavg'][0]:.1f} / {r['loadavg'][1]:.1f} | "
                     + "; ".join("-" if x is None else f"{x['run']:.2f} / {x['runq']:.2f} / {x['sleep']:.2f}"
                                 for x in r.get("ranks") or []) + " |")
    atomic_write(out.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


def open_loop(b, rate, args, ref_ids, ref_text, tok):
    """``--requests`` streaming requests to backend ``b`` at Poisson arrival times of ``rate`` per second (seed
    ``--seed``; one thread per request, so a slow server never delays the next arrival), for at most
    ``--time-limit`` seconds of arrivals. Polls /metrics every 0.5 s for the peak KV block usage (tensorpar only).
    One row: TTFT and TPOT p50/p90/p99, throughput, peaks, outputs against the offline reference."""
    host, port = b["base"].split("//")[1].split(":")
    arrivals = [t for t in poisson_arrivals(args.requests, rate, args.seed) if t <= args.time_limit]
    res, ends = [None] * len(arrivals), [None] * len(arrivals)
    peak = dict(usage=0.0, used=0.0, waiting=0.0, running=0.0)
    done = threading.Event()
    m0 = metrics(b["base"]) if b["kv"] else {}

    def poll():
        while not done.wait(0.5):
            try:
                m = metrics(b["base"])
            except OSError:
                continue
            for k, name in (("usage", "kv_cache_usage"), ("used", "kv_blocks_used"),
                            ("waiting", "num_requests_waiting"), ("running", "num_requests_running")):
                peak[k] = max(peak[k], m.get(f"tensorpar_{name}", 0.0))

    def one(i):
        body = dict(model=b["model"], prompt=PROMPTS[i % len(PROMPTS)], max_tokens=args.max_tokens, temperature=0,
                    stream=True, **b["extra"])
        try:
            res[i] = stream_one(host, int(port), body)
        except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
            res[i] = (None, [], "", None, f"{type(e).__name__}: {e}")
        ends[i] = time.perf_counter()

    la = os.getloadavg()[0]
    poller = threading.Thread(target=poll, daemon=True)
    if b["kv"]:
        poller.start()
    threads, lag = [], 0.0
    t0 = time.perf_counter()
    for i, at in enumerate(arrivals):
        wait = t0 + at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        lag = max(lag, -wait)
        threads.append(threading.Thread(target=one, args=(i,)))
        threads[-1].start()
    for t in threads:
        t.join()
    wall = max(ends, default=t0) - t0
    done.set()
    m1 = metrics(b["base"]) if b["kv"] else {}
    ttft, tpots, tokens, equal, ok = [], [], 0, 0, 0
    for i, (t_first, gaps, text, ids, err) in enumerate(res):
        if err is not None or t_first is None:
            continue
        n, same = tokens_equal(i % len(PROMPTS), text, ids, ref_ids, ref_text, tok)
        ok, tokens, equal = ok + 1, tokens + n, equal + same
        ttft.append(t_first)
        if tpot(sum(gaps), n) is not None:
            tpots.append(tpot(sum(gaps), n))
    row = dict(backend=b["name"], rate=rate, requests=len(res), errors=len(res) - ok, wall_s=wall,
               req_per_s=ok / wall if wall > 0 else float("nan"), out_tok_per_s=tokens / wall if wall > 0 else 0.0,
               greedy_equal=equal, greedy_checked=ok, send_lag_max_ms=lag * 1e3,
               first_error=next((r[4] for r in res if r[4]), None), loadavg=(la, os.getloadavg()[0]))
    for q in (50, 90, 99):
        row[f"ttft_p{q}_ms"] = pct(ttft, q) * 1e3
        row[f"tpot_p{q}_ms"] = pct(tpots, q) * 1e3
    if b["kv"]:
        row.update(kv_usage_peak=peak["usage"], kv_blocks_peak=peak["used"],
                   kv_blocks_total=m1.get("tensorpar_kv_blocks_total"), waiting_peak=peak["waiting"],
                   running_peak=peak["running"], preemptions=m1.get("tensorpar_num_preemptions_total", 0.0)
                   - m0.get("tensorpar_num_preemptions_total", 0.0))
    return row


def latency_main(args, folder, tok):
    """Issue 24 item 5: every backend started and kept up; the saturating rate of each measured closed-loop (unless
    ``--rates`` fixes the rates), then open-loop Poisson runs at ``--rate-factors`` x that rate, the backends'
    runs interleaved per factor (one backend loaded at a time, the others idle)."""
    load0 = os.getloadavg()
    ref_ids, ref_text = reference(folder, tok, args)
    live, procs, failed, sat, rows = [], [], [], {}, []
    try:
        for b in backends(args, folder):
            proc, why = launch(b)
            if proc is None:
                failed.append(dict(backend=b["name"], error=f"did not start: {why}"))
                print(failed[-1], flush=True)
                continue
            live.append(b)
            procs.append(proc)
        if not args.rates:
            for b in live:
                res, wall = run_load(b["base"], b["model"], args, b["extra"])
                sat[b["name"]] = summarize(b["name"], res, wall, ref_ids, ref_text, tok)
                print("saturation", sat[b["name"]], flush=True)
        points = ([(None, r) for r in args.rates] if args.rates else [(f, None) for f in args.rate_factors])
        for factor, fixed in points:
            for b, proc in zip(live, procs):
                rate = fixed if fixed else factor * sat[b["name"]]["req_per_s"]
                if proc.poll() is not None:
                    rows.append(dict(backend=b["name"], factor=factor,
                                     error=f"server exited ({proc.returncode}): {err_tail(proc)}"))
                    continue
                if not rate > 0:
                    rows.append(dict(backend=b["name"], factor=factor, error="no saturating rate measured: "
                                     f"{sat[b['name']]['first_error']}"))
                    continue
                rows.append(dict(factor=factor, **open_loop(b, rate, args, ref_ids, ref_text, tok)))
                print(rows[-1], flush=True)
    finally:
        for proc in procs:
            stop(proc)
    load1 = os.getloadavg()
    meta = dict(model=folder.replace(str(Path.home()), "~", 1), dtype=args.dtype, requests_per_rate=args.requests,
                max_tokens=args.max_tokens, max_batch=args.max_batch, max_model_len=args.max_model_len,
                saturation_concurrency=None if args.rates else args.concurrency, seed=args.seed,
                rate_factors=None if args.rates else args.rate_factors, rates=args.rates, time_limit_s=args.time_limit,
                cpu=cpu_model(), cpus=os.cpu_count(), loadavg_start=load0, loadavg_end=load1,
                date=time.strftime("%Y-%m-%d %H:%M:%S"))
    out = Path(args.out)
    atomic_write(out.with_suffix(".json"), json.dumps(dict(meta=meta, failed=failed, saturation=sat, rows=rows),
                                                      indent=1))
    if any("error" not in r for r in rows):
        plot_latency(meta, rows, out.with_suffix(".png"))
    lines = latency_markdown(meta, failed, sat, rows, Path(folder).name, out.with_suffix(".png").name)
    atomic_write(out.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


def _ms3(r, key):
    return " / ".join(f"{r[f'{key}_p{q}_ms']:.0f}" for q in (50, 90, 99))


def latency_markdown(meta, failed, sat, rows, model, png):
    la0, la1 = meta["loadavg_start"], meta["loadavg_end"]
    how = (f"`--rate-factors {' '.join(map(str, meta['rate_factors']))}` x each backend's saturating rate "
           f"(closed loop, {meta['saturation_concurrency']} clients, {meta['requests_per_rate']} requests)"
           if meta["rate_factors"] else f"`--rates {' '.join(map(str, meta['rates']))}` req/s for every backend")
    lines = [f"# tensorpar serve: latency under load ({meta['date']})", "",
             f"Model {model} in {meta['dtype']}; {meta['requests_per_rate']} streaming greedy completions of "
             f"{meta['max_tokens']} tokens per rate ({len(PROMPTS)} prompts of mixed length), sent open-loop at "
             f"Poisson arrival times (seed {meta['seed']}, the same pattern scaled to each rate) at {how}; "
             f"`--max-batch {meta['max_batch']} --max-model-len {meta['max_model_len']}`. Every backend runs on "
             f"loopback and stays up for the whole run; at each rate the backends run one after the other. "
             f"CPU: {meta['cpu']}, {meta['cpus']} cores, shared with the clients. Load average (1 / 5 / 15 min) "
             f"{la0[0]:.1f} / {la0[1]:.1f} / {la0[2]:.1f} at start, {la1[0]:.1f} / {la1[1]:.1f} / {la1[2]:.1f} at "
             f"end: other jobs ran on the machine, so absolute times are inflated and a row's own load average "
             f"(before / after) says how much; compare backends within a rate.", "",
             "TTFT: request sent to first streamed token. TPOT per request: (last token - first token) / "
             "(tokens - 1); percentiles over requests. Throughputs over the time from the first arrival to the "
             "last response. KV: peak of `tensorpar_kv_cache_usage` (blocks used / total) in /metrics polled every "
             "0.5 s. Send lag: how late the client sent its latest request (its own CPU share).", ""]
    if sat:
        lines += ["Saturating rate (closed loop):", "", "| backend | req/s | output tok/s | greedy equal |",
                  "|---|---|---|---|"]
        lines += [f"| {n} | {s['req_per_s']:.2f} | {s['out_tok_per_s']:.1f} | {s['greedy_equal']}/"
                  f"{s['greedy_checked']} |" for n, s in sat.items()]
        lines.append("")
    lines += ["| backend | rate x sat | offered req/s | requests | errors | achieved req/s | output tok/s | "
              "TTFT p50 / p90 / p99 ms | TPOT p50 / p90 / p99 ms | peak KV usage (blocks) | peak waiting | "
              "greedy equal | send lag ms | load avg before / after |", "|" + "---|" * 14]
    for r in failed + rows:
        if "error" in r:
            lines.append(f"| {r['backend']} | did not run: {r['error'].strip().splitlines()[-1][:200]} |"
                         + " |" * 12)
            continue
        kv, waiting = "n/a", "n/a"   # transformers serve has no KV block metrics
        if "kv_usage_peak" in r:
            kv = f"{r['kv_usage_peak']:.2f} ({r['kv_blocks_peak']:.0f}/{r['kv_blocks_total']:.0f})"
            waiting = f"{r['waiting_peak']:.0f}"
        lines.append(f"| {r['backend']} | {r['factor'] if r['factor'] is not None else '-'} | {r['rate']:.2f} | "
                     f"{r['requests']} | {r['errors']} | {r['req_per_s']:.2f} | {r['out_tok_per_s']:.1f} | "
                     f"{_ms3(r, 'ttft')} | {_ms3(r, 'tpot')} | {kv} | {waiting} | {r['greedy_equal']}/"
                     f"{r['greedy_checked']} | {r['send_lag_max_ms']:.0f} | {r['loadavg'][0]:.1f} / "
                     f"{r['loadavg'][1]:.1f} |")
    lines += ["", f"![TTFT and TPOT against request rate]({png})"]
    return lines


def plot_latency(meta, rows, path: Path):
    """TTFT and TPOT (p50 line, p50-p90 band, p99 dotted) against the offered request rate, one colour per backend;
    written atomically as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["backend"] for r in rows if "error" not in r))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, title in ((axes[0], "ttft", "time to first token"), (axes[1], "tpot", "time per output token")):
        for k, name in enumerate(names):
            rs = sorted((r for r in rows if r["backend"] == name and "error" not in r), key=lambda r: r["rate"])
            x = [r["rate"] for r in rs]
            p50, p90, p99 = ([r[f"{key}_p{q}_ms"] for r in rs] for q in (50, 90, 99))
            c = f"C{k}"
            ax.plot(x, p50, "o-", color=c, label=name)
            ax.fill_between(x, p50, p90, color=c, alpha=0.2, linewidth=0)
            ax.plot(x, p99, "^:", color=c, markersize=4)
        ax.set_yscale("log")
        ax.set_xlabel("offered request rate (requests/s, Poisson)")
        ax.set_ylabel("ms")
        ax.set_title(f"{title}: p50 (line), to p90 (band), p99 (dotted)", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    la0, la1 = meta["loadavg_start"][0], meta["loadavg_end"][0]
    fig.suptitle(f"tensorpar serve latency under load: {Path(meta['model']).name} {meta['dtype']}, "
                 f"{meta['max_tokens']} tokens/request, {meta['cpu']} x{meta['cpus']}, load avg {la0:.1f} -> {la1:.1f}",
                 fontsize=10)
    fig.tight_layout()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".png")
    os.close(fd)
    fig.savefig(tmp, dpi=100, metadata={"Software": None})
    plt.close(fig)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def tiny_random(smollm2: Path) -> str:
    """``--model tiny-random``: a seeded random Llama (2 layers, hidden 64, 4 heads, 2 KV heads) with SmolLM2's
    tokenizer, written once to ~/.cache/tensorpar/models/tiny-random-llama-smollm2-tok: a model whose step is
    cheap, for runs that must be short on a loaded machine (its outputs are not meaningful text)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = Path.home() / ".cache/tensorpar/models/tiny-random-llama-smollm2-tok"
    if (folder / "config.json").exists():
        return str(folder)
    tok = AutoTokenizer.from_pretrained(smollm2)
    cfg = AutoConfig.for_model("llama", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                               eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + "."))
    AutoModelForCausalLM.from_config(cfg).float().save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        os.replace(tmp, folder)          # atomic: a concurrent first use keeps whichever folder landed first
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(folder)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2",
                    help="a model for tensorpar.hub.resolve_model, or tiny-random (see tiny_random)")
    ap.add_argument("--tp", type=int, nargs="*", default=[1, 2], help="tensorpar backends, one per tp degree")
    ap.add_argument("--pp", type=int, nargs="*", default=[],
                    help="also tensorpar --tp 1 --pp P for each P (pipeline stages, one batch per stage in flight)")
    ap.add_argument("--before", default=None,
                    help="closed loop: also run every tensorpar backend on the code in this folder (an older "
                         "checkout), interleaved with this checkout's")
    ap.add_argument("--repeats", type=int, default=1, help="--before: before/after pairs per backend")
    ap.add_argument("--requests", type=int, default=200, help="requests per backend (--latency: per rate)")
    ap.add_argument("--concurrency", type=int, default=32, help="client threads of the closed-loop runs")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--time-limit", type=float, default=900, help="seconds of load per backend (then stop)")
    ap.add_argument("--transformers", action="store_true", help="also run `transformers serve` on the same folder")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="weights and compute of every backend, and of the offline reference")
    ap.add_argument("--port", type=int, default=8731, help="first backend's port; the next ones count up")
    ap.add_argument("--out", default=None, help="results path without suffix (default bench/results/serve, "
                                                 "serve_prefix or serve_latency)")
    ap.add_argument("--prefix", action="store_true", help="the shared-prefix and pool runs (issue 24)")
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--latency", action="store_true",
                    help="latency under load (issue 24): open-loop Poisson arrivals at several request rates")
    ap.add_argument("--rate-factors", type=float, nargs="+", default=[0.5, 1.0, 2.0],
                    help="--latency: rates as multiples of each backend's measured saturating rate")
    ap.add_argument("--rates", type=float, nargs="+", default=None,
                    help="--latency: these request rates (req/s) for every backend instead (no saturation run)")
    ap.add_argument("--seed", type=int, default=0, help="--latency: seed of the Poisson arrival times")
    args = ap.parse_args()
    for name in ("rates", "rate_factors"):
        if any(not v > 0 for v in getattr(args, name) or []):
            ap.error(f"--{name.replace('_', '-')} must all be > 0, got {getattr(args, name)}")
    if any(p < 2 for p in args.pp):
        ap.error(f"--pp lists pipeline degrees of 2 or more (tp=1 without stages is --tp 1), got {args.pp}")
    if args.prefix and args.latency:
        ap.error("--prefix and --latency are separate runs; give one")
    from transformers import AutoTokenizer

    from tensorpar.hub import resolve_model
    folder = tiny_random(resolve_model("smollm2")) if args.model == "tiny-random" else str(resolve_model(args.model))
    tok = AutoTokenizer.from_pretrained(folder)
    mode = "prefix" if args.prefix else "latency" if args.latency else "closed"
    args.out = args.out or {"prefix": "bench/results/serve_prefix", "latency": "bench/results/serve_latency",
                            "closed": "bench/results/serve"}[mode]
    if mode == "prefix":
        return prefix_main(args, folder, tok)
    if mode == "latency":
        return latency_main(args, folder, tok)
    return closed_loop_main(args, folder, tok)


if __name__ == "__main__":
    main()
