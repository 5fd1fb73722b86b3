"""``tensorpar generate --plan auto`` and ``tensorpar serve --plan auto``: the layout (tp, pp) from the inference
planner, and its prediction next to the measured decode at the end.

The launching process (every rank's, under torchrun: they read the same cached calibration and choose the same):

* the ranks and hosts (:func:`plan_ranks`): torchrun's ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` (its nodes are the
  hosts), else ``--nproc`` on this host, else an explicit ``--tp`` x ``--pp``;
* one rank's device (:func:`inference_device`): ``--device-file``, or this machine's calibration as ``train --plan
  auto`` measures and caches it (:func:`tensorpar.train.autoplan.rank_device`; the tp group on tensorpar's
  shared-memory collectives unless ``--fast-collectives off``), with the link between hosts of ``--inter-node-bw``
  / ``--inter-node-latency-us`` (:func:`tensorpar.planner.cluster.inter_node_link`, the rule of ``tensorpar plan``
  and ``train --plan``);
* the workload (generate: batch = prompts, prompt = the padded prompt length, ``--max-new-tokens``; serve
  (:func:`serve_workload`): ``--max-batch`` rows of ``--max-model-len`` positions; with ``--dtype`` and
  ``--tp-comm``) goes to :func:`tensorpar.planner.inference.plan_inference` over the layouts of one replica of every
  rank (``tp x pp`` = ranks); the fastest that fits and that the command runs (:func:`runtime_problem`: the stage
  cut, the sharding plan's split, ``--deterministic``; the rules ``generate`` and ``serve`` share) is taken
  (:func:`choose`), and one line says which and why (:func:`explain_line`).

Rank 0 prints predicted against measured at the end: generate's decode ms/token and time to first token
(:func:`comparison_line`), serve's decode step against the mean time between a request's tokens that its metrics
counted (:func:`serve_comparison_line`).
"""
from __future__ import annotations

import copy
import sys


def plan_ranks(args) -> tuple[int, int]:
    """``(ranks, ranks per host)`` to plan for (module docstring). Raises ValueError when nothing gives them."""
    from tensorpar.train.autoplan import env_nproc

    world, local = env_nproc()
    if world is not None:
        return world, local if local and world % local == 0 else world
    if getattr(args, "nproc", None) is not None:
        return args.nproc, args.nproc
    explicit = set(getattr(args, "explicit_flags", None) or ())
    if explicit & {"tp", "pp"}:
        return args.tp * args.pp, args.tp * args.pp
    raise ValueError("--plan auto needs the number of ranks to plan for: add --nproc N (or launch with torchrun)")


def inference_device(args, nproc: int, local: int):
    """``(DeviceSpec of one rank, where it came from)``: ``--device-file``, or this machine's cached calibration
    (:func:`tensorpar.train.autoplan.cached_calibration`, measured on first use), with the link between hosts of the
    flags (:func:`tensorpar.planner.cluster.inter_node_link`; one note when every rank is on this host,
    :func:`~tensorpar.planner.cluster.note_unused_link`). Raises ValueError (a bad file, a bad link flag)."""
    from dataclasses import replace

    from tensorpar.planner import cluster as cl

    if getattr(args, "device_file", None):
        device, note = cl.device_from_file(args.device_file), f"device file {args.device_file}"
    else:
        from tensorpar.launch import rank0_print
        from tensorpar.train import autoplan

        try:
            cal, path, cached = autoplan.cached_calibration(log=lambda m: rank0_print(f"tensorpar: {m}",
                                                                                      file=sys.stderr))
        except RuntimeError as e:   # a calibration worker failed
            raise ValueError(f"--plan auto: {e}") from None
        measured = cal["collective"].get("by_backend") or {}
        tp_backend = "shm" if getattr(args, "fast_collectives", "auto") != "off" and "shm" in measured else None
        device = rank_threads(autoplan.rank_device(cal, nproc, local, load_now=autoplan._loadavg(),
                                                   tp_backend=tp_backend))
        note = autoplan.describe_device_source(path, cached)
    from tensorpar.launch import under_torchrun

    link = cl.inter_node_link(args, device, crosses_hosts=cl.spans_hosts(nproc, local))
    cl.note_unused_link(args, nproc, local, cl.launch_hosts_words(not under_torchrun()))
    return replace(device, **link), note


