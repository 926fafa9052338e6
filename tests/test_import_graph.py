"""brrr's modules import one another without cycles and in one direction, counting every import: at module level,
under `if`/`try`, and inside functions (a deferred import is still a dependency; deferring one only hides a cycle
from Python).

The direction is LAYERS below, lowest first: a module imports from its own layer or a lower one. An import inside a
function is for an optional dependency or a start-up cost only, and says which on its line or the line above."""
import ast
import re
from dataclasses import dataclass
from pathlib import Path

import brrr

ROOT = Path(brrr.__file__).parent.parent

# Lowest first. A unit is a module or a package (with everything under it that no longer unit names); the modules
# named `cli` or `*_cli` anywhere (each package's subcommands, registered by brrr.cli) form the top layer with
# brrr.cli and the benchmarks.
LAYERS = [
    ("brrr.errors",),
    ("brrr.gguf",),                # GGUF metadata, tokenizer, block codecs and writer (gguf package + torch only)
    ("brrr.config", "brrr.presets", "brrr.sampling_params", "brrr.tokenizer", "brrr.token_data", "brrr.progress",
     "brrr.state_dict", "brrr.default_model", "brrr.hub", "brrr.threads", "brrr.cache_dir"),
    ("brrr.kernels",),
    ("brrr.analysis",),            # every FLOP, byte and formula, over ModelConfig
    ("brrr.models",),              # the reference forms (HF module names and GEMM shapes)
    ("brrr.quant",),
    ("brrr.prune",),               # magnitude, Wanda, SparseGPT over quant's calibration and Hessians; 2:4 modules
    ("brrr.loader", "brrr.gguf.load", "brrr.gguf.export"),  # checkpoints in and out, quantized and GGUF ones
    ("brrr.lora",),
    ("brrr.serving_form",),        # prepare_for_serving: packs projections over quant's and lora's modules
    ("brrr.engine",),              # the engine core: scheduler, runner, sampler, spec, guided, output processor
    ("brrr.generate", "brrr.pretrained"),  # reference generation (the engine's sampler) and the loaded model
    ("brrr.distributed",),         # tensor parallelism and disaggregation, over the engine core
    ("brrr.engine.build", "brrr.engine.llm", "brrr.engine.async_llm", "brrr.engine.engine_process",
     "brrr.engine.engine_process_client", "brrr.engine.engine_process_warmup", "brrr.engine.__init__"),
    # the frontends: they build engines (build_engine), TP and disaggregation included
    ("brrr.__init__",),            # `import brrr`: the public names
    ("brrr.server", "brrr.train", "brrr.evals"),  # brrr.evals: long-context perplexity and needle retrieval
    ("brrr.bench", "cli"),
]

# Upward imports still to remove, each with where it goes. The test fails on any other, and on an entry here that no
# longer happens: delete it when its import goes.
ALLOWED_UPWARD: set[str] = set()

# Imports of brrr modules inside functions, without a reason comment, in the packages being restructured now (issue
# 54); lower a count as its imports move to module level, and drop the package at 0.
UNEXPLAINED_DEFERRED = {"brrr.distributed": 18, "brrr.train": 23, "brrr.server": 11}


@dataclass(frozen=True)
class Import:
    module: str     # the importing module
    target: str     # the brrr module imported
    path: Path
    line: int       # where the statement starts
    end_line: int
    in_function: bool


