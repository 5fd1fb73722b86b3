"""Command-line entry point: ``tensorpar <command> ...`` (also ``python -m tensorpar``).

Each command lives in its own module exposing ``add_arguments(parser)`` and
``main(args) -> int``; this file only maps names onto those modules, so that
importing the CLI stays cheap (modules load on use), and holds the launch flags that
``generate``, ``train``, ``serve`` and ``verify`` share (:func:`add_launch_arguments`).

Errors: bad input found before any rank starts is refused in one line, ``tensorpar <command>: error: <setting>:
<what is wrong> (<what would work>)``, exit 2 (:func:`tensorpar.usage.refuse`, the one function every refusal goes
through); so is a usage error that argparse finds (a bad choice, a value of the wrong type, an unknown option,
a missing value: :class:`ArgumentParser`, ``...; see tensorpar <command> -h``). A note on accepted input
(``tensorpar: note: ...``, :func:`tensorpar.usage.note`) is printed once every check has passed, so a refused
input is its one line. An error inside a rank is one line
too, ``tensorpar: error: ... (rank R)`` (exit 1, see
:func:`tensorpar.launch.run_ranks`). Any other exception is printed as one line with its type
(exit 1); ``--verbose`` shows the full traceback instead.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from tensorpar import __version__
from tensorpar.usage import REFUSED, ArgumentParser, HelpFormatter, hold_notes, note, release_notes

COMMANDS = {
    "generate": ("tensorpar.generate", "generate text with a model sharded over --tp ranks"),
    "plan": ("tensorpar.planner.cli", "choose tp, pp, dp, sequence parallelism, micro-batch and recomputation "
                                      "for a model on a cluster, from a cost model"),
    "models": ("tensorpar.models", "list the model families tensorpar shards and what each supports"),
    "verify": ("tensorpar.verify", "check a sharded model against the unsharded one, module by module, at each tp"),
    "train": ("tensorpar.train.cli", "train or fine-tune a decoder with tensor (and sequence) parallelism"),
    "serve": ("tensorpar.serve.cli", "serve a model sharded over --tp ranks through an OpenAI-compatible HTTP API, "
                                     "with continuous batching"),
}


#: values of ``--fast-collectives`` (same-host shared-memory collectives for CPU tensors)
FAST_COLLECTIVES = ("auto", "on", "off")
#: values of ``--dtype``
DTYPES = ("float32", "bfloat16")


def dtype_name(text: str) -> str:
    """A ``--dtype`` value: ``bf16`` / ``fp32`` (the short spellings) as the names every command takes."""
    return {"bf16": "bfloat16", "fp32": "float32"}.get(text, text)
#: values of ``--tp-comm`` (the tp all-reduce of the partial sums: exact, or blockwise int8 on the wire)
TP_COMM = ("fp32", "int8")


def add_lora_argument(p) -> None:
    """``--lora DIR`` of ``generate`` and ``serve``: a PEFT LoRA adapter merged into each rank's weight shards at load
    (:func:`tensorpar.hf.lora.merge_adapter`), checked against the model before any rank starts
    (:func:`tensorpar.job.job_from_args`)."""
    p.add_argument("--lora", default=None, metavar="DIR",
                   help="a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors, e.g. a "
                        "tensorpar train --lora checkpoint or export): merged into each rank's weight shards at load")


def add_launch_arguments(p, *, tp_list: bool = False, tp_action=None, ep: bool = False, pp: bool = False,
                         plan: bool = False) -> None:
    """The launch flags that ``generate``, ``train``, ``serve`` and ``verify`` share, with one set of defaults:
    ``--tp`` (:data:`tensorpar.launch.DEFAULT_TP`; ``tp_list``: a comma-separated list of degrees, for ``verify``), ``--tp-weights``,
    ``--dtype`` (float32), ``--timeout`` (:data:`tensorpar.launch.DEFAULT_TIMEOUT_S` seconds), ``--fast-collectives`` (auto),
    ``--tp-comm`` (fp32), ``--check-collectives`` and ``--verbose``. :func:`check_launch_arguments` is their one
    validation rule.
    ``tp_action``: an argparse action class for ``--tp`` (``train`` records which flags the user gave).
    ``ep``: also ``--ep`` (``generate``, ``serve``, ``verify``; ``train`` has its own, on its dp axis): the experts of
    a mixture-of-experts model split whole over ``ep`` replicas of the tp ranks (``tp x ep`` ranks in all).
    ``pp``: also ``--pp`` (``generate``; ``train`` has its own): pipeline stages of ``tp`` ranks each, cut by
    training's rule (``tp x pp`` ranks; tp inside a host, stages across hosts).
    ``plan``: also ``--plan auto`` and its inputs (``generate``, ``serve``: :func:`add_plan_arguments`)."""
    from tensorpar.capacity import add_argument as add_tp_weights
    from tensorpar.launch import DEFAULT_TIMEOUT_S, DEFAULT_TP

    if tp_list:
        p.add_argument("--tp", default=str(DEFAULT_TP),
                       help="comma-separated tensor-parallel degrees to check, e.g. 2,3,4")
    else:
        p.add_argument("--tp", type=int, default=DEFAULT_TP, action=tp_action or ExplicitFlag,
                       help="tensor-parallel degree: local ranks started here (under torchrun: from its world size)")
    add_tp_weights(p)
    if ep:
        p.add_argument("--ep", type=int, default=1,
                       help="expert-parallel degree: a mixture-of-experts model's experts split whole over this many "
                            "replicas of the tp ranks (tp x ep ranks; each keeps E/ep experts, tokens moved by "
                            "all-to-all); must divide the number of experts")
    if pp:
        p.add_argument("--pp", type=int, default=1, action=ExplicitFlag,
                       help="pipeline stages: the layers cut into this many consecutive stages of --tp ranks each "
                            "(tp x pp ranks; each holds its stage's weights and KV cache; docs/hosts.md)")
        # context parallelism in inference is not done: a clear refusal instead of argparse's "unrecognized"
        p.add_argument("--cp", dest="inference_cp", type=int, default=1,
                       help="context parallelism is for training (tensorpar train --cp); here only --cp 1: a prompt's "
                            "KV cache is not split by sequence in generate and serve")
    if plan:
        add_plan_arguments(p)
    p.add_argument("--dtype", type=dtype_name, choices=DTYPES, default="float32",
                   help="bfloat16: bf16 weights and compute for generate, serve and verify; bf16 autocast over "
                        "fp32 weights and optimizer state for train")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help="collective timeout in seconds: a rank that stops or hangs ends the run after this long")
    p.add_argument("--fast-collectives", choices=FAST_COLLECTIVES, default="auto",
                   help="fast collectives for CPU tensors (auto: shared memory among the ranks of one host; for "
                        "a group across hosts shared memory inside each host and small tensors between the hosts "
                        "over tensorpar's own TCP connections; on: shared memory, refused across hosts; off: gloo)")
    p.add_argument("--tp-comm", choices=TP_COMM, default="fp32",
                   help="the tp all-reduce of the row-parallel partial sums: fp32 (exact) or int8 (blockwise int8 "
                        "partials in one all-gather, ~0.28x the bytes; for slow links between hosts; inference "
                        "only; docs/collectives.md)")
    p.add_argument("--check-collectives", action="store_true",
                   help="debug: fingerprint every collective and compare the tp ranks' fingerprints and inputs at "
                        "the first step and every 50 steps (also TENSORPAR_CHECK_COLLECTIVES=1)")
    p.add_argument("--verbose", action="store_true", help="show full tracebacks of errors")


def add_plan_arguments(p) -> None:
    """``--plan auto`` of ``generate`` and ``serve`` (the layout from the inference planner, as ``train --plan auto``
    takes its layout from the training planner) and its inputs: ``--nproc`` (the ranks; under torchrun its world
    size, whose nodes are the hosts), ``--device-file`` (instead of this machine's cached calibration) and the link
    between hosts, ``--inter-node-bw`` / ``--inter-node-latency-us`` (the names and units of ``train --plan`` and ``tensorpar
    plan``). :func:`check_plan_arguments` is their flag rule."""
    p.add_argument("--plan", choices=["auto"], default=None,
                   help="take --tp and --pp from the inference planner: the fastest layout of --nproc ranks (under "
                        "torchrun: its ranks and hosts) that fits, for these prompts and --max-new-tokens (serve: "
                        "--max-batch rows of --max-model-len), on this machine (measured once and cached, as train "
                        "--plan auto) or --device-file; prints predicted vs measured decode at the end")
    p.add_argument("--nproc", type=int, default=None, help="ranks to plan for with --plan auto (under torchrun: its "
                                                           "WORLD_SIZE)")
    p.add_argument("--device-file", default=None, metavar="FILE",
                   help="with --plan auto: one rank's device as a JSON DeviceSpec (the 'device' of tensorpar plan "
                        "--calibrate --json, or written for your hardware) instead of this machine's calibration")
    p.add_argument("--inter-node-bw", type=float, default=None, metavar="GB/s",
                   help="with --plan auto: the bandwidth of the link between hosts, GB/s per rank (1 Gbit/s = 0.125), "
                        "which prices the groups that span hosts (torchrun's nodes); default: this host's link")
    p.add_argument("--inter-node-latency-us", type=float, default=None, metavar="US",
                   help="with --plan auto and --inter-node-bw: the latency of one small collective or send between "
                        "hosts, microseconds (default 20)")


def check_plan_arguments(args) -> None:
    """The flag rule of :func:`add_plan_arguments` (launching process, before the model is read): ``--nproc``,
    ``--device-file`` and the link flags go with ``--plan auto``; ``--nproc`` is a positive count and, under
    torchrun, its world size; ``--plan auto`` plans neither expert parallelism (``--ep``), a weighted split
    (``--tp-weights``) nor int8 weights (``--quantize``). The link's values: :func:`tensorpar.planner.cluster.inter_node_link`. Raises ValueError."""
    import os

    from tensorpar.launch import under_torchrun

    given = [f for f, k in (("--nproc", "nproc"), ("--device-file", "device_file"), ("--inter-node-bw", "inter_node_bw"),
                            ("--inter-node-latency-us", "inter_node_latency_us")) if getattr(args, k, None) is not None]
    if getattr(args, "plan", None) is None:
        if given:
            raise ValueError(f"{given[0]} goes with --plan auto (it is an input of the planner); add --plan auto or "
                             f"drop {given[0]}")
        return
    nproc = getattr(args, "nproc", None)
    if nproc is not None and nproc < 1:
        raise ValueError(f"--nproc {nproc}: must be a positive number of ranks")
    if nproc is not None and under_torchrun() and nproc != int(os.environ["WORLD_SIZE"]):
        raise ValueError(f"--nproc {nproc} differs from torchrun's WORLD_SIZE={os.environ['WORLD_SIZE']}; drop "
                         f"--nproc under torchrun")
    if getattr(args, "ep", 1) > 1:
        raise ValueError(f"--plan auto and --ep {args.ep}: the planner does not plan expert parallelism; drop --plan "
                         f"and give --tp, --pp and --ep, or drop --ep")
    if getattr(args, "tp_weights", None) is not None:
        raise ValueError(f"--plan auto and --tp-weights {args.tp_weights}: the planner prices an even split; drop "
                         f"--plan and give --tp, or drop --tp-weights")
    if getattr(args, "quantize", "none") != "none":
        raise ValueError(f"--plan auto and --quantize {args.quantize}: the planner prices fp32 or bf16 weights (--dtype); "
                         f"drop --plan and give --tp, or drop --quantize")


def check_launch_arguments(args, *, exact: str | None = None) -> None:
    """The one rule for the shared launch flags (in the launching process, before any rank starts).

    ``--tp-comm int8`` with every tp group inside one host (no torchrun; or torchrun's ranks per host a multiple of
    tp, as with tp inside a host and pp across) is allowed; one line on stderr (:func:`tensorpar.usage.note`:
    printed once every check passed) says it is not needed there (the links are shared memory or loopback), or
    that it does nothing at ``--tp 1``. ``exact``: why the command needs the exact all-reduce (train, verify), refusing int8.

    Raises:
        ValueError: ``--timeout`` not a number of seconds in [1, 1e8] (below 1 s the ranks' store cannot even
            start; 1e8 is torch's timedelta limit); ``--tp-comm int8`` with ``exact`` given (train, verify);
            ``--ep`` below 1; ``--cp`` other than 1 on generate or serve (context parallelism in inference is not
            done: a prompt's KV cache is not split by sequence).
    """
    import math
    import os

    mode = getattr(args, "tp_comm", "fp32")
    if mode != "fp32":
        if exact is not None:
            raise ValueError(f"--tp-comm {mode}: the compressed all-reduce is lossy (generate and serve only); "
                             f"{exact}; drop --tp-comm (fp32, the default)")
        world = int(os.environ.get("WORLD_SIZE", "0") or 0)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
        tp = int(getattr(args, "tp", 2))
        # tp is the grid's innermost axis (consecutive ranks) and torchrun numbers a host's ranks consecutively, so
        # every tp group is inside one host when the ranks per host are a multiple of tp (tp inside, pp across)
        if tp == 1:
            note(args, f"tensorpar: note: --tp-comm {mode} does nothing at --tp 1 (there is no tp all-reduce)")
        elif (not world or (local and local % tp == 0)) and int(os.environ.get("RANK", "0") or 0) == 0:
            note(args, f"tensorpar: note: --tp-comm {mode}: every tp group is inside one host, where the links are "
                       f"fast; compression is not needed here (it only pays on slow links between hosts)")

    ep = getattr(args, "ep", 1)
    if ep < 1:
        raise ValueError(f"--ep must be a positive integer (1 = experts not split), got {ep}")
    cp = getattr(args, "inference_cp", 1)
    if cp != 1:
        raise ValueError(f"--cp {cp}: context parallelism runs in training only (tensorpar train --cp); generate and "
                         f"serve keep a prompt's whole KV cache on every rank of its tp group, so a prompt and its new "
                         f"tokens must fit the model's max_position_embeddings and one rank's KV memory (serve: "
                         f"--max-model-len, --kv-cache-memory); use --cp 1")

    t = args.timeout
    if not (math.isfinite(t) and 1 <= t <= 10 ** 8):
        raise ValueError(f"--timeout must be a positive, finite number of seconds from 1 to 1e8 (it also bounds the "
                         f"ranks' start-up), got {t:g}")


def check_ep_for_model(args, config) -> None:
    """``--ep`` against the model (launching process; the ranks' :func:`~tensorpar.hf.modules.expert_parallelize`
    applies the same rule, :func:`~tensorpar.hf.modules.experts.expert_parallel_error`). Raises ValueError."""
    from tensorpar.hf.modules.experts import expert_parallel_error

    why = expert_parallel_error(getattr(args, "ep", 1), config, "--ep")
    if why:
        raise ValueError(why)


def check_model_degrees(args, config) -> None:
    """``--ep`` and ``--pp`` of ``generate`` and ``serve`` (launching process): :func:`check_ep_for_model`, the flag
    rules of ``--pp`` (:func:`tensorpar.pipeline.inference.check_pp_arguments`) and the stage cut the ranks make
    (:func:`~tensorpar.pipeline.inference.check_stages`). Raises ValueError."""
    from tensorpar.pipeline.inference import check_pp_arguments, check_stages

    check_ep_for_model(args, config)
    check_pp_arguments(args)
    check_stages(config, getattr(args, "pp", 1))


class ExplicitFlag(argparse.Action):
    """Stores the value and records the flag in ``namespace.explicit_flags`` (so a degree the user gave can be
    told from a default: ``train --plan``, :func:`torchrun_tp`)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        explicit = set(getattr(namespace, "explicit_flags", None) or ())
        namespace.explicit_flags = explicit | {self.dest}


def torchrun_tp(args) -> None:
    """Under torchrun (this process is one of its ranks) set ``args.tp`` from its world size:
    ``WORLD_SIZE / (ep x pp)`` (``generate``, ``serve``; the launching rule of ``--ep`` and ``--pp``). Raises
    ValueError when ``ep x pp`` does not divide it, or when a ``--tp`` the user gave differs from it (never silently
    another degree)."""
    import os

    from tensorpar.launch import under_torchrun

    if not under_torchrun():
        return
    world, ep, pp = int(os.environ["WORLD_SIZE"]), getattr(args, "ep", 1), getattr(args, "pp", 1)
    if ep >= 1 and world % ep:
        raise ValueError(f"--ep {ep} does not divide torchrun's {world} ranks (tp x ep); use --ep in "
                         f"{[d for d in range(1, world + 1) if world % d == 0]}")
    other = max(ep, 1) * max(pp, 1)
    if pp > 1 and world % other:
        raise ValueError(f"--pp {pp} does not divide torchrun's {world} ranks (tp x pp); use --pp in "
                         f"{[d for d in range(1, world + 1) if world % d == 0]}")
    if "tp" in (getattr(args, "explicit_flags", None) or ()) and args.tp != world // other:
        what = "--pp" if pp > 1 else "--ep"
        n = args.tp * other
        raise ValueError(f"--tp {args.tp} x {what} {pp if pp > 1 else ep} = {n} ranks, but torchrun started "
                         f"WORLD_SIZE={world}; drop --tp under torchrun (it is the world size / {what}) or start "
                         f"{n} ranks")
    args.tp = world // other


def _join_dash_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--opt -1,1`` -> ``--opt=-1,1`` for every option of ``parser`` that takes one value.

    argparse takes a token that starts with ``-`` for an option unless it is a plain negative number, so a
    value such as ``--tp-weights -1,1`` would end in a usage error instead of reaching the option's own check
    (which names the setting and what would work). Only tokens that start with ``-`` and a digit or ``.``, and
    ``-inf`` / ``-infinity`` / ``-nan`` (any case: what ``float`` reads), are joined, also after an option abbreviated
    as argparse allows (a prefix of one option only: ``--mem -inf``); everything after ``--`` is left alone.
    """
    import re

    takes_value = {s for a in parser._actions if a.nargs is None for s in a.option_strings if s.startswith("--")}
    longs = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            return out + argv[i:]
        named = [s for s in longs if s.startswith(a)] if a.startswith("--") and a not in longs else [a]
        if len(named) == 1 and named[0] in takes_value and i + 1 < len(argv) and re.match(r"-([\d.]|(inf|infinity|nan)$)", argv[i + 1], re.I):
            out.append(f"{a}={argv[i + 1]}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = ArgumentParser(prog="tensorpar", description="Tensor parallelism for PyTorch models.",
                            formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"tensorpar {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)  # the top level takes only -h / --version
    chosen_parser = parser
    for name, (modname, helptext) in COMMANDS.items():
        p = sub.add_parser(name, help=helptext, description=helptext, formatter_class=HelpFormatter)
        p.set_defaults(_module=modname)
        if name == chosen:  # only the command being run is imported (torch takes seconds to import)
            importlib.import_module(modname).add_arguments(p)
            if not any("--verbose" in a.option_strings for a in p._actions):
                p.add_argument("--verbose", action="store_true", help="show full tracebacks of errors")
            argv = _join_dash_values(p, argv)
            chosen_parser = p
    args, unknown = parser.parse_known_args(argv)
    if unknown:   # named by the command's parser, which knows its options (the top level's error would not)
        chosen_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    hold_notes(args)   # a refused input is its one line: notes print once the command's checks pass
    try:
        rc = int(importlib.import_module(args._module).main(args) or 0)
        if rc != REFUSED:
            release_notes(args)
        return rc
    except KeyboardInterrupt:
        print("tensorpar: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if getattr(args, "verbose", False):
            raise
        from tensorpar.launch import one_line, report_error
        release_notes(args)
        report_error(f"{one_line(e)} (--verbose shows the traceback)")
        return 1


if __name__ == "__main__":
    sys.exit(main())