def rank_threads(device):
    """``device`` (a calibrated CPU rank of ``threads_per_rank`` threads) with the threads its rank will run:
    ``TENSORPAR_THREADS`` where set (:func:`tensorpar.parallel.set_rank_threads`' rule), its matmul peak and copy
    rate scaled to them (they are one thread's times the threads); unchanged otherwise, and for a GPU."""
    import os
    from dataclasses import replace

    env = os.environ.get("TENSORPAR_THREADS")
    if not env or device.host_cores <= 0 or int(env) == device.threads_per_rank:
        return device
    k = int(env) / device.threads_per_rank
    return replace(device, threads_per_rank=int(env), peak_tflops=device.peak_tflops * k,
                   hbm_gbps=device.hbm_gbps * k)


def runtime_problem(args, config, tp: int, pp: int, extra=None) -> str | None:
    """Why ``generate`` or ``serve`` cannot run ``tp`` x ``pp`` for this model and these flags (None when it can):
    the launching process's own checks (:func:`tensorpar.cli.check_model_degrees`: the stage cut and the ``--pp``
    rules; the sharding plan's split, :func:`tensorpar.hf.plan.make_plan`; ``--deterministic``; ``extra(tp, pp)``:
    the command's own, raising ValueError, e.g. serve's KV pool), as one line."""
    from tensorpar.cli import check_model_degrees
    from tensorpar.hf.plan import make_plan

    trial = copy.copy(args)
    trial.tp, trial.pp = tp, pp
    try:
        check_model_degrees(trial, config)
        make_plan(config, tp)
        if getattr(args, "deterministic", False):
            from tensorpar.decode.lean import deterministic_unsupported
            from tensorpar.hf.families import why_not

            why = deterministic_unsupported(config, lean_why=why_not("fast_decode", config), pp=pp,
                                            tp_comm=getattr(args, "tp_comm", "fp32"))
            if why is not None:
                raise ValueError(f"--deterministic: {why}")
        if extra is not None:
            extra(tp, pp)
    except ValueError as e:
        return " ".join(str(e).split())
    return None


def no_layout_error(model, cluster, what: str) -> ValueError:
    """The one-line error of a rank count with no one-replica ``tp x pp`` layout that splits the model, listing
    the counts (as one host, up to twice this one) that have one."""
    from dataclasses import replace

    from tensorpar.planner.inference import candidate_layouts
    n = cluster.num_devices
    counts = [k for k in range(1, 2 * n + 1)
              if candidate_layouts(model, replace(cluster, num_devices=k, devices_per_node=k), one_replica=True)]
    return ValueError(f"--plan auto: no tp x pp layout of {n} ranks splits {what} ({model.num_heads} heads, "
                      f"{model.num_layers} layers); rank counts with one: {', '.join(map(str, counts)) or 'none'}")


def choose(model, cluster, work, runnable=None, what: str = "--model",
           smaller: str = "fewer prompts or fewer --max-new-tokens"):
    """``(the plan to run, every plan ranked)``: the first of :func:`~tensorpar.planner.inference.plan_inference`'s
    one-replica layouts (``tp x pp`` = the cluster's devices) that fits and that ``runnable(tp, pp)`` (None: any)
    does not refuse. Raises ValueError with one line: no layout of that many ranks (with the rank counts that have
    one), none that fits (the smallest's memory; ``smaller``: the flags that shrink the workload), or none that the
    command runs (the first reason)."""
    from tensorpar.planner.inference import plan_inference
    from tensorpar.planner.memory import GIB

    n = cluster.num_devices
    plans = plan_inference(model, cluster, work, one_replica=True)
    if not plans:
        raise no_layout_error(model, cluster, what)
    reasons = []
    for plan in plans:
        if not plan.fits:
            break
        why = runnable(plan.tp, plan.pp) if runnable is not None else None
        if why is None:
            return plan, plans
        reasons.append(f"{plan.name}: {why}")
    if reasons:
        raise ValueError(f"--plan auto: no layout of {n} ranks that fits is runnable (first: {reasons[0]})")
    small = min(plans, key=lambda q: q.memory)
    raise ValueError(f"--plan auto: no layout of {n} ranks fits; the smallest, {small.name}, needs "
                     f"{small.memory / GIB:.2f} GiB > {small.usable / GIB:.2f} GiB usable per rank; use more ranks or "
                     f"{smaller}")


