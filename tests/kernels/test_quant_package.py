"""brrr/kernels/quant's shape: no import cycle among its modules, no import of brrr.bench or brrr.quant (kernels sit
below both), no module over 600 lines, and the environment read only once, at import (Triton's interpreter)."""
import ast
import pathlib

import brrr.kernels.quant

PACKAGE = pathlib.Path(brrr.kernels.quant.__file__).parent


def _imports(path: pathlib.Path) -> set[str]:
    """Every module a file imports, at any depth (the kernels import theirs under `if triton is not None`)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.update(f"{node.module}.{a.name}" for a in node.names)
            out.add(node.module)
    return out


def test_no_import_cycle_and_nothing_from_bench_or_quant():
    files = {f"brrr.kernels.quant.{f.stem}": f for f in PACKAGE.glob("*.py") if f.stem != "__init__"}
    graph = {name: {m for m in _imports(f) if m in files and m != name} for name, f in files.items()}
    for name, f in files.items():
        upward = {m for m in _imports(f) if m in ("brrr.bench", "brrr.quant")
                  or m.startswith(("brrr.bench.", "brrr.quant.", "brrr.engine", "brrr.models"))}
        assert upward == set(), name

    def reaches(start, goal, seen):
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph[start])

    assert [name for name in graph if reaches(name, name, set())] == []


def test_modules_stay_small_and_read_the_environment_once():
    for f in PACKAGE.glob("*.py"):
        text = f.read_text()
        assert len(text.splitlines()) <= 600, f.name
        assert text.count("os.environ") == (1 if f.name == "launch.py" else 0), f.name