def modules(root: Path = ROOT) -> dict[str, Path]:
    found = {}
    for path in (root / "brrr").rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(root: Path = ROOT) -> list[Import]:
    """Every import of a brrr module (`from a.b import c` is a.b.c when that is a module, else a.b)."""
    mods, found = modules(root), []
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]

        def visit(node, in_function):
            for child in ast.iter_child_nodes(node):
                targets = []
                if isinstance(child, ast.Import):
                    targets = [a.name for a in child.names if a.name in mods]
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:
                        up = package.split(".")[: len(package.split(".")) - child.level + 1]
                        base = ".".join(up + ([child.module] if child.module else []))
                    targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in child.names]
                for target in dict.fromkeys(targets):
                    if target in mods and target != name:
                        found.append(Import(name, target, path, child.lineno, child.end_lineno, in_function))
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

        visit(ast.parse(path.read_text(), str(path)), False)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the brrr modules it imports."""
    graph = {name: set() for name in modules(root)}
    for imp in imports(root):
        graph[imp.module].add(imp.target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def unit(module: str, path: Path | None = None) -> str | None:
    """The LAYERS unit a module belongs to: `cli` for the subcommand modules, else the longest unit that is the
    module or a package above it (a package's own __init__ is `<package>.__init__` where a unit names that)."""
    last = module.rpartition(".")[2]
    if module == "brrr.__main__" or last == "cli" or last.endswith("_cli"):
        return "cli"
    names = {u for layer in LAYERS for u in layer}
    if path is not None and path.name == "__init__.py" and f"{module}.__init__" in names:
        return f"{module}.__init__"
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        if ".".join(parts[:n]) in names:
            return ".".join(parts[:n])
    return None


def layer(module: str) -> int:
    mods = modules()
    u = unit(module, mods.get(module))
    return next(i for i, names in enumerate(LAYERS) if u in names)


def upward_imports(found: list[Import]) -> set[str]:
    return {f"{imp.module} -> {imp.target}" for imp in found if layer(imp.module) < layer(imp.target)}


def reason(imp: Import, lines: list[str]) -> str | None:
    """The comment on a deferred import's lines, or on the comment line above the imports it heads; `noqa` is none."""
    def comment(text: str) -> str:
        return re.sub(r"noqa(: *[A-Z0-9, ]+)?", "", text.partition("#")[2]).strip(" ()") if "#" in text else ""

    own = " ".join(comment(text) for text in lines[imp.line - 1:imp.end_line]).strip()
    if own:
        return own
    above = imp.line - 2
    while above >= 0 and lines[above].lstrip().startswith(("from ", "import ")):
        above -= 1
    return (comment(lines[above]) or None) if above >= 0 and lines[above].lstrip().startswith("#") else None


def unexplained_deferred(found: list[Import]) -> list[Import]:
    cache: dict[Path, list[str]] = {}
    return [imp for imp in found if imp.in_function
            and not reason(imp, cache.setdefault(imp.path, imp.path.read_text().splitlines()))]


def test_the_graph_sees_deferred_imports_and_finds_a_cycle(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert "brrr.quant.checkpoint" in import_graph()["brrr.loader"]
    (tmp_path / "brrr" / "sub").mkdir(parents=True)
    (tmp_path / "brrr" / "__init__.py").write_text("")
    (tmp_path / "brrr" / "sub" / "__init__.py").write_text("")
    (tmp_path / "brrr" / "low.py").write_text("X = 1\n")
    (tmp_path / "brrr" / "sub" / "high.py").write_text(
        "def f():\n    # the reason\n    from brrr import low\n    x = 1\n    from .. import low as again  # noqa: F401\n")
    found = imports(tmp_path)
    assert [(i.module, i.target, i.line, i.in_function) for i in found] == [
        ("brrr.sub.high", "brrr.low", 3, True), ("brrr.sub.high", "brrr.low", 5, True)]
    assert [i.line for i in unexplained_deferred(found)] == [5]  # a bare noqa is no reason


def test_brrr_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_every_module_has_a_layer():
    mods = modules()
    assert [m for m, path in mods.items() if unit(m, path) is None] == []
    assert unit("brrr.engine", mods["brrr.engine"]) == "brrr.engine.__init__"
    assert unit("brrr.engine.spec.verify") == "brrr.engine" and unit("brrr.train.finetune_cli") == "cli"
    assert layer("brrr.engine.llm") > layer("brrr.distributed.tp_runner") > layer("brrr.engine.llm_engine")


def test_imports_follow_the_layers():
    found = upward_imports(imports())
    assert sorted(found - ALLOWED_UPWARD) == [], "imports up the layers (LAYERS in this file says the order)"
    assert sorted(ALLOWED_UPWARD - found) == [], "gone: remove these from ALLOWED_UPWARD"


def test_runtime_never_imports_the_benchmarks():
    assert sorted({f"{imp.module} -> {imp.target}" for imp in imports() if imp.target.startswith("brrr.bench")
                   and not imp.module.startswith("brrr.bench")}) == []


def test_deferred_imports_say_why():
    """A brrr import inside a function carries its reason (an optional dependency, a start-up cost) as a comment;
    the packages in UNEXPLAINED_DEFERRED have a count still to work down."""
    counts = dict.fromkeys(UNEXPLAINED_DEFERRED, 0)
    rest = []
    for imp in unexplained_deferred(imports()):
        package = ".".join(imp.module.split(".")[:2])
        if package in counts:
            counts[package] += 1
        else:
            rest.append(f"{imp.path.relative_to(ROOT)}:{imp.line} {imp.module} -> {imp.target}")
    assert rest == [], "move these imports to module level, or say on the line why they wait"
    assert counts == UNEXPLAINED_DEFERRED, "UNEXPLAINED_DEFERRED holds each package's count: update it"
