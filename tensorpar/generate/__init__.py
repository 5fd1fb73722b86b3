"""``tensorpar generate``: text generation with a Hugging Face decoder sharded over tp ranks.

:func:`generate_tokens` is a client of the decode engine the server runs (:class:`tensorpar.serve.engine.Engine`:
one decode loop, one per-slot KV cache, the lean decode path for every family whose record allows it, the model's
modules otherwise, sliding windows included). Each prompt gets a slot; the first step prefills every prompt's
unpadded tokens, each later step decodes one token per unfinished prompt. Every rank builds the same step from
the same tokens, so no plan travels between ranks.

Each rank holds its query heads, the KV heads they read (the KV cache holds only those), its slice of every MLP
and of the vocabulary. Per new token a rank runs two all-reduces per block (attention and MLP outputs), one for
the embedding, then picks the token (:func:`tensorpar.serve.tokens.choose_tokens`):

* greedy: a vocab-parallel argmax (each rank's best logit and its global index, all-gathered: ``2 * b`` floats
  instead of the ``b * V`` logits), ties broken to the lowest index like ``torch.argmax``;
* sampling: the unfinished rows' logits are all-gathered, rank 0 samples them in row order with one generator
  seeded by ``sampling.seed``, and broadcasts the tokens.

A row stops at an EOS token; the call stops when every row has or at the token budget (every rank sees the same
tokens, so every rank stops at the same step). The command marks its model :func:`inference_only`."""
from __future__ import annotations

import argparse
import contextlib
import time
from dataclasses import dataclass, field

import torch

from tensorpar import comm
from tensorpar.comm import Group
from tensorpar.generate.engine_cache import _engine, cached_engine, inference_only, release_engine, settle  # noqa: F401
from tensorpar.decode.quantize import apply_quantize, check_quantize
from tensorpar.generate.flags import add_arguments, check_flags  # noqa: F401  (the command's flags)
from tensorpar.streaming import chat_prompt_ids
from tensorpar.serve.tokens import SamplingConfig


@dataclass
class GenerationResult:
    """Tokens and timings of one :func:`generate_tokens` call.

    Attributes:
        tokens: ``[b, n]`` new token ids (rows that stopped early are padded with ``pad_id``).
        ttft_s: seconds from the start of prefill (once every rank has its engine: one all-reduce lines them up
            first) to the first token being known on every rank.
        decode_s: seconds spent on the remaining ``n - 1`` steps.
        ttft_cpu_s: this process's CPU time (all its threads) over the same span as ``ttft_s``: the compute the
            first token took, whatever else ran on the cores (with one thread per rank and no collective waits,
            ``ttft_s`` on an idle machine).
        speed_warning: with ``check_speed``, a one-line warning when tensor parallelism is likely slower
            than one rank on this communication path (:func:`tensorpar.speed.tp_speed_warning`), else ``None``.
    """

    tokens: torch.Tensor
    ttft_s: float
    decode_s: float
    speed_warning: str | None = None
    ttft_cpu_s: float = 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        n = self.tokens.shape[1] - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else float("nan")


