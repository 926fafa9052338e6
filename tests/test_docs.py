"""Every repository path the docs cite exists: in docs/*.md, README.md and bench/results/README.md, each path-like
reference (`brrr/engine/scheduler.py`, `tests/...`, `bench/...`, `docs/....md`, a module path relative to brrr/
such as `engine/llm.py`, a dotted `brrr.a.b.name`, a bare `name.py`, a local markdown link, a result file named
in bench/results/README.md) names something in the tree. A renamed or deleted module fails here with the doc and
the reference, so the docs follow the code."""
import ast
import itertools
import re
from pathlib import Path

from brrr.presets import PRESETS
from brrr.train.shapes import SHAPES

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "bench" / "results" / "README.md"]
RESULTS = ROOT / "bench" / "results"

# A reference starts at one of the tree's top folders or a brrr subpackage (`engine/llm.py`), or is any relative
# path to a .py or .sh file (so a renamed package is still caught), and is not the tail of a longer path or URL (no
# word character, `/`, `.` or `-` just before it).
PACKAGES = sorted(p.name for p in (ROOT / "brrr").iterdir() if (p / "__init__.py").exists())
PATH = re.compile(r"(?<![\w./~$-])((?:brrr|tests|bench|docs|" + "|".join(PACKAGES) + r")/[\w./{},*-]*"
                  r"|[A-Za-z_][\w-]*/[\w./-]*\.(?:py|sh)(?![\w/-]))")
