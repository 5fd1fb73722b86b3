"""Cost of streaming detokenization per generated token: tensorpar.streaming.IncrementalDecoder (a short
window per step) against decoding the whole sequence every step (what `generate` did before).

Uses SmolLM2's tokenizer (resolve_model("smollm2"), cached under ~/.cache/tensorpar) on a mixed
English / CJK / emoji text cut to N tokens. Writes bench/results/streaming.md.

usage: PYTHONPATH=. python bench/bench_streaming.py
"""
from __future__ import annotations

import os
import platform
import time
from pathlib import Path

from transformers import AutoTokenizer

from tensorpar.hub import resolve_model
from tensorpar.streaming import IncrementalDecoder

TEXT = ("Paris is the capital of France 🇫🇷. 巴黎是法国的首都。パリはフランスの首都です 😀. "
        "Seoul is the capital of Korea: 서울은 한국의 수도입니다 🎉. ") * 200
LENGTHS = (128, 512, 2048)
REPEATS = 3


def full_decode_each_step(tok, ids):
    shown, pieces = "", []
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k], skip_special_tokens=True)
        pieces.append(text[len(shown):])  # the old generate stream: printed even a partial character
        shown = text


def incremental(tok, ids):
    dec = IncrementalDecoder(lambda x: tok.decode(x, skip_special_tokens=True))
    for i in ids:
        dec.push(i)
    dec.flush()


def best_of(fn, *args):
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return min(times)


def main():
    tok = AutoTokenizer.from_pretrained(str(resolve_model("smollm2", progress=False)))
    all_ids = tok.encode(TEXT, add_special_tokens=False)
    rows = []
    for n in LENGTHS:
        ids = all_ids[:n]
        inc = best_of(incremental, tok, ids)
        full = best_of(full_decode_each_step, tok, ids)
        rows.append((n, inc / n * 1e6, full / n * 1e6))
        print(f"{n} tokens: incremental {inc / n * 1e6:.1f} us/token, full decode {full / n * 1e6:.1f} us/token")
    load = os.getloadavg()[0]
    lines = ["# Streaming detokenization cost per token (SmolLM2 tokenizer)", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, load average {load:.1f} at the end of the "
             f"run (other processes share the cores: compare the columns, not the absolute values); best of "
             f"{REPEATS} runs; text: English / Chinese / Japanese / Korean / emoji. Written by "
             "bench/bench_streaming.py.", "",
             "| tokens | IncrementalDecoder (us/token) | decode whole sequence each step (us/token) |",
             "|---:|---:|---:|"]
    lines += [f"| {n} | {a:.1f} | {b:.1f} |" for n, a, b in rows]
    out = Path(__file__).parent / "results" / "streaming.md"
    tmp = out.with_suffix(".md.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