@torch.no_grad()
def generate_tokens(model, tp: Group, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                    sampling: SamplingConfig = SamplingConfig(), eos_token_id: int | list[int] | None = None,
                    pad_id: int = 0, on_token=None, check_speed: bool = False,
                    path: str = "auto", pp: Group | None = None, deterministic: bool = False,
                    heap=None) -> GenerationResult:
    """Generate from a model sharded by :func:`tensorpar.hf.apply.parallelize`.

    Args:
        model: the sharded ``*ForCausalLM`` (its logits are vocab-sharded ``[b, s, V_r]``).
        tp: its tensor-parallel group.
        input_ids: ``[b, s]`` prompt ids, padded (usually on the left); identical on every rank.
        attention_mask: ``[b, s]`` 1 for tokens, 0 for padding (default all ones); each row's tokens are
            prefilled unpadded into its own slot of the engine's cache.
        sampling: greedy or sampling settings. Sampling draws, on rank 0, the unfinished rows in row order
            from one generator seeded with ``sampling.seed`` (a seed gives the same tokens at every tp; a row
            that ended no longer draws).
        eos_token_id: id(s) that end a row.
        on_token: optional callback ``f(step, tokens[b])`` called on every rank after each step.
        check_speed: after the first decode step (whose collectives are counted), measure the collective
            latency and memory bandwidth and set :attr:`GenerationResult.speed_warning` if tp is likely slower
            than one rank (:func:`tensorpar.speed.tp_speed_warning`); a few milliseconds, excluded from the timings.
        path: the engine's path (:class:`tensorpar.serve.engine.Engine`): ``"auto"`` runs the lean decode path
            (:class:`tensorpar.decode.lean.LeanDecoder`: fused projections, static KV cache) when the family record
            allows it and the Hugging Face module path otherwise; ``"lean"`` requires it (ValueError naming why
            not); ``"hf"`` forces the module path.
        pp: the pipeline group when ``model`` is one stage (:mod:`tensorpar.pipeline.inference`).
        deterministic: batch-invariant results (``--deterministic``): each row's greedy tokens are bitwise those of
            its prompt generated alone (:class:`~tensorpar.serve.engine.Engine`'s ``deterministic``).
        heap: the process's :class:`~tensorpar.malloc.HeapState` (``ctx.heap``): raised for the steady state once
            the engine is built (:meth:`~tensorpar.malloc.HeapState.for_steady`; ``None``: left as it is).

    A model built with sequence parallelism generates as plain tensor parallelism (the prompt and the
    one-token decode steps are not split along the sequence; :func:`tensorpar.hf.apply.sequence_parallel_off`).

    The engine (fused weights, KV cache, row step) is kept on ``model`` and reused by a later call that fits it, on
    unchanged weights (:mod:`tensorpar.generate.engine_cache`; :func:`release_engine` frees it and its KV cache).

    Returns:
        :class:`GenerationResult`.

    Raises:
        ValueError: the prompt plus the token budget exceeds ``max_position_embeddings``; a row with no tokens;
            ``path`` is not one of auto/lean/hf, or ``"lean"`` for a model the lean path does not run.
    """
    from tensorpar.hf.apply import sequence_parallel_off

    with sequence_parallel_off(model):
        return _generate(model, tp, input_ids, attention_mask, sampling, eos_token_id, pad_id, on_token, check_speed,
                         path, pp, deterministic, heap)


def _generate(model, tp, input_ids, attention_mask, sampling, eos_token_id, pad_id, on_token, check_speed, path, pp,
              deterministic=False, heap=None):
    from tensorpar.serve.plan import Row, StepPlan
    from tensorpar.speed import measure_speed
    from tensorpar.serve.tokens import sampler

    cfg = model.config
    b, s = input_ids.shape
    limit = getattr(cfg, "max_position_embeddings", None)
    if limit is not None and s + sampling.max_new_tokens > limit:
        raise ValueError(f"prompt of {s} tokens plus max_new_tokens={sampling.max_new_tokens} exceeds the model's "
                         f"max_position_embeddings={limit}; shorten the prompt or lower --max-new-tokens")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    keep = attention_mask.bool().cpu()
    prompts = [input_ids[i].cpu()[keep[i]].tolist() for i in range(b)]           # each row's tokens, unpadded
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt row {i} has no tokens (its attention_mask is all 0)")
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
    engine = _engine(model, tp, max_batch=b, max_len=s + sampling.max_new_tokens, path=path, pp=pp,
                     deterministic=deterministic)
    try:
        if heap is not None:    # weights loaded and fused: a step's temporaries may come from the heap
            heap.for_steady()
        greedy = sampling.temperature == 0
        samplers = None
        if not greedy and tp.rank == 0:     # one generator (the logits' device), drawing the rows in order each step
            draw = sampler(sampling, torch.Generator(device=engine.device).manual_seed(sampling.seed))
            samplers = [draw] * b
        rows = [Row(i, p, 0, sampled=not greedy) for i, p in enumerate(prompts)]     # step 0: prefill every prompt
        done = [False] * b                  # per row: ended (EOS); plain lists, no tensor ops per step
        out = []
        if engine.plans.size > 1:   # the clock starts when every rank is ready: a slower rank's load is not prefill
            comm.all_reduce(torch.zeros(1, device=engine.device), engine.plans)
        t0, c0 = time.perf_counter(), time.process_time()
        ttft = ttft_cpu = 0.0
        warning, paused = None, 0.0
        for step in range(sampling.max_new_tokens):
            counting = check_speed and step == 1 and tp.size > 1 and engine.pp.size == 1   # tp against one rank
            with comm.counting(tp, reset=False) if counting else contextlib.nullcontext() as counter:
                before = sum(counter.calls.values()) if counting else 0
                got = engine.step(StepPlan("step", rows),
                                  samplers=[samplers[r.slot] for r in rows] if samplers else None)
            nxt = [pad_id] * b
            for r, t in zip(rows, got.tokens):
                nxt[r.slot] = t
                done[r.slot] = done[r.slot] or t in eos
            out.append(nxt)
            if step == 0:
                ttft, ttft_cpu = time.perf_counter() - t0, time.process_time() - c0
            if counting:
                t_pause = time.perf_counter()
                per_token = sum(counter.calls.values()) - before
                warning = measure_speed(model, tp, torch.zeros(b, cfg.hidden_size, device=engine.device), per_token)
                paused += time.perf_counter() - t_pause
            if on_token is not None:
                on_token(step, torch.tensor(nxt, dtype=torch.long))
            if all(done):
                break
            # the next step: one decode row per unfinished prompt, its token at the position after its last
            rows = [Row(r.slot, [nxt[r.slot]], r.start + len(r.tokens), sampled=not greedy)
                    for r in rows if not done[r.slot]]
        total = time.perf_counter() - t0 - paused       # not the unpacking below (1.6 s on the 1.1B in bf16)
    finally:
        settle(model)     # weights packed for this call (more rows than the GEMV's): plain again, engine dropped
    return GenerationResult(torch.tensor(out, dtype=torch.long).T.contiguous(), ttft, total - ttft, warning,
                            ttft_cpu)


