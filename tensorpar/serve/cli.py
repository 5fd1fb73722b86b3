"""``tensorpar serve``: start the tp ranks, load the model sharded, serve the OpenAI API from rank 0.

With ``--pp P`` the ranks are ``tp x pp`` (each holds its pipeline stage, :mod:`tensorpar.pipeline.inference`)
and every rank follows rank 0's plans; the scheduler keeps ``P`` batches of requests with one plan each in flight
(:meth:`tensorpar.serve.engine.Engine.tick`), so that every stage computes at once.

Rank 0 runs uvicorn (FastAPI) in a thread and the scheduler on its main thread; ranks 1.. follow rank 0's
broadcast plans (:func:`tensorpar.serve.engine.follow`). SIGINT/SIGTERM on any rank's launcher stops the
scheduler, which ends in-flight requests, broadcasts ``"stop"``, and every rank exits 0.
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import sys
import threading
from dataclasses import dataclass, field

from tensorpar.rank_errors import under_torchrun
from tensorpar.serve.params import check_listen, url_host
from tensorpar.serve.pool import kv_pool

DEFAULT_MAX_MODEL_LEN = 1024
DEFAULT_BLOCK_SIZE = 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (built in), a Hugging Face-format folder, or a .gguf file")
    from tensorpar.cli import add_launch_arguments, add_lora_argument
    add_launch_arguments(p, ep=True, pp=True, plan=True)
    add_lora_argument(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free port; the URL is printed)")
    p.add_argument("--max-batch", type=int, default=16, help="slots: requests decoded together")
    p.add_argument("--max-model-len", type=int, default=None,
                   help=f"prompt + generated tokens per request (KV cache length per slot; default "
                        f"min(max_position_embeddings, {DEFAULT_MAX_MODEL_LEN}))")
    p.add_argument("--max-waiting", type=int, default=256, help="requests allowed to wait for a slot (then 429)")
    p.add_argument("--kv-cache-memory", default=None, metavar="BYTES|FRACTION",
                   help="KV cache per rank: bytes (e.g. 96MiB, 2GiB, 100000000) or a fraction in (0, 1) (e.g. 0.5) of "
                        "the memory available at launch (CPU: MemAvailable / the ranks on this host; CUDA: free device "
                        "memory) for the rank's weights and its pool together, the pool getting what the weights "
                        "leave; default --max-batch x --max-model-len positions")
    p.add_argument("--block-size", type=int, default=None,
                   help=f"positions per KV cache block (default {DEFAULT_BLOCK_SIZE}; the module path keeps one "
                        f"block of --max-model-len per request)")
    p.add_argument("--prefix-caching", choices=("on", "off"), default=None,
                   help="reuse the KV blocks of cached prompt prefixes (default on where the cache is paged)")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant results: a request's greedy tokens and logprobs are bitwise those it gets "
                        "alone, whatever else runs with it (slower; docs/serve.md)")
    p.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="end a request still running this long after it arrived (default: no limit)")
    from tensorpar.decode.quantize import add_quantize_argument
    add_quantize_argument(p)
    from tensorpar.verify.prove import add_arguments as add_plan_arguments
    add_plan_arguments(p, plan_file=True)
    p.add_argument("--served-model-name", default=None, help="model id in the API (default: --model)")


@dataclass(frozen=True)
class ServeTask:
    """What every rank of ``tensorpar serve`` runs (:attr:`tensorpar.job.Job.task`), resolved once.

    Attributes:
        max_len: prompt + generated tokens per slot (``--max-model-len`` or its default).
        max_batch, max_waiting: ``--max-batch`` and ``--max-waiting``.
        host, port: where rank 0 listens.
        name: the model id in the API (``--served-model-name``, else ``--model``).
        tokenizer: the model's tokenizer (rank 0 encodes requests and decodes answers).
        quantize: ``--quantize``.
        block_size, num_blocks: the KV block pool every rank allocates (:func:`kv_pool`).
        prefix_caching: ``--prefix-caching`` resolved (off where the cache is not paged).
        timeout_s: ``--request-timeout`` (``None``: none).
        deterministic: ``--deterministic`` (batch-invariant results, :class:`~tensorpar.serve.engine.Engine`).
        plan_prediction: ``--plan auto``'s prediction (:func:`tensorpar.inference_plan.choose_layout`), printed by
            rank 0 at shutdown next to its metrics (:func:`~tensorpar.inference_plan.serve_comparison_line`).
    """

    max_len: int
    max_batch: int
    max_waiting: int
    host: str
    port: int
    name: str
    tokenizer: object = field(repr=False, default=None)
    quantize: str = "none"
    block_size: int | None = None
    num_blocks: int | None = None
    prefix_caching: bool = False
    timeout_s: float | None = None
    deterministic: bool = False
    plan_prediction: dict | None = None


def validate(args: argparse.Namespace):
    """Every check, made once before any rank starts, and the :class:`~tensorpar.job.Job` the ranks run (the config
    and tokenizer read once, the plan made once; with ``--tp-weights auto`` each rank makes it after measuring).
    Raises ValueError."""
    from transformers import AutoConfig

    from tensorpar.hub import resolve_model
    from tensorpar.job import job_from_args, load_tokenizer
    from tensorpar.parallel import ParallelConfig

    if args.tp < 1:
        raise ValueError(f"--tp must be a positive integer (ranks to start), got {args.tp}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535] (0 = any free port), got {args.port}")
    try:
        ipaddress.ip_address(args.host)
    except ValueError:
        if args.host != "localhost":
            raise ValueError(f"--host must be an IP address such as 127.0.0.1, ::1 or 0.0.0.0, or localhost; got "
                             f"{args.host!r}") from None
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ValueError("--served-model-name must not be empty (leave it out to use --model)")
    if not under_torchrun() or os.environ.get("RANK") == "0":   # only rank 0 listens: under torchrun on several
        check_listen(args.host, args.port)                      # hosts --host is an address of rank 0's host only
    if args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.max_waiting < 0:
        raise ValueError(f"--max-waiting must be >= 0, got {args.max_waiting}")
    from tensorpar.cli import check_launch_arguments, check_plan_arguments
    check_launch_arguments(args)
    check_plan_arguments(args)   # --plan auto and its inputs
    folder = resolve_model(args.model)
    config = AutoConfig.from_pretrained(folder)
    from tensorpar.job import lora_from_args
    lora = lora_from_args(args, config)    # --lora DIR against the model, before the tokenizer and the plan
    limit = getattr(config, "max_position_embeddings", None) or DEFAULT_MAX_MODEL_LEN
    n = args.max_model_len if args.max_model_len is not None else min(limit, DEFAULT_MAX_MODEL_LEN)
    if not 2 <= n <= limit:
        raise ValueError(f"--max-model-len must be in [2, {limit}] (the model's max_position_embeddings), got {n}")
    from tensorpar.hf.families import why_not
    paged_why = why_not("fast_decode", config)      # the engine's rule: the module path keeps one slot per request
    if paged_why is None and getattr(args, "ep", 1) > 1:   # the ranks' rule (decode.prepare.lean_unsupported): an
        paged_why = "expert parallelism (--ep) runs the module path"   # expert-parallel layer is no tp-experts layer
    prefix = getattr(args, "prefix_caching", None)
    bs = getattr(args, "block_size", None)
    if paged_why is not None and prefix == "on":
        raise ValueError(f"--prefix-caching on needs the paged KV cache of the lean decode path; this model has "
                         f"none ({paged_why}): leave --prefix-caching off")
    if paged_why is not None and bs is not None and bs != n:
        raise ValueError(f"--block-size {bs}: this model's KV cache keeps one slot of --max-model-len per request "
                         f"({paged_why}); leave --block-size out")
    if bs is not None and not 1 <= bs <= n:
        raise ValueError(f"--block-size must be in [1, --max-model-len {n}], got {bs}")
    bs = n if paged_why is not None else (bs or min(DEFAULT_BLOCK_SIZE, n))
    prediction = None
    from tensorpar.launch import check_gpu_count
    if getattr(args, "plan", None) == "auto":   # --tp and --pp from the planner, for a full server
        from tensorpar.inference_plan import choose_layout, plan_ranks, serve_workload
        if not under_torchrun():        # the GPU rule for the ranks it plans for, before each candidate's KV pool
            check_gpu_count(plan_ranks(args)[1])
        shape, words = serve_workload(args.max_batch, n)
        prediction = choose_layout(args, config, str(args.model), *shape, workload=words,
                                   smaller="a lower --max-batch or --max-model-len",
                                   extra=lambda tp, pp: kv_pool(config, tp, args.dtype, n, args.max_batch,  # its rule
                                                                block_size=bs, memory=args.kv_cache_memory, pp=pp))
    from tensorpar.cli import check_model_degrees
    check_model_degrees(args, config)   # --ep, --pp: the rules the ranks apply
    if not under_torchrun():            # run_ranks' rule, before the KV pool asks a GPU for its free memory
        check_gpu_count(args.tp * getattr(args, "pp", 1) * getattr(args, "ep", 1))
    import torch

    from tensorpar.hf.load import follow_stored_ties, resolve_attn_implementation
    follow_stored_ties(folder, config, getattr(torch, args.dtype))  # before the plan (a stored, untied head)
    from tensorpar.capacity import plan_for_model
    from tensorpar.verify.prove import resolve_flags
    resolve_flags(args, config)   # --discover-plan: the proven plan becomes the --plan-file the ranks read
    user_plan = os.path.abspath(args.plan_file) if args.plan_file is not None else None
    tp_weights, plan = plan_for_model(getattr(args, "tp_weights", None), args.tp, config, user_plan=user_plan,
                                      tp_name="--tp")
    from tensorpar.decode.quantize import check_quantize
    quantize = getattr(args, "quantize", "none")
    check_quantize(quantize, config, plan, getattr(args, "dtype", "float32"))
    deterministic = bool(getattr(args, "deterministic", False))
    if deterministic:
        from tensorpar.decode.lean import deterministic_unsupported
        why = deterministic_unsupported(config, lean_why=paged_why, pp=getattr(args, "pp", 1),
                                        tp_comm=getattr(args, "tp_comm", "fp32"))
        if why is not None:
            raise ValueError(f"--deterministic: {why}")
    timeout = getattr(args, "request_timeout", None)
    if timeout is not None and not (timeout > 0 and timeout < float("inf")):
        raise ValueError(f"--request-timeout must be a positive number of seconds, got {timeout:g}")
    num_blocks, _ = kv_pool(config, args.tp, args.dtype, n, args.max_batch, block_size=bs,
                            memory=getattr(args, "kv_cache_memory", None),
                            weights=None if tp_weights in (None, "auto") else tp_weights,
                            pp=getattr(args, "pp", 1), ep=getattr(args, "ep", 1))
    tok = load_tokenizer(folder, config, args.model)  # the config read above, not again
    task = ServeTask(n, args.max_batch, args.max_waiting, args.host, args.port, args.served_model_name or args.model,
                     tok, quantize, bs, num_blocks, paged_why is None and prefix != "off", timeout, deterministic,
                     prediction)
    parallel = ParallelConfig(tp=args.tp, pp=args.pp, dp=getattr(args, "ep", 1), tp_weights=tp_weights)
    return job_from_args(args, parallel, folder=str(folder), user_plan=user_plan, lora=lora,
                         model_config=config, plan=None if tp_weights == "auto" else plan,
                         attn_implementation=resolve_attn_implementation(config), task=task)


def _rank_main(job) -> int:
    """One rank of ``tensorpar serve``: load this rank's shard with the job's config and plan; rank 0 serves HTTP and
    schedules, the others follow its step plans."""
    from tensorpar.job import load_model, start
    from tensorpar.serve.engine import Engine, follow

    task: ServeTask = job.task
    ctx = start(job)
    holder: dict = {"sched": None, "stop": False}

    def on_signal(signum, frame):      # rank 0 stops the scheduler; the other ranks wait for its "stop"
        holder["stop"] = True
        if holder["sched"] is not None:
            holder["sched"].stop()

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, on_signal)
    try:
        model, _ = load_model(job, ctx)
        from tensorpar.decode.quantize import apply_quantize
        apply_quantize(model, ctx.tp, task.quantize)
        # --ep (ep replicas of the tp ranks) or --pp (stages): every rank follows rank 0's plans, broadcast over the
        # world group, whose failures name the hosts when the ranks are on several
        plans = ctx.world if ctx.world_size > ctx.tp.size else None
        engine = Engine(model, ctx.tp, max_batch=task.max_batch, max_len=task.max_len, plans=plans,
                        pp=ctx.pp,   # with --pp: this rank's stage; every rank follows rank 0's plans
                        block_size=task.block_size, num_blocks=task.num_blocks, deterministic=task.deterministic)
        ctx.heap.for_steady()   # weights loaded and fused: a step's temporaries may come from the heap
        from tensorpar import fingerprint
        if job.check_collectives or fingerprint.enable_from_env(ctx.tp) is not None:
            check_collectives(engine, ctx.tp, timeout_s=min(job.timeout_s / 2, 60.0))
        if ctx.rank != 0:
            follow(engine)
            rc = 0
        else:
            rc = _serve(engine, task, holder)
    finally:
        ctx.destroy()
    if holder["stop"] and "TORCHELASTIC_RUN_ID" in os.environ:
        # The launcher's agent is shutting down on the same signal and waits for this process to exit, while
        # torch's worker wrapper would wait for the agent after we return: exit here, the stop being complete.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


def check_collectives(engine, tp, *, every: int = 50, timeout_s: float = 60.0) -> None:
    """Fingerprint ``engine``'s collectives on every rank (:mod:`tensorpar.fingerprint`): after each engine step
    the tp ranks compare their collective hashes and the step plan they ran (at the first step and every
    ``every``); a difference raises :class:`~tensorpar.fingerprint.CollectiveMismatch` naming it and the ranks.
    Every rank must call it."""
    from tensorpar import fingerprint

    fingerprint.enable(tp, every, timeout_s=timeout_s, model=engine.model)
    inner, inner_exchange = engine.step, engine.exchange

    def exchange(plan):  # the ranks other than 0 wait here, idle, until the next request: no per-collective wait
        with fingerprint.unsynced(tp):
            return inner_exchange(plan)
    engine.exchange = exchange

    def step(plan, samplers, inner=inner):
        out = inner(plan, samplers)
        fingerprint.check(tp, {"step plan": repr(plan)})
        return out

    engine.step = step
    if engine.pp.size > 1:      # serve's pipelined ticks (Engine.tick), each checked the same way
        engine.tick = lambda plan, samplers, inner=engine.tick: step(plan, samplers, inner)


def _serve(engine, task: ServeTask, holder: dict) -> int:
    import time

    import uvicorn

    from tensorpar.serve.api import Api, build_app
    from tensorpar.serve.metrics import ServeMetrics
    from tensorpar.serve.scheduler import Scheduler

    tok, max_len = task.tokenizer, task.max_len
    eos = tok.eos_token_id
    metrics = ServeMetrics()
    sched = Scheduler(engine, eos={eos} if eos is not None else set(), metrics=metrics, max_waiting=task.max_waiting,
                      prefix_caching=task.prefix_caching, timeout_s=task.timeout_s)
    holder["sched"] = sched
    if holder["stop"]:
        sched.stop()
    name = task.name
    api = Api(sched, tok, name, max_len, metrics)
    server = uvicorn.Server(uvicorn.Config(build_app(api), host=task.host, port=task.port, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, name="tensorpar-http", daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.02)
    if not thread.is_alive():
        sched.stop()
        sched.run()                        # tells the other ranks to stop
        from tensorpar.usage import refuse
        return refuse("serve", f"--host {task.host} --port {task.port}: cannot listen there (taken since the check "
                               f"before launch?); pick another --port, or --port 0 for any free one")
    port = server.servers[0].sockets[0].getsockname()[1]
    kv = engine.cache.nbytes() / 2**20
    at = f"tp={engine.tp.size}" + (f", pp={engine.pp.size}" if engine.pp.size > 1 else "")
    positions = engine.num_blocks * engine.block_size
    print(f"tensorpar serve: {name} at {at}, up to {engine.max_batch} running requests of up to {max_len} tokens; "
          f"KV cache {kv:.0f} MiB on rank 0: {engine.num_blocks} blocks of {engine.block_size} = {positions} "
          f"positions ({positions // max_len} requests at the full {max_len}), prefix caching "
          f"{'on' if task.prefix_caching else 'off'}{', deterministic' if task.deterministic else ''}; "
          f"ready at http://{url_host(task.host)}:{port}/v1", flush=True)
    try:
        sched.run()
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    if task.plan_prediction is not None:   # --plan auto: predicted vs what the metrics counted
        from tensorpar.inference_plan import serve_comparison_line
        print(serve_comparison_line(task.plan_prediction, metrics.registry), flush=True)
    print("tensorpar serve: stopped", flush=True)
    return 0


def main(args: argparse.Namespace) -> int:
    from tensorpar.cli import torchrun_tp
    from tensorpar.launch import run_ranks
    from tensorpar.usage import refuse, release_notes

    try:
        torchrun_tp(args)   # under torchrun: tp x ep is its world size
        job = validate(args)
    except (ValueError, FileNotFoundError, OSError) as e:
        return refuse("serve", e)
    release_notes(args)   # the notes of accepted input, now that every check passed
    rc = run_ranks(_rank_main, job.world_size, job, verbose=job.verbose)
    return 0 if rc == 130 else rc       # SIGINT/SIGTERM is how a server is stopped: every rank exited
