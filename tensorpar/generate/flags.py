"""The command line of ``tensorpar generate``: its flags (:func:`add_arguments`, the shared launch flags of
:func:`tensorpar.cli.add_launch_arguments` among them) and the checks of the flags alone (:func:`check_flags`), made
in the launching process before the model is read."""
from __future__ import annotations

import argparse

from tensorpar.decode.quantize import add_quantize_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tensorpar.cli import add_launch_arguments, add_lora_argument

    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (built in, fetched and converted once), a Hugging Face-format folder, a hub "
                        "id already in the local Hugging Face cache, or a .gguf file")
    add_launch_arguments(p, ep=True, pp=True, plan=True)
    add_lora_argument(p)
    p.add_argument("--prompt", action="append", help="prompt text; repeat for a batch (default: a sample prompt)")
    p.add_argument("--prompt-file", action="append", default=None,
                   help="a UTF-8 text file of prompts, one per line (blank lines skipped; '-': standard input), after "
                        "any --prompt: a batch; repeat for several files")
    p.add_argument("--max-new-tokens", type=int, default=32, help="token budget per prompt (>= 1)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="softmax temperature (default 0 = greedy; unlike serve's default 1); --top-k, --top-p and "
                        "--seed need a temperature > 0")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off)")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling generator (rank 0; default 0)")
    add_quantize_argument(p)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant results: each prompt's greedy tokens are bitwise those it gets alone "
                        "(slower; docs/serve.md)")
    p.add_argument("--print-plan", action="store_true", help="print the sharding plan and exit")
    from tensorpar.verify.prove import add_arguments as add_plan_arguments
    add_plan_arguments(p, plan_file=True)


def check_flags(args: argparse.Namespace) -> None:
    """The checks of the flags alone (no model read); ``--prompt-file``'s prompts are read here and appended to
    ``args.prompt`` (:func:`read_prompt_file`). Raises ValueError naming the flag."""
    import math

    from tensorpar.cli import check_launch_arguments, check_plan_arguments

    if args.tp < 1:
        raise ValueError(f"--tp must be a positive integer (ranks to start), got {args.tp}")
    check_launch_arguments(args)
    check_plan_arguments(args)   # --plan auto and its inputs
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ValueError(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    if not (math.isfinite(args.top_p) and 0 < args.top_p <= 1):
        raise ValueError(f"--top-p must be in (0, 1] (1 = off), got {args.top_p}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.top_k < 0:
        raise ValueError(f"--top-k must be >= 0 (0 = off), got {args.top_k}")
    if args.seed is not None and not 0 <= args.seed < 2 ** 63:
        raise ValueError(f"--seed must be in [0, 2**63), got {args.seed}")
    if args.temperature == 0:       # greedy: these would silently do nothing
        unused = [f"{name} {v}" for name, v, off in (("--top-p", args.top_p, 1.0), ("--top-k", args.top_k, 0),
                                                      ("--seed", args.seed, None)) if v != off]
        if unused:
            raise ValueError(f"{', '.join(unused)}: sampling options need --temperature > 0 (the default 0 is "
                             f"greedy, which ignores them); add e.g. --temperature 1 or drop them")
    if getattr(args, "prompt_file", None):                   # read once, here: the prompts travel as tokens
        for path in args.prompt_file:
            args.prompt = (args.prompt or []) + read_prompt_file(path)
        args.prompt_file = None                               # read: a second check adds nothing
    for p in args.prompt or []:
        try:
            p.encode("utf-8")
        except UnicodeEncodeError as e:  # argv bytes that are not UTF-8 arrive as lone surrogates
            raise ValueError(f"--prompt {p[:20]!r}... is not valid UTF-8 (character {e.start}); pass UTF-8 text") \
                from None
        if not p.strip():
            raise ValueError("--prompt must not be empty; give the text to continue")


def read_prompt_file(path: str) -> list[str]:
    """The prompts of ``--prompt-file``: one per line (``\\n``, ``\\r\\n`` or ``\\r``: Python's universal newlines),
    blank lines skipped, a UTF-8 byte-order mark at the start dropped (Windows editors write one); ``-`` reads
    standard input. Raises ValueError naming the flag: a file that cannot be read, is not UTF-8, or holds no
    prompt."""
    import io
    import sys
    try:
        if path == "-":
            f = io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8-sig")
            lines = [line.rstrip("\r\n") for line in f]
        else:
            with open(path, encoding="utf-8-sig") as f:
                lines = [line.rstrip("\r\n") for line in f]
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompt-file {path}: not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    except OSError as e:
        raise ValueError(f"--prompt-file {path}: cannot read it ({e.strerror or e}); give a text file with one prompt "
                         f"per line") from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise ValueError(f"--prompt-file {path}: no prompt in it (every line is blank); give one prompt per line")
    return prompts
