"""Greedy decode on one CUDA GPU: tensorpar at tp=1 (``generate_tokens``, the engine's general loop: the row step and
our GEMV kernels are CPU-only) against transformers' ``generate`` on the same GPU, same weights, interleaved.

Model: a random-weight Llama of TinyLlama-1.1B's shape (``--shape tinyllama``, bench_llamacpp.TINYLLAMA; ``tiny``: a
2-layer one for a smoke run on any machine), built once under ``$TENSORPAR_CACHE`` (bench_hf_tp.model_folder).
Per round and dtype (fp32, bf16): one prompt of ``--prompt-len`` ids, ``--tokens`` new tokens, after one warm-up
call of each. tokens/s: decode steps only (``GenerationResult.decode_s``; transformers: the whole ``generate`` minus
a 1-token ``generate``, i.e. its prefill). The tokens of the two are compared (fp32: expected equal; bf16: the first
difference reported, not asserted). Results: ``--out``.{md,json} with the GPU, torch and the host CPU.

    PYTHONPATH=. python bench/bench_cuda_decode.py [--shape tinyllama] [--rounds 2] [--out bench/results/cuda-decode]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine, write_results  # noqa: E402

TINY = dict(model_type="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
            tie_word_embeddings=False)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_transformers(model, ids, n, device):
    """(new tokens [1, n], decode seconds): generate(n) minus generate(1), both greedy."""
    def gen(k):
        sync(device)
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, min_new_tokens=k,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        sync(device)
        return out[:, ids.shape[1]:], time.perf_counter() - t
    _, t1 = gen(1)
    toks, tn = gen(n)
    return toks.cpu(), max(tn - t1, 1e-9)


def run_tensorpar(model, tp, ids, n):
    from tensorpar.generate import SamplingConfig, generate_tokens
    r = generate_tokens(model, tp, ids, torch.ones_like(ids), sampling=SamplingConfig(max_new_tokens=n))
    return r.tokens.cpu(), r.decode_s, r.ttft_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=["tinyllama", "tiny"], default="tinyllama")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="bench/results/cuda-decode")
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from bench_hf_tp import model_folder
    from tensorpar.hf.load import build_parallel_model
    from tensorpar.parallel import ParallelContext

    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if a.shape == "tinyllama":
        from bench_llamacpp import TINYLLAMA, TINYLLAMA_SEED
        folder = model_folder(None, TINYLLAMA, TINYLLAMA_SEED)
    else:
        folder = model_folder(None, TINY, 0)
    ctx = ParallelContext.single(device)
    ids = torch.randint(3, 500, (1, a.prompt_len), generator=torch.Generator().manual_seed(0)).to(device)
    meta = dict(machine(), gpu=torch.cuda.get_device_name(0) if device.type == "cuda" else None,
                torch=torch.__version__, cuda=torch.version.cuda, shape=a.shape, tokens=a.tokens,
                prompt_len=a.prompt_len, rounds=a.rounds, started=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    rows = []
    for dname in a.dtypes.split(","):
        dtype = getattr(torch, dname)
        hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()
        tpm, _ = build_parallel_model(str(folder), ctx.tp, dtype=dtype, device=device)
        got = {"transformers": [], "tensorpar": []}
        ttft = []
        with torch.no_grad():
            run_transformers(hf, ids, 4, device)                 # warm-up
            run_tensorpar(tpm, ctx.tp, ids, 4)
            for r in range(a.rounds):
                for who in (("transformers", "tensorpar") if r % 2 == 0 else ("tensorpar", "transformers")):
                    if who == "transformers":
                        toks_hf, s = run_transformers(hf, ids, a.tokens, device)
                    else:
                        toks_tp, s, t0 = run_tensorpar(tpm, ctx.tp, ids, a.tokens)
                        ttft.append(t0)
                    got[who].append((a.tokens - 1) / s)
        same = (toks_hf == toks_tp)[0]
        first = None if bool(same.all()) else int((~same).nonzero()[0])
        rows.append(dict(dtype=dname, transformers=statistics.median(got["transformers"]),
                         tensorpar=statistics.median(got["tensorpar"]), per_round=got,
                         tensorpar_ttft_ms=1e3 * statistics.median(ttft), first_difference=first))
        del hf, tpm
        if device.type == "cuda":
            torch.cuda.empty_cache()
    lines = [f"Greedy decode on {meta['gpu'] or 'the CPU'} (bench/bench_cuda_decode.py), {a.shape} random Llama, "
             f"{a.prompt_len}-token prompt, {a.tokens} new tokens, batch 1, median of {a.rounds} interleaved rounds; "
             f"torch {meta['torch']} (CUDA {meta['cuda']}), host CPU {meta['cpu']}, {meta['started']}, load "
             f"{meta['loadavg'][0]:.2f}.", "",
             "| dtype | transformers tokens/s | tensorpar tp=1 tokens/s | tensorpar / transformers | tensorpar TTFT ms "
             "| tokens equal |", "|---|---|---|---|---|---|"]
    for r in rows:
        eq = "all" if r["first_difference"] is None else f"first {r['first_difference']} of {a.tokens}"
        lines.append(f"| {r['dtype']} | {r['transformers']:.1f} | {r['tensorpar']:.1f} | "
                     f"{r['tensorpar'] / r['transformers']:.2f}x | {r['tensorpar_ttft_ms']:.1f} | {eq} |")
    write_results(Path(a.out), meta, rows, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