def explain_line(best, plans, work, cluster, note: str = "", workload: str = "") -> str:
    """One line: the layout chosen (``workload``: what it was planned for, when not the command's own request), its
    prediction (the planner's explanation) and the runner-up."""
    from tensorpar.planner.inference import explain_inference

    others = [q for q in plans if q is not best]
    lines = explain_inference([best, *others], work)
    hosts = cluster.num_devices // cluster.devices_per_node if cluster.num_devices > cluster.devices_per_node else 1
    link = (f", link between hosts {cluster.device.inter_node_gbps:g} GB/s {cluster.device.inter_node_latency_us:g} us"
            if hosts > 1 and cluster.device.inter_node_gbps > 0 else "")
    n = cluster.num_devices
    head = (f"plan (auto) for {n} rank{'s' if n != 1 else ''} on {hosts} host{'s' if hosts > 1 else ''}{link}: "
            f"tp={best.tp} pp={best.pp}{f' (for {workload})' if workload else ''}, the fastest that fits and runs: "
            f"{lines[0]}")
    runner = f" Next: {lines[1]}" if len(lines) > 1 else ""
    return head + runner + (f" (device: {cluster.device.name}; {note})" if note else "")


def choose_layout(args, config, model_name: str, batch: int, prompt_len: int, new_tokens: int | None = None, *,
                  workload: str = "", smaller: str = "fewer prompts or fewer --max-new-tokens", extra=None) -> dict:
    """``--plan auto`` in the launching process (generate and serve): plan ``batch`` sequences of ``prompt_len`` +
    ``new_tokens`` (None: ``--max-new-tokens``), choose (:func:`choose`), print the one line (rank 0; ``workload``:
    the words for what was planned, :func:`explain_line`), set ``args.tp`` and ``args.pp`` to the layout and return
    its prediction (``layout``, ``batch``, ``decode_ms``, ``ttft_ms``). ``extra``: :func:`runtime_problem`'s.

    Raises ValueError: a ``--tp`` or ``--pp`` given that differs from the choice, and :func:`choose`'s."""
    from tensorpar.launch import rank0_print
    from tensorpar.planner.cluster import ClusterSpec
    from tensorpar.planner.inference import InferenceWorkload
    from tensorpar.planner.model_spec import from_hf_config
    from tensorpar.train.autoplan import CPU_RESERVE_GIB

    nproc, local = plan_ranks(args)
    device, note = inference_device(args, nproc, local)
    try:
        model = from_hf_config(config.to_dict(), name=model_name)
    except ValueError as e:
        raise ValueError(f"--plan auto: the planner cannot read {model_name}: {e}") from None
    from tensorpar.decode.floor import floor_job
    from tensorpar.planner.calibrate.decode_device import decode_device
    from tensorpar.planner.inference import candidate_layouts
    layouts = candidate_layouts(model, ClusterSpec(device, nproc, local), one_replica=True)
    if not layouts:     # before any measurement: the count itself has no layout
        raise no_layout_error(model, ClusterSpec(device, nproc, local), f"--model {model_name}")
    from tensorpar.planner.memory import check_memory_left    # before measuring (tens of seconds): review
    reserve = CPU_RESERVE_GIB if device.host_cores > 0 else InferenceWorkload.reserve_gib
    check_memory_left(device.memory_gib, reserve, f"--device-file {args.device_file}: memory_gib"
                      if getattr(args, "device_file", None) else "this host's memory per rank", reserve_flag=None)
    measure_tp = max(t for t, _ in layouts if t <= local) if any(t <= local for t, _ in layouts) else 1
    backend = "gloo" if getattr(args, "fast_collectives", "auto") == "off" else "shm"
    try:  # a CPU rank without decode constants: measure them at this model's shapes (cached per machine and shape),
        # at the widest tp inside this host that a layout uses
        device, decode_note = decode_device(device, model, config.to_dict(), measure_tp, backend, floor_job,
                                            log=lambda m: rank0_print(f"tensorpar: {m}", file=sys.stderr))
    except RuntimeError as e:
        raise ValueError(f"--plan auto: {e}") from None
    note = f"{note}; {decode_note}" if decode_note else note
    nbytes = 2 if getattr(args, "dtype", "float32") == "bfloat16" else 4
    new_tokens = args.max_new_tokens if new_tokens is None else new_tokens
    work = InferenceWorkload(batch, prompt_len, new_tokens, weight_bytes=nbytes, kv_bytes=nbytes,
                             reserve_gib=reserve, tp_comm=getattr(args, "tp_comm", "fp32"))
    cluster = ClusterSpec(device, nproc, local)
    best, plans = choose(model, cluster, work, lambda tp, pp: runtime_problem(args, config, tp, pp, extra),
                         what=f"--model {model_name}", smaller=smaller)
    explicit = set(getattr(args, "explicit_flags", None) or ())
    differ = [f"--{k} {getattr(args, k)}" for k in ("tp", "pp") if k in explicit and getattr(args, k) != getattr(best, k)]
    if differ:
        raise ValueError(f"--plan auto chose tp={best.tp} pp={best.pp} for {nproc} ranks, but {' and '.join(differ)} "
                         f"was given; drop {' and '.join(d.split()[0] for d in differ)} (the plan sets them) or drop "
                         f"--plan auto")
    rank0_print(f"tensorpar: {explain_line(best, plans, work, cluster, note, workload)}")
    args.tp, args.pp = best.tp, best.pp
    return {"layout": best.name, "batch": batch, "decode_ms": best.decode * 1e3, "ttft_ms": best.ttft * 1e3}