BARE = re.compile(r"(?<![\w./~$-])([A-Za-z_][\w-]*\.(?:py|sh|md))(?![\w/-])")
DOTTED = re.compile(r"(?<![\w./-])(brrr(?:\.[A-Za-z_]\w*)+)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
# Paths the docs name that are not the tree's: a standard-library file an example uses.
NOT_OURS = {"json/decoder.py"}


def expand(ref: str) -> list[str]:
    """`a_{x,y}.md` -> [a_x.md, a_y.md] (shell brace expansion, as the commands in the docs write it)."""
    parts = re.split(r"(\{[^{}]*\})", ref)
    options = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
    return ["".join(c) for c in itertools.product(*options)]


def clean(ref: str) -> str:
    """Drop what the sentence adds after a path: a trailing full stop, comma or colon, a pytest node id."""
    ref = ref.split("::")[0]
    return ref.rstrip(".,:;")


def bound_names(path: Path) -> set[str]:
    """The names a module binds at its top level: definitions, assignments, imports (what `module.name` reaches)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def module_exists(dotted: str) -> bool:
    """`brrr.a.b.name`: the longest module prefix is a package or a .py file, and the first name after it (if
    any) is bound at the top level there (a package's submodule counts only if it exists)."""
    parts = dotted.split(".")
    path = ROOT
    for i, part in enumerate(parts):
        if (path / part).is_dir() and (path / part / "__init__.py").exists():
            path = path / part
            continue
        if (path / f"{part}.py").exists():
            path, rest = path / f"{part}.py", parts[i + 1:]
        else:
            path, rest = path / "__init__.py", parts[i:]
        break
    else:
        return True
    return not rest or rest[0] in bound_names(path)


def scope_start(text: str, at: int) -> tuple[int, str]:
    """Where the paragraph, list item or table row holding `at` begins, and a table row's first `name` (or "")."""
    start = text.rfind("\n", 0, at) + 1
    while True:
        line = text[start:text.find("\n", start)]
        if re.match(r"\s*(\||[-*] |\d+\. )", line):
            first = re.match(r"\| `([^`]+)`", line)
            return start, first.group(1) if first else ""
        previous = text.rfind("\n", 0, max(start - 1, 0)) + 1
        if start == 0 or not text[previous:start].strip():
            return start, ""
        start = previous


def tree_path(ref: str) -> Path:
    """A top folder's path from the root; any other (`engine/llm.py`) inside brrr/."""
    return ROOT / ref if ref.split("/")[0] in ("brrr", "tests", "bench", "docs") else ROOT / "brrr" / ref


def references(doc: Path) -> list[tuple[str, list[Path]]]:
    """(reference as written, the paths any one of which must exist) for every reference in one doc."""
    text = doc.read_text()
    found, paths = [], []
    for m in PATH.finditer(text):
        ref = clean(m.group(1))
        if any(s in ref for s in ("*", "...")) or ref.endswith("/.") or ref in NOT_OURS:
            continue  # a glob, an elided path, not the tree's
        paths.append((m.start(), ref))
        for one in expand(ref):
            found.append((one, [tree_path(one)]))
    for m in BARE.finditer(text):
        name = m.group(1)
        # A bare module or script name belongs to the folder its paragraph, list item or table row last named ("Code:
        # `brrr/distributed/`: sharding.py, ..."); with none named there, to any folder of the tree. In the results
        # README a row's bare names may also be files of the row's own result folder.
        scope, row = scope_start(text, m.start())
        before = [ref for at, ref in paths if scope <= at < m.start()]
        if before and not name.endswith(".md"):  # a page name means a page (docs/ or beside the doc)
            folder = tree_path(before[-1])
            folder = folder.parent if folder.suffix and not before[-1].endswith("/") else folder
            own = [RESULTS / row / name] if doc == RESULTS / "README.md" and row else []
            found.append((f"{name} (in {before[-1]})", [folder / name] + own))
        else:
            found.append((name, [doc.parent / name, ROOT / name, ROOT / "docs" / name]
                          + [p for p in ROOT.glob(f"[bt]*/**/{name}") if ".git" not in p.parts]))
    for m in DOTTED.finditer(text):
        dotted = m.group(1).rstrip(".")
        found.append((dotted, [] if not module_exists(dotted) else [ROOT]))
    for m in LINK.finditer(text):
        target = m.group(1).split("#")[0]
        if not target or re.match(r"[a-z]+:", target):
            continue  # an anchor in the page, or a URL
        found.append((target, [doc.parent / target]))
    return found


def result_files() -> list[tuple[str, list[Path]]]:
    """bench/results/README.md's table: each row's first cell names a file or folder of bench/results/, and the
    names in parentheses after a folder are inside it."""
    found = []
    for line in (RESULTS / "README.md").read_text().splitlines():
        if not line.startswith("| `"):
            continue
        cell = line.split("|")[1]
        names = re.findall(r"`([^`]+)`", cell)
        first = names[0]
        for one in expand(first):
            found.append((one, [RESULTS / one]))
        for name in names[1:]:
            for one in expand(name):
                found.append((f"{first}{one}", [RESULTS / first / one]))
    return found


def test_every_path_a_doc_cites_exists():
    missing = []
    for doc in DOCS:
        for ref, candidates in references(doc):
            if not any(p.exists() for p in candidates):
                missing.append(f"{doc.relative_to(ROOT)}: {ref}")
    for ref, candidates in result_files():
        if not any(p.exists() for p in candidates):
            missing.append(f"bench/results/README.md (table): {ref}")
    print("\n".join(missing))
    assert not missing, f"{len(missing)} references to paths that do not exist:\n" + "\n".join(missing)


def test_every_result_file_is_in_the_results_readme():
    listed = {ref.split("/")[0].rstrip("/") for ref, _ in result_files()}
    unlisted = sorted(p.name for p in RESULTS.iterdir() if p.name != "README.md" and p.name not in listed)
    print("\n".join(unlisted))
    assert not unlisted, f"bench/results/ holds files its README does not list: {unlisted}"


def test_the_extraction_finds_what_it_should(tmp_path):
    """Every spelling the docs use is found and resolved where it points; URLs, globs and placeholders are not."""
    (tmp_path / "other.md").write_text("")
    doc = tmp_path / "page.md"
    doc.write_text("Code: `brrr/distributed/`: tp_step.py, sharding.py.\n\n"
                   "See `brrr/engine/scheduler.py`, engine/llm.py, [a](other.md#x), brrr.engine.spec.verify.IDLE_ROUNDS,\n"
                   "bench/results/summary_g{0,1}.md. Not https://github.com/x/brrr/y.py, run/, data/, my-adapter,\n"
                   "tests/train/test_d*.py, `brrr/.../x.py`.\n\n"
                   "- **Verify** (llm_engine.py)\n")
    refs = dict(references(doc))
    assert set(refs) == {"brrr/distributed/", "tp_step.py (in brrr/distributed/)", "sharding.py (in brrr/distributed/)",
                         "brrr/engine/scheduler.py", "engine/llm.py", "other.md", "brrr.engine.spec.verify.IDLE_ROUNDS",
                         "bench/results/summary_g0.md", "bench/results/summary_g1.md", "llm_engine.py"}
    assert refs["tp_step.py (in brrr/distributed/)"] == [ROOT / "brrr" / "distributed" / "tp_step.py"]
    assert refs["engine/llm.py"] == [ROOT / "brrr" / "engine" / "llm.py"]
    assert ROOT / "brrr" / "engine" / "llm_engine.py" in refs["llm_engine.py"]
    assert clean("docs/engine.md.") == "docs/engine.md" and clean("tests/x.py::test_y") == "tests/x.py"
    assert module_exists("brrr.engine.scheduler.Scheduler") and not module_exists("brrr.engine.no_such_module.x")
    assert not module_exists("brrr.engine.scheduler.no_such_name") and not module_exists("brrr.models.no_such.x")


# the flags whose values are files or directories a command reads, unless they name a preset or training shape
NAMED_SHAPES = set(PRESETS) | set(SHAPES)
INPUT_FLAGS = {"--data", "--calib", "--model", "--models", "--target", "--adapter", "--dataset-path", "--config"}


def readme_commands(text: str) -> list[str]:
    """The README's shell commands in order: ```bash blocks, continuation lines joined, comments dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [line.split("   #")[0].split("  #")[0].strip() for line in lines if line.strip() and
            not line.lstrip().startswith("#")]


def unmade_inputs(commands: list[str]) -> list[str]:
    """Files a command reads that no earlier command writes (`> FILE`, `--out FILE`) and the tree does not hold;
    commands on the reader's own files (a `~/` path) are theirs to bring."""
    made, missing = set(), []
    for command in commands:
        words = command.split()
        if "brrr" in words[:3] and not any(w.startswith("~/") for w in words):
            reading = None
            for w in words:
                if w.startswith("-"):
                    reading = w if w in INPUT_FLAGS else None
                elif reading and re.fullmatch(r"[\w./-]+", w) and w.rstrip("/") not in made \
                        and not (ROOT / w).exists() and w not in NAMED_SHAPES:
                    missing.append(f"{w} in: {command}")
        made |= {m.rstrip("/") for m in re.findall(r"(?:>|--out)\s+([\w./-]+)", command)}
    return missing


def test_the_readme_commands_make_the_files_they_read():
    """A command the README runs on the shipped model reads only files the README made before it (calib.txt,
    eval.txt, data/, run/) or the tree's own (brrr/assets/default-model)."""
    commands = readme_commands((ROOT / "README.md").read_text())
    assert any("eval compare" in c for c in commands) and any("--calib calib.txt" in c for c in commands)
    missing = unmade_inputs(commands)
    assert not missing, "\n".join(missing)
    assert unmade_inputs(["cat x > a.txt", "brrr q --calib a.txt --out q", "brrr e --models q --data b.txt"]) == \
        ["b.txt in: brrr e --models q --data b.txt"]
