"""Command-line entry point: ``tensorpar <command> ...`` (also ``python -m tensorpar``).

Each command lives in its own module exposing ``add_arguments(parser)`` and
``main(args) -> int``; this file only maps names onto those modules, so that
importing the CLI stays cheap (modules load on use).

Errors: bad input found before any rank starts is printed as one line, ``tensorpar: error: ...``
(exit 2, like argparse's usage errors); an error inside a rank is one line too (exit 1, see
:func:`tensorpar.launch.run_ranks`). Any other exception is printed as one line with its type
(exit 1); ``--verbose`` shows the full traceback instead.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from tensorpar import __version__

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


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` lists each option's default; defaults of ``None``/``False`` (unset, off) are not printed."""

    def _get_help_string(self, action):
        if action.default in (None, False) or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="tensorpar", description="Tensor parallelism for PyTorch models.",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"tensorpar {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)  # the top level takes only -h / --version
    for name, (modname, helptext) in COMMANDS.items():
        p = sub.add_parser(name, help=helptext, description=helptext, formatter_class=HelpFormatter)
        p.set_defaults(_module=modname)
        if name == chosen:  # only the command being run is imported (torch takes seconds to import)
            importlib.import_module(modname).add_arguments(p)
            if not any("--verbose" in a.option_strings for a in p._actions):
                p.add_argument("--verbose", action="store_true", help="show full tracebacks of errors")
    args = parser.parse_args(argv)
    try:
        return int(importlib.import_module(args._module).main(args) or 0)
    except KeyboardInterrupt:
        print("tensorpar: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if getattr(args, "verbose", False):
            raise
        from tensorpar.launch import one_line
        print(f"tensorpar: error: {one_line(e)} (--verbose shows the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
