"""The library's layering (issue 22, item 5), measured by scripts/code_layers.py: no import cycle between rooms and
no module over the size limit."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Import cycles left between rooms (pairs of rooms that import each other, counting imports inside functions):
# none. Adding one fails the test.
KNOWN_CYCLES: set[tuple[str, str]] = set()

MAX_MODULE_LINES = 400
# modules allowed over the limit (none since the split of 2026-12-02); an entry names a module and its size
OVER_LIMIT_LINES: dict[str, int] = {}
OVER_LIMIT: set[str] = set(OVER_LIMIT_LINES)


def _load():
    spec = importlib.util.spec_from_file_location("code_layers", ROOT / "scripts" / "code_layers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_no_import_cycle_between_rooms():
    cycles = {tuple(c) for c in _load().analyse(ROOT)["cycles"]}
    assert cycles == KNOWN_CYCLES, f"import cycles between rooms: {sorted(cycles)}"


def test_no_module_over_the_line_limit():
    sizes = {str(f.relative_to(ROOT)): len(f.read_text().splitlines()) for f in (ROOT / "tensorpar").rglob("*.py")}
    over = {f: n for f, n in sizes.items() if n > OVER_LIMIT_LINES.get(f, MAX_MODULE_LINES)}
    assert not over, f"modules over {MAX_MODULE_LINES} lines (or over their listed size): {over}"


def test_the_analysis_sees_function_level_imports(tmp_path):
    """A cycle made only of imports inside functions is still a cycle."""
    mod = _load()
    pkg = tmp_path / "tensorpar"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("def f():\n    from tensorpar.b import g\n")
    (pkg / "b.py").write_text("from tensorpar.a import f\n")
    r = mod.analyse(tmp_path)
    assert r["cycles"] == [["tensorpar.a", "tensorpar.b"]] and r["imports_in_functions"] == 1