# ---------------------------------------------------------------- command line

#: prompt tokens (batch x length) from which the command line says that it is prefilling
LONG_PREFILL_TOKENS = 512


def _encode(tok, prompts: list[str], chat: bool):
    """``[b, s]`` left-padded ids and attention mask of ``prompts`` (with ``chat``: :func:`chat_prompt_ids`
    of one user message each)."""
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if tok.pad_token is None:  # neither (a byte-level export): pad with id 0, masked; set on this object only, it
        tok.pad_token_id = 0   # does not make byte 0's symbol a special token that the input's text would match
    if chat:
        rows = [chat_prompt_ids(tok, [{"role": "user", "content": p}]) for p in prompts]
        enc = tok.pad({"input_ids": rows}, padding=True, return_tensors="pt")
    else:
        enc = tok(prompts, return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


def _tokenize(args, folder, config):
    """``(tokenizer, prompts, ids, mask)`` of the command's prompts (:func:`_encode`), checked: ``--chat`` needs a chat
    template, the prompt plus ``--max-new-tokens`` must fit the model's positions."""
    from tensorpar.job import load_tokenizer

    tok = load_tokenizer(folder, config, args.model)  # the config read already, not again
    if args.chat and not getattr(tok, "chat_template", None):
        raise ValueError(f"--chat: {args.model} has no chat template (its tokenizer_config.json names none); drop "
                         f"--chat to generate from the plain prompt")
    prompts = tuple(args.prompt or ["The capital of France is"])
    ids, mask = _encode(tok, list(prompts), args.chat)
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and ids.shape[1] + args.max_new_tokens > limit:
        raise ValueError(f"prompt of {ids.shape[1]} tokens plus --max-new-tokens {args.max_new_tokens} exceeds the "
                         f"model's max_position_embeddings={limit}")
    return tok, prompts, ids, mask


@dataclass(frozen=True)
class GenerateTask:
    """What every rank of ``tensorpar generate`` runs (:attr:`tensorpar.job.Job.task`), resolved once.

    Attributes:
        prompts: the prompt texts (printed by rank 0).
        input_ids, attention_mask: ``[b, s]`` left-padded prompt ids and mask (:func:`_encode`), the same on every rank.
        sampling: greedy or sampling settings.
        eos: every id that ends a row (:func:`tensorpar.streaming.eos_token_ids`).
        pad_id: the id that pads rows that ended early.
        tokenizer: the model's tokenizer (rank 0 prints its decoded text).
        chat: the prompts were wrapped in the chat template.
        quantize: ``--quantize``.
        deterministic: ``--deterministic`` (batch-invariant results).
        plan_prediction: with ``--plan auto``, the planner's prediction (:func:`tensorpar.inference_plan.
            choose_layout`), printed by rank 0 next to the measured decode at the end; else ``None``.
    """

    prompts: tuple[str, ...]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    sampling: SamplingConfig
    eos: tuple[int, ...]
    pad_id: int
    tokenizer: object = field(repr=False, default=None)
    chat: bool = False
    quantize: str = "none"
    deterministic: bool = False
    plan_prediction: dict | None = None


def _rank_main(job) -> int:
    """One rank of ``tensorpar generate``: load this rank's shard with the job's config and plan, generate, and print
    on rank 0."""
    import sys

    from tensorpar import fingerprint
    from tensorpar.job import load_model, print0, start
    from tensorpar.streaming import TokenPrinter, chat_header, stats_line

    task: GenerateTask = job.task
    ctx = start(job)
    try:
        model, _ = load_model(job, ctx)
        apply_quantize(model, ctx.tp, task.quantize)
        inference_only(model)       # this process only generates: the engine may keep faster weight layouts
        ids, mask, tok = task.input_ids, task.attention_mask, task.tokenizer
        single = len(task.prompts) == 1
        printer = TokenPrinter(tok) if single and ctx.rank == 0 else None
        on_token = printer
        tp_fingerprint = None
        if job.check_collectives or fingerprint.enable_from_env(ctx.tp) is not None:
            tp_fingerprint = fingerprint.enable(ctx.tp, timeout_s=min(job.timeout_s / 2, 60.0), model=model)  # sites
            fingerprint.check(ctx.tp, {"prompt": ids, "attention_mask": mask, "seed": task.sampling.seed,
                                       "temperature": task.sampling.temperature})

            def on_token(step, nxt, _print=printer):  # every decode step; compares at step 0 and every 50
                fingerprint.check(ctx.tp)
                if _print is not None:
                    _print(step, nxt)
        if ids.numel() >= LONG_PREFILL_TOKENS:  # a long prefill takes seconds on a CPU: say what is happening
            print0(ctx, f"tensorpar: prefilling {ids.shape[0]} x {ids.shape[1]} prompt tokens on tp={ctx.tp.size} "
                        f"ranks...", file=sys.stderr)
        if single:
            print0(ctx, chat_header(task.prompts[0]) if task.chat else task.prompts[0], end="")
        res = generate_tokens(model, ctx.tp, ids.to(ctx.device), mask.to(ctx.device), sampling=task.sampling,
                              eos_token_id=list(task.eos), pad_id=task.pad_id, on_token=on_token,
                              # fingerprints (compared before every collective) would be counted as link latency
                              check_speed=tp_fingerprint is None, pp=ctx.pp, deterministic=task.deterministic,
                              heap=ctx.heap)
        if printer is not None:
            printer.close()  # the characters still held back (a multi-byte character split over tokens)
        if single:
            print0(ctx)
        elif ctx.rank == 0:
            for p, row in zip(task.prompts, res.tokens):
                answer = tok.decode(row, skip_special_tokens=True)
                print0(ctx, f"{chat_header(p)}{answer}\n" if task.chat else f"{p}{answer}")
        if res.speed_warning:
            print0(ctx, res.speed_warning, file=sys.stderr)
        b, n = res.tokens.shape
        print0(ctx, stats_line(ctx.tp.size, res.ttft_s, res.decode_s, n, ctx.pp.size, b))
        if task.plan_prediction is not None:   # --plan auto: predicted vs measured
            from tensorpar.inference_plan import comparison_line
            print0(ctx, comparison_line(task.plan_prediction, res.ttft_s, res.decode_s, n, res.ttft_cpu_s))
    finally:
        ctx.destroy()
    return 0


def validate(args: argparse.Namespace):
    """Every check, made once before any rank starts (flags, model path, architecture, plan and plan file, prompt
    length), and the :class:`~tensorpar.job.Job` the ranks run: the config read once, the plan made once (not with
    ``--tp-weights auto``: each rank makes it after measuring), the prompts tokenized once."""
    import os

    from transformers import AutoConfig

    from tensorpar.capacity import plan_for_model
    from tensorpar.hf.families import is_causal_lm
    from tensorpar.hf.load import check_checkpoint, follow_stored_ties, resolve_attn_implementation
    from tensorpar.job import job_from_args
    from tensorpar.parallel import ParallelConfig
    from tensorpar.streaming import eos_token_ids
    from tensorpar.train.config import check_model_config, config_error

    check_flags(args)
    from tensorpar.hub import resolve_model

    folder = resolve_model(args.model)
    try:
        config = AutoConfig.from_pretrained(folder)
    except (FileNotFoundError, OSError):
        raise
    except Exception as e:  # transformers rejects the config (its own error types): one line, named
        raise config_error(f"{folder}/config.json", e) from e
    if not is_causal_lm(getattr(config, "model_type", None)):
        raise ValueError(f"{folder}: model_type={config.model_type!r} is an image classifier, not a text generator; "
                         f"run it with examples/classify_vit.py")
    check_model_config(config, f"{folder}/config.json")
    from tensorpar.job import lora_from_args
    lora = lora_from_args(args, config)    # --lora DIR against the model, before the tokenizer and the plan
    prediction, encoded = None, None
    if getattr(args, "plan", None) == "auto":   # --tp and --pp from the planner, for these prompts
        from tensorpar.inference_plan import choose_layout
        encoded = _tokenize(args, folder, config)
        prediction = choose_layout(args, config, str(args.model), *encoded[2].shape)
    from tensorpar.cli import check_model_degrees
    check_model_degrees(args, config)   # --ep, --pp: the rules the ranks apply
    follow_stored_ties(folder, config, getattr(torch, getattr(args, "dtype", "float32")))  # as the ranks will
    from tensorpar.verify.prove import resolve_flags
    resolve_flags(args, config)   # --discover-plan: the proven plan becomes the --plan-file the ranks read
    user_plan = os.path.abspath(args.plan_file) if getattr(args, "plan_file", None) is not None else None
    tp_weights, plan = plan_for_model(getattr(args, "tp_weights", None), args.tp, config, user_plan=user_plan,
                                      tp_name="--tp")
    attn = resolve_attn_implementation(config)  # decided here; every rank runs this one
    quantize = getattr(args, "quantize", "none")
    check_quantize(quantize, config, plan, getattr(args, "dtype", "float32"))
    check_checkpoint(folder, config)  # headers vs config, both directions, before any rank starts
    deterministic = bool(getattr(args, "deterministic", False))
    if deterministic:                 # the rule the engine applies on the ranks
        from tensorpar.decode.lean import deterministic_unsupported
        from tensorpar.hf.families import why_not
        why = deterministic_unsupported(config, lean_why=why_not("fast_decode", config), pp=getattr(args, "pp", 1),
                                        tp_comm=getattr(args, "tp_comm", "fp32"))
        if why is not None:
            raise ValueError(f"--deterministic: {why}")
    tok, prompts, ids, mask = encoded or _tokenize(args, folder, config)
    sampling = SamplingConfig(args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                              0 if args.seed is None else args.seed)
    task = GenerateTask(prompts, ids, mask, sampling, tuple(eos_token_ids(folder, tok)), tok.pad_token_id, tok,
                        chat=args.chat, quantize=quantize, deterministic=deterministic, plan_prediction=prediction)
    parallel = ParallelConfig(tp=args.tp, pp=args.pp, dp=getattr(args, "ep", 1), tp_weights=tp_weights)
    return job_from_args(args, parallel, folder=str(folder), model_config=config, user_plan=user_plan, lora=lora,
                         plan=None if tp_weights == "auto" else plan, attn_implementation=attn, task=task)


def main(args: argparse.Namespace) -> int:
    from tensorpar.cli import torchrun_tp
    from tensorpar.launch import rank0_print, run_ranks
    from tensorpar.usage import refuse, release_notes

    try:
        torchrun_tp(args)   # under torchrun: tp x ep is its world size
        job = validate(args)
    except (ValueError, FileNotFoundError, OSError) as e:
        return refuse("generate", e)
    release_notes(args)   # the notes of accepted input, now that every check passed
    if args.print_plan:  # with --tp-weights auto the even split (the ranks' split is measured when they start)
        from tensorpar.hf.plan import make_plan
        rank0_print(job.plan or make_plan(job.model_config, job.parallel.tp, user_plan=job.user_plan))
        return 0
    return run_ranks(_rank_main, job.world_size, job, verbose=job.verbose)
