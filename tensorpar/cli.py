"""Command-line entry point: ``tensorpar <command> ...``.

Each command lives in its own module exposing ``add_arguments(parser)`` and
``main(args) -> int``; this file only maps names onto those modules, so that
importing the CLI stays cheap (modules load on use).
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "generate": ("tensorpar.generate", "generate text with a model sharded over --tp ranks"),
    "plan": ("tensorpar.planner.cli", "choose tp, pp, dp, sequence parallelism, micro-batch and recomputation "
                                      "for a model on a cluster, from a cost model"),
    "models": ("tensorpar.models", "list the model families tensorpar shards and what each supports"),
    "train": ("tensorpar.train.cli", "train or fine-tune a decoder with tensor (and sequence) parallelism"),
    "serve": ("tensorpar.serve.cli", "serve a model sharded over --tp ranks through an OpenAI-compatible HTTP API, "
                                     "with continuous batching"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="tensorpar", description="Tensor parallelism for PyTorch models.")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)  # the top level takes no options but -h
    for name, (modname, helptext) in COMMANDS.items():
        p = sub.add_parser(name, help=helptext, description=helptext)
        p.set_defaults(_module=modname)
        if name == chosen:  # only the command being run is imported (torch takes seconds to import)
            importlib.import_module(modname).add_arguments(p)
    args = parser.parse_args(argv)
    return int(importlib.import_module(args._module).main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