def serve_workload(max_batch: int, max_len: int) -> tuple[tuple[int, int, int], str]:
    """``serve --plan auto``'s workload: a server is not one request, so it is planned full: ``max_batch`` rows
    (``--max-batch``) of ``max_len`` positions (``--max-model-len``, prompt + tokens, the KV cache the default pool
    holds), as a prompt of half the positions and the other half generated (the decode priced at 3/4 of
    ``max_len``, the mean context of that generation). Returns ``((batch, prompt_len, new_tokens), words)`` for
    :func:`choose_layout`."""
    prompt = max(max_len // 2, 1)
    return (max_batch, prompt, max_len - prompt), (f"a full server: --max-batch {max_batch} rows of --max-model-len "
                                                   f"{max_len} positions, as {prompt} prompt + {max_len - prompt} "
                                                   f"new tokens")


def comparison_line(prediction: dict, ttft_s: float, decode_s: float, new_tokens: int,
                    ttft_cpu_s: float | None = None) -> str:
    """``plan vs measured``: the predicted decode ms/token and time to first token next to the measured ones (decode:
    ``decode_s`` over the ``new_tokens - 1`` steps after the first token), with the relative errors; ``ttft_cpu_s``:
    rank 0's CPU time over the first token, shown after it (the compute, which a loaded machine's wall clock
    stretches)."""
    def pair(what: str, predicted: float, measured: float | None) -> str:
        if measured is None:
            return f"{what} {predicted:.2f} ms predicted, not measured (one new token)"
        return _pair(what, predicted, measured)

    decode = decode_s / (new_tokens - 1) * 1e3 if new_tokens > 1 else None
    return (f"tensorpar: plan vs measured ({prediction['layout']}): "
            f"{pair('decode per token', prediction['decode_ms'], decode)}; "
            f"{pair('first token', prediction['ttft_ms'], ttft_s * 1e3)}"
            + (f" (CPU {ttft_cpu_s * 1e3:.2f} ms, {(prediction['ttft_ms'] / (ttft_cpu_s * 1e3) - 1) * 100:+.0f}%)"
               if ttft_cpu_s else ""))


def _pair(what: str, predicted: float, measured: float) -> str:
    return (f"{what} {predicted:.2f} ms predicted, {measured:.2f} measured ({(predicted / measured - 1) * 100:+.0f}% "
            f"off)" if measured > 0 else f"{what} {predicted:.2f} ms")


def serve_comparison_line(prediction: dict, registry) -> str:
    """serve's ``plan vs measured`` at shutdown, from its metrics (``registry``: the server's Prometheus registry,
    :class:`tensorpar.serve.metrics.ServeMetrics`): the predicted decode step at ``--max-batch`` rows next to the
    mean time between a request's tokens (``tensorpar_inter_token_latency_seconds``; a step of whatever batch ran,
    steps that also prefilled included) and the mean rows per step (``tensorpar_batch_size``)."""
    def value(name: str) -> float:
        return registry.get_sample_value(name) or 0.0

    gaps, steps = value("tensorpar_inter_token_latency_seconds_count"), value("tensorpar_batch_size_count")
    head = f"tensorpar: plan vs measured ({prediction['layout']}): "
    what = f"decode step at {prediction['batch']} rows"
    if not gaps:
        return head + (f"{what} {prediction['decode_ms']:.2f} ms predicted; not measured (no request decoded a "
                       f"second token)")
    measured = value("tensorpar_inter_token_latency_seconds_sum") / gaps * 1e3
    return (head + _pair(what, prediction["decode_ms"], measured) + f" (mean time between a request's tokens over "
            f"{gaps:.0f} gaps, at {value('tensorpar_batch_size_sum') / max(steps, 1):.1f} rows per step on average)")
