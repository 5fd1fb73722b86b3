"""Counts the layering of the library (issue 22): rooms, import cycles between rooms, imports inside functions,
library lines and the modules over 400 lines.

A room is a subpackage of ``tensorpar`` (``tensorpar.hf``) or a module at the package root (``tensorpar.hub``).
Every ``import`` of a tensorpar module counts, also those inside functions (a function-level import hides a cycle
from Python but not from a reader). Usage: ``python scripts/code_layers.py [repo root] [--json]``.
"""
from __future__ import annotations

import ast
import json
import sys
from collections import defaultdict
from pathlib import Path


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node, mod: str, is_pkg: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:   # relative: from the package of ``mod``
        base = mod.split(".")
        base = base[: len(base) - node.level + (1 if is_pkg else 0)]
        m = ".".join(base + ([node.module] if node.module else []))
    else:
        m = node.module or ""
    return [m]


def room(mod: str) -> str:
    return ".".join(mod.split(".")[:2])


def analyse(root: Path) -> dict:
    """``{"rooms", "cycles" (pairs of rooms importing each other), "imports", "imports_in_functions",
    "library_lines", "largest" (module, lines), "over_400" (modules)}`` for the ``tensorpar`` package under
    ``root``."""
    edges: dict[str, set[str]] = defaultdict(set)
    total = inner = lines = 0
    sizes = {}
    for path in sorted((root / "tensorpar").rglob("*.py")):
        text = path.read_text()
        mod = _module_name(path, root)
        n = len(text.splitlines())
        lines += n
        sizes[str(path.relative_to(root))] = n
        tree = ast.parse(text)
        stack = [(tree, False)]
        while stack:
            node, in_fn = stack.pop()
            for ch in ast.iter_child_nodes(node):
                fn = in_fn or isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef))
                if isinstance(ch, (ast.Import, ast.ImportFrom)):
                    targets = [t for t in _imported(ch, mod, path.name == "__init__.py") if t.startswith("tensorpar")]
                    if targets:
                        total += 1
                        inner += fn
                        for t in targets:
                            if room(t) not in (room(mod), "tensorpar"):
                                edges[room(mod)].add(room(t))
                stack.append((ch, fn))
    cycles = sorted({tuple(sorted((a, b))) for a in edges for b in edges[a] if a in edges.get(b, ())})
    largest = max(sizes.items(), key=lambda kv: kv[1])
    return {"rooms": sorted(set(edges) | {b for v in edges.values() for b in v}), "cycles": [list(c) for c in cycles],
            "imports": total, "imports_in_functions": inner, "library_lines": lines, "largest": list(largest),
            "over_400": sorted(k for k, v in sizes.items() if v > 400)}


def main(argv: list[str]) -> int:
    args = [a for a in argv if a != "--json"]
    r = analyse(Path(args[0]) if args else Path(__file__).resolve().parents[1])
    if "--json" in argv:
        print(json.dumps(r, indent=1))
        return 0
    print(f"library lines {r['library_lines']}; modules over 400 lines {len(r['over_400'])} (largest {r['largest'][0]}, "
          f"{r['largest'][1]}); imports of tensorpar {r['imports']}, inside functions {r['imports_in_functions']}")
    print(f"import cycles between rooms: {len(r['cycles'])}")
    for a, b in r["cycles"]:
        print(f"  {a} <-> {b}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
