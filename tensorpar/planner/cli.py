"""``tensorpar plan``: choose tp, pp, dp, sequence parallelism, micro-batch, recomputation and the
distributed optimizer for a model on a cluster, from a cost model (no GPU needed).

    tensorpar plan --model gpt3-175b --gpus 1024 --gpus-per-node 8 --device a100-80gb \\
                   --global-batch 1536 --seq 2048
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tensorpar.cli import DTYPES, dtype_name
from tensorpar.planner import cluster as cl
from tensorpar.planner import model_spec as ms
from tensorpar.planner.inference import InferenceWorkload
from tensorpar.planner.layout import ATTENTION, Assumptions, Workload, parse_layout, problems
from tensorpar.planner.memory import check_memory_left


#: bytes per element of the ``--dtype`` / ``--grad-dtype`` names (:data:`tensorpar.cli.DTYPES`)
DTYPE_BYTES = {"bfloat16": 2, "float32": 4}
NO_FIT = 3  # exit status when no layout fits (2: bad input, 1: a calibration worker failed)


#: how a plan's distributed optimizer is run by ``tensorpar train`` (printed under tables that use it)
DISTOPT_NOTE = ("dist-opt on = `tensorpar train --dp-mode fsdp`: FSDP2 (fully_shard on the dp axis) shards the AdamW "
                "state 1/dp, and the gradients and weights too (ZeRO-3), so it needs less memory than the dist-opt "
                "column and moves more (weights all-gathered in forward and again in backward).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model (a preset, a config.json, or explicit dimensions)")
    from tensorpar.hf.presets import PRESETS as TRAIN_PRESETS
    model.add_argument("--model", help=f"preset ({', '.join([*ms.PRESETS, *ms.ALIASES])}; or the `tensorpar train` "
                                       f"presets {', '.join(TRAIN_PRESETS)}, byte vocabulary) or path to a config.json or a "
                                       f"folder holding one")
    for flag, helptext in (("--layers", "number of layers"), ("--hidden", "hidden size"),
                           ("--heads", "query heads"), ("--kv-heads", "key/value heads (default: --heads)"),
                           ("--ffn", "MLP inner size (default 4 x hidden)"), ("--vocab", "vocabulary size"),
                           ("--head-dim", "size of one attention head (default hidden / heads)"),
                           ("--max-positions", "longest sequence the model supports (default: not checked)")):
        model.add_argument(flag, type=int, help=helptext)
    model.add_argument("--mlp", choices=ms.MLP_KINDS, help="MLP kind for explicit dimensions (default swiglu)")
    model.add_argument("--kernels", choices=ms.KERNEL_KINDS,
                       help="whose code runs the model; decides stored activations (preset default)")

    hw = parser.add_argument_group("cluster")
    hw.add_argument("--gpus", type=int, help="number of devices")
    hw.add_argument("--gpus-per-node", type=int, default=8)
    hw.add_argument("--device", default="a100-80gb", help=f"device preset: {', '.join(cl.DEVICES)}")
    hw.add_argument("--devices", help="one tp group of unequal devices, e.g. a100-80gb:4,v100-32gb:4 or a JSON "
                                      "list (inline or .json file) of presets / device objects: models the even "
                                      "and the speed-weighted split (tensorpar --tp-weights)")
    hw.add_argument("--device-file", help="JSON device spec (e.g. the 'device' of --calibrate --json)")
    hw.add_argument("--memory-gb", type=float, help="override device memory, GiB")
    hw.add_argument("--peak-tflops", type=float, help="override dense 16-bit peak, TFLOP/s")
    hw.add_argument("--intra-node-bw", type=float, help="override intra-node bandwidth, GB/s per direction")
    hw.add_argument("--inter-node-bw", type=float,
                    help="override inter-node bandwidth per device, GB/s (1 Gbit/s = 0.125); with --device-file: the "
                         "link between hosts, used by groups that span hosts (docs/hosts.md)")
    hw.add_argument("--hbm-gbps", type=float, help="override device-memory bandwidth, GB/s")
    hw.add_argument("--intra-node-latency-us", type=float,
                    help="override the latency of one small collective inside a node, microseconds")
    hw.add_argument("--inter-node-latency-us", type=float,
                    help="override the latency of one small collective or send between nodes, microseconds")

    work = parser.add_argument_group("workload and assumptions")
    work.add_argument("--global-batch", type=int, help="sequences per optimizer step")
    work.add_argument("--seq", type=int, help="sequence length, tokens")
    work.add_argument("--efficiency", type=float, default=Assumptions.efficiency,
                      help="fraction of peak the matmuls reach (default: the device's matmul_efficiency)")
    work.add_argument("--attention", choices=ATTENTION, default=None,
                      help="eager: scores stored (Korthikanti); sdpa: fused kernel (default: eager for "
                           "megatron kernels, sdpa for hf)")
    work.add_argument("--dtype", type=dtype_name, choices=DTYPES, default="bfloat16",
                      help="weights and activations (the name the other commands take; bf16/fp32 also accepted)")
    work.add_argument("--grad-dtype", type=dtype_name, choices=DTYPES, default="bfloat16",
                      help="gradient buffers: bfloat16 (16 B/param with Adam) or float32 main grads (18 B/param)")
    work.add_argument("--tp-overlap", type=float, default=0.0, help="fraction of TP communication hidden")
    work.add_argument("--dp-overlap", type=float, default=0.0, help="fraction of DP communication hidden")
    work.add_argument("--reserve-gb", type=float, default=None,
                      help=f"GiB per device not available to the model (default {Assumptions.reserve_gib} for "
                           f"training, {InferenceWorkload.reserve_gib} with --inference)")
    work.add_argument("--max-micro-batch", type=int, default=Assumptions.max_micro_batch)
    work.add_argument("--virtual-stages", default="1", help="interleaving degrees to try, e.g. 1,2,4")
    work.add_argument("--cp", default="1", help="context-parallel degrees to try, e.g. 1,2,4 (tensorpar train --cp; "
                                                "each sequence split over cp devices, ring or all2all attention)")
    work.add_argument("--capacity-factor", type=float, default=Assumptions.capacity_factor,
                      help="mixture of experts: tokens dispatched per expert over its balanced share (default %(default)s)")
    work.add_argument("--allow-cross-node-tp", action="store_true", help="let tensor-parallel groups span nodes")

    inf = parser.add_argument_group("inference (--inference): tp and replicas for generation")
    inf.add_argument("--inference", action="store_true", help="plan generation instead of training")
    inf.add_argument("--batch", type=int, help="sequences decoded together per replica (required with --inference)")
    inf.add_argument("--prompt-len", type=int, help="prompt tokens per sequence (required with --inference)")
    inf.add_argument("--max-new-tokens", type=int, help="tokens generated per sequence (required with --inference)")
    inf.add_argument("--latency-target-ms", type=float, help="largest acceptable decode time per token, ms")
    inf.add_argument("--tp-comm", choices=("fp32", "int8"), default="fp32",
                     help="the tp all-reduce of partial sums as generate --tp-comm runs it: exact, or blockwise int8 "
                          "on the wire (~0.28x the fp32 bytes; pays on a slow link between hosts)")

    out = parser.add_argument_group("output")
    out.add_argument("--top", type=int, default=10, help="plans to show (0: all)")
    out.add_argument("--json", action="store_true", help="print a JSON list of plans instead of a table")
    out.add_argument("--evaluate", metavar="SPEC", help="score one layout, e.g. tp=8,pp=4,dp=32,micro_batch=2")
    out.add_argument("--plot", metavar="FILE.png", help="draw the memory breakdown of the shown plans")
    out.add_argument("--calibrate", action="store_true", help="measure matmul and collective speed here")


def build_model(args) -> ms.ModelSpec:
    dims = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "vocab")}
    if any(v is not None for v in dims.values()):
        missing = [f"--{k}" for k, v in dims.items() if v is None]
        if missing:
            raise ValueError(f"explicit dimensions need {', '.join(missing)} as well")
        options = {"mlp": args.mlp} if args.mlp else {}
        if args.max_positions:
            options["max_positions"] = args.max_positions
        model = ms.from_dims(**dims, kv_heads=args.kv_heads, ffn=args.ffn, head_dim=args.head_dim,
                             name=args.model or "custom", **options)
    elif args.head_dim is not None or args.max_positions is not None:
        raise ValueError("--head-dim and --max-positions go with explicit dimensions (--layers --hidden --heads --vocab)")
    elif args.model is None:
        raise ValueError("give --model (a preset or a config.json) or --layers/--hidden/--heads/--vocab")
    elif Path(args.model).is_file():
        model = ms.from_hf_config(args.model)
    elif _is_preset(args.model):  # before folders: a preset name wins over a same-named folder here ("bench")
        model = _preset(args.model, args.seq)
    elif Path(args.model).is_dir():
        config = Path(args.model) / "config.json"
        if not config.is_file():
            raise ValueError(f"--model {args.model}: folder has no config.json; give a folder with one, a "
                             "config.json file, or a preset")
        model = ms.from_hf_config(config)
    elif "/" in args.model or args.model.endswith(".json") or args.model.startswith((".", "~")):
        raise ValueError(f"--model {args.model}: no such file or folder; give a config.json, a folder with one "
                         "(a local checkout: the planner downloads nothing), or a preset")
    else:
        model = _preset(args.model, args.seq)
    return ms.with_kernels(model, args.kernels) if args.kernels else model


def _is_preset(name: str) -> bool:
    from tensorpar.hf.presets import PRESETS as TRAIN_PRESETS

    return name in ms.PRESETS or name in ms.ALIASES or name in TRAIN_PRESETS


def _preset(name: str, seq: int | None) -> ms.ModelSpec:
    """A planner preset, or one of ``tensorpar train``'s (:data:`tensorpar.hf.presets.PRESETS`): the model train
    builds for it (:func:`tensorpar.hf.presets.preset_config`) with train's default tokenizer for a preset, bytes
    (vocabulary 256). Raises ValueError listing both sets of presets."""
    from tensorpar.hf.presets import PRESETS as TRAIN_PRESETS

    if name in TRAIN_PRESETS and name not in ms.PRESETS and name not in ms.ALIASES:
        from tensorpar.data.tokenizers import ByteTokenizer
        from tensorpar.hf.presets import preset_config

        config = preset_config(name, ByteTokenizer.vocab_size, seq or 1)
        return ms.from_hf_config(config.to_dict(), name=name)
    try:
        return ms.preset(name)
    except ValueError:
        known = ", ".join(sorted([*ms.PRESETS, *ms.ALIASES]))
        raise ValueError(f"--model {name!r} is not a preset; use one of {known}, a `tensorpar train` preset "
                         f"({', '.join(TRAIN_PRESETS)}), or a path to a config.json") from None


def build_cluster(args) -> cl.ClusterSpec:
    if args.gpus is None:
        raise ValueError("give --gpus (the number of devices)")
    device = cl.device_from_file(args.device_file) if args.device_file else cl.device_preset(args.device)
    # train --plan's rule for the link between hosts (raises, or notes a unit slip where the devices span nodes)
    cl.inter_node_link(args, device, crosses_hosts=cl.spans_hosts(args.gpus, args.gpus_per_node))
    flags = {"memory_gib": "--memory-gb", "peak_tflops": "--peak-tflops", "intra_node_gbps": "--intra-node-bw",
             "inter_node_gbps": "--inter-node-bw", "intra_node_latency_us": "--intra-node-latency-us",
             "hbm_gbps": "--hbm-gbps", "inter_node_latency_us": "--inter-node-latency-us"}
    cl.check_plausible({"memory_gib": args.memory_gb, "peak_tflops": args.peak_tflops,
                        "intra_node_gbps": args.intra_node_bw, "hbm_gbps": args.hbm_gbps,
                        "intra_node_latency_us": args.intra_node_latency_us})
    try:
        device = cl.override(device, memory_gib=args.memory_gb, peak_tflops=args.peak_tflops,
                             intra_node_gbps=args.intra_node_bw, inter_node_gbps=args.inter_node_bw,
                             intra_node_latency_us=args.intra_node_latency_us, hbm_gbps=args.hbm_gbps,
                             inter_node_latency_us=args.inter_node_latency_us)
    except ValueError as e:   # name the flag the user gave, not the field ("device memory_gib (-1.0) ...")
        import re
        m = re.match(r"device (\w+) \((.*?)\) (must be .*)", str(e))
        if m is None or m.group(1) not in flags:
            raise
        raise ValueError(f"{flags[m.group(1)]} {float(m.group(2)):g}: {m.group(3)}") from None     # as inter_node_link words it
    cluster = cl.ClusterSpec(device=device, num_devices=args.gpus, devices_per_node=args.gpus_per_node)
    cl.note_unused_link(args, cluster.num_devices, cluster.devices_per_node,   # one line: the link is not used
                        f"devices are on one node (--gpus-per-node {cluster.devices_per_node})")
    return cluster


def _memory_source(args) -> str:
    """Where the device's memory came from, in the user's words: the flag, the device file or the preset."""
    return ("--memory-gb" if args.memory_gb is not None else f"--device-file {args.device_file}: memory_gib"
            if args.device_file else f"--device {args.device}'s memory")


def build_assumptions(args, model: ms.ModelSpec) -> Assumptions:
    try:
        virtual = tuple(int(v) for v in args.virtual_stages.split(","))
    except ValueError:
        raise ValueError(f"--virtual-stages ({args.virtual_stages!r}) must be integers like 1,2,4") from None
    try:
        cp = tuple(int(v) for v in str(getattr(args, "cp", "1")).split(","))
    except ValueError:
        raise ValueError(f"--cp ({args.cp!r}) must be integers like 1,2,4") from None
    gpus = getattr(args, "gpus", None)
    if gpus and cp and all(c >= 1 and gpus % c for c in cp):   # else an empty table that does not say why
        fits = ",".join(str(c) for c in range(1, gpus + 1) if gpus % c == 0 and c <= 64)
        raise ValueError(f"--cp {args.cp}: no listed cp divides --gpus {gpus} (the devices are tp x cp x pp x dp); "
                         f"use cp values among {fits}")
    attention = args.attention or ("eager" if model.kernels == "megatron" else "sdpa")
    size = DTYPE_BYTES
    return Assumptions(activation_bytes=size[args.dtype], param_bytes=size[args.dtype],
                       grad_bytes=size[args.grad_dtype], attention=attention, efficiency=args.efficiency,
                       tp_overlap=args.tp_overlap, dp_overlap=args.dp_overlap,
                       reserve_gib=Assumptions.reserve_gib if args.reserve_gb is None else args.reserve_gb,
                       allow_cross_node_tp=args.allow_cross_node_tp, max_micro_batch=args.max_micro_batch,
                       capacity_factor=args.capacity_factor,
                       virtual_stages=virtual, context_parallel=cp)


def main(args) -> int:
    try:
        if args.calibrate:
            return _calibrate(args)
        if getattr(args, "devices", None):
            return _plan_devices(args)
        if args.inference:
            return _plan_inference(args)
        if getattr(args, "tp_comm", "fp32") != "fp32":
            raise ValueError(f"--tp-comm {args.tp_comm} plans generation (--inference); training's tp all-reduce is "
                             "exact: drop --tp-comm or add --inference")
        return _plan(args)
    except ValueError as err:
        from tensorpar.usage import refuse
        return refuse("plan", err)
    except RuntimeError as err:  # calibration: a worker process failed
        print(f"tensorpar plan: {err}", file=sys.stderr)
        return 1


def _calibrate(args) -> int:
    from tensorpar.planner.calibrate import calibrate

    result = calibrate()
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    from tensorpar.planner.calibrate.report import print_calibration

    print_calibration(result)
    return 0


def _plan_inference(args) -> int:
    from tensorpar.planner.inference import InferenceWorkload, explain_inference, plan_inference

    missing = [flag for flag, v in (("--batch", args.batch), ("--prompt-len", args.prompt_len),
                                    ("--max-new-tokens", args.max_new_tokens)) if v is None]
    if missing:
        raise ValueError(f"--inference needs {', '.join(missing)}")
    if args.top < 0:
        raise ValueError(f"--top ({args.top}) must be >= 0 (0 shows every plan)")
    if args.hbm_gbps == 0:       # 0 means "not modelled", which training allows and decode cannot
        raise ValueError("--hbm-gbps 0: decode time needs the device-memory bandwidth; give a finite number of "
                         "GB/s > 0 (or leave it out for the device's own)")
    model, hw = build_model(args), build_cluster(args)
    size = DTYPE_BYTES[args.dtype]
    work = InferenceWorkload(args.batch, args.prompt_len, args.max_new_tokens, weight_bytes=size, kv_bytes=size,
                             latency_target_ms=args.latency_target_ms,
                             reserve_gib=InferenceWorkload.reserve_gib if args.reserve_gb is None else args.reserve_gb,
                             tp_comm=getattr(args, "tp_comm", "fp32"))
    check_memory_left(hw.device.memory_gib, work.reserve_gib, _memory_source(args), args.reserve_gb is None)
    plans = plan_inference(model, hw, work)
    ok = bool(plans) and plans[0].fits
    shown = plans if args.top == 0 else plans[:args.top]      # ranked first, then the layouts that do not fit
    if args.json:
        # a layout that does not fit is listed (with its memory) but not ranked: "rank" null
        print(json.dumps([{**p.to_json(), "rank": i + 1 if p.fits else None} for i, p in enumerate(shown)], indent=2))
        return 0 if ok else NO_FIT
    from rich import box
    from rich.table import Table

    from tensorpar.planner.memory import GIB
    from tensorpar.planner.report import console

    title = (f"{model.name} inference on {hw.num_devices} x {hw.device.name}: batch {work.batch}, prompt "
             f"{work.prompt_len}, {work.max_new_tokens} new tokens"
             + (f", target {work.latency_target_ms:g} ms/token" if work.latency_target_ms else "")
             + (f"; {hw.devices_per_node} per node, link between nodes {hw.device.inter_node_gbps:g} GB/s, "
                f"{hw.device.inter_node_latency_us:g} us" if hw.num_devices > hw.devices_per_node else "")
             + ("; --tp-comm int8" if work.tp_comm == "int8" else ""))
    table = Table(title=title, title_justify="left", header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False)
    for name in ("#", "tp", "pp", "replicas", "KV heads/rank", "weights GiB", "KV GiB", "total GiB", "TTFT ms",
                 "decode ms/token", "tokens/s"):
        table.add_column(name, justify="right")
    for i, q in enumerate(shown):
        total = f"{q.memory / GIB:.2f}" if q.fits else f"[red]{q.memory / GIB:.2f}[/red]"
        decode = f"{q.decode * 1e3:.2f}" if q.meets(work.latency_target_ms) else f"[red]{q.decode * 1e3:.2f}[/red]"
        table.add_row(str(i + 1) if q.fits else "-", str(q.tp), str(q.pp), str(q.replicas), str(q.kv_heads_per_rank), f"{q.weights / GIB:.2f}",
                      f"{q.kv_cache / GIB:.2f}", total, f"{q.ttft * 1e3:.1f}", decode, f"{q.tokens_per_s:.0f}")
    con = console()
    con.print(table)
    for line in explain_inference(plans, work):
        con.print(line, highlight=False)
    return 0 if ok else NO_FIT


def _plan_devices(args) -> int:
    from tensorpar.planner.weighted import parse_devices, plan_weighted, report

    model, devices = build_model(args), parse_devices(args.devices)
    size = DTYPE_BYTES
    per_param = size[args.dtype] if args.inference else size[args.dtype] + size[args.grad_dtype] + 12
    plans = plan_weighted(model, devices, bytes_per_param=per_param)
    if args.json:
        print(json.dumps([p.to_json() for p in plans], indent=2))
    else:
        print("\n".join(report(model, plans, per_param)))
    return 0 if plans[-1].fits else NO_FIT


def _plan(args) -> int:
    from tensorpar.planner.enumerate import score, search
    from tensorpar.planner.explain import explain, memory_verdict, versus

    start = time.perf_counter()
    if args.top < 0:
        raise ValueError(f"--top ({args.top}) must be >= 0 (0 shows every fitting plan)")
    model, hw = build_model(args), build_cluster(args)
    if args.global_batch is None or args.seq is None:
        raise ValueError("give --global-batch and --seq")
    work, assume = Workload(args.global_batch, args.seq), build_assumptions(args, model)
    model.check_seq_len(work.seq_len)
    check_memory_left(hw.device.memory_gib, assume.reserve_gib, _memory_source(args), args.reserve_gb is None)
    layout = parse_layout(args.evaluate, hw.num_devices) if args.evaluate is not None else None
    if layout is not None and layout.cp not in assume.context_parallel:   # rank it among layouts of its cp too
        from dataclasses import replace
        assume = replace(assume, context_parallel=tuple(sorted({*assume.context_parallel, layout.cp})))
    found = search(model, hw, work, assume)
    title = (f"{model.name} on {hw.num_devices} x {hw.device.name} ({hw.devices_per_node} per node), "
             f"global batch {work.global_batch} x {work.seq_len} tokens, attention={assume.attention}"
             + (f"; links: {hw.device.local_link_label}" if hw.device.local_link_gbps else ""))
    if layout is not None:
        broken = problems(layout, model, hw, work, assume)
        if broken:
            raise ValueError(f"--evaluate {layout.short()} is invalid: " + "; ".join(p.message for p in broken))
        plan = score(layout, model, hw, work, assume)
        rank = next((i + 1 for i, p in enumerate(found.ranked) if p.layout == layout), None)
        shown, first = [plan], rank or 0
        notes = [f"{layout.short()}: " + (f"rank {rank} of {len(found.ranked)} fitting layouts"
                                          if rank else memory_verdict(plan)) + "."]
        if found.ranked and rank != 1:
            best = found.ranked[0]
            notes.append(f"#1 is {best.layout.short()}; against it this layout is {versus(plan, best)}.")
    else:
        shown = found.ranked if args.top == 0 else found.ranked[: args.top]
        first = 1
        if not shown:  # nothing fits: show the smallest instead, marked as not fitting
            shown, first = found.too_big[: args.top or None], 0
        notes = explain(found)
    elapsed = time.perf_counter() - start
    if args.plot:
        from tensorpar.planner.plot import plot_memory

        try:
            plot_memory(shown, args.plot, capacity_gib=hw.device.memory_gib, title=title)
        except OSError as err:
            raise ValueError(f"--plot {args.plot}: cannot write it ({err.strerror or err})") from None
    if args.json:
        from tensorpar.planner.report import plans_json

        print(plans_json(shown, first_rank=first or None))
        return 0 if (found.ranked or layout is not None) else NO_FIT
    from tensorpar.planner.report import console, plan_table

    con = console()
    con.print(plan_table(shown, title, first_rank=first))
    for line in notes:
        con.print(line, highlight=False)
    if any(p.layout.distributed_optimizer for p in shown):
        con.print(DISTOPT_NOTE, highlight=False)
    con.print(f"[dim]{len(found.ranked)} layouts fit, {len(found.too_big)} need too much memory, "
              f"{len(found.rejected)} break a rule; planned in {elapsed:.2f} s"
              + (f"; plot written to {args.plot}" if args.plot else "") + "[/dim]")
    return 0 if (found.ranked or layout is not None) else NO_FIT
