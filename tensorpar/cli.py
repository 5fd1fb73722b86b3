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
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tensorpar", description="Tensor parallelism for PyTorch models.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (modname, helptext) in COMMANDS.items():
        p = sub.add_parser(name, help=helptext, description=helptext)
        p.set_defaults(_module=modname)
        importlib.import_module(modname).add_arguments(p)
    args = parser.parse_args(argv)
    return int(importlib.import_module(args._module).main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
