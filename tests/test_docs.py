"""Every repository path the docs cite exists: in docs/*.md, README.md and bench/results/README.md, each path-like
reference (`brrr/engine/scheduler.py`, `tests/...`, `bench/...`, `docs/....md`, a module path relative to brrr/
such as `engine/llm.py`, a dotted `brrr.a.b.name`, a bare `name.py`, a local markdown link, a result file named
in bench/results/README.md) names something in the tree. A renamed or deleted module fails here with the doc and
the reference, so the docs follow the code."""
import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "bench" / "results" / "README.md"]
RESULTS = ROOT / "bench" / "results"

# A reference starts at one of the tree's top folders, or at a brrr subpackage (`engine/llm.py`), and is not the
# tail of a longer path or URL (no word character, `/`, `.` or `-` just before it).
PACKAGES = sorted(p.name for p in (ROOT / "brrr").iterdir() if (p / "__init__.py").exists())
PATH = re.compile(r"(?<![\w./~$-])((?:brrr|tests|bench|docs|" + "|".join(PACKAGES) + r")/[\w./{},*-]*)")
BARE = re.compile(r"(?<![\w./~$-])([A-Za-z_][\w-]*\.(?:py|sh|md))(?![\w/-])")
DOTTED = re.compile(r"(?<![\w./-])(brrr(?:\.[A-Za-z_]\w*)+)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
# Words that end like a file but are not the tree's: the command line, other projects' files.
NOT_OURS = {"setup.py", "KINDS.md"}


def expand(ref: str) -> list[str]:
    """`a_{x,y}.md` -> [a_x.md, a_y.md] (shell brace expansion, as the commands in the docs write it)."""
    parts = re.split(r"(\{[^{}]*\})", ref)
    options = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
    return ["".join(c) for c in itertools.product(*options)]


def clean(ref: str) -> str:
    """Drop what the sentence adds after a path: a trailing full stop, comma or colon, a pytest node id."""
    ref = ref.split("::")[0]
    return ref.rstrip(".,:;")


def module_exists(dotted: str) -> bool:
    """`brrr.a.b.name`: the longest module prefix is a package or a .py file, and the first name after it (if
    any) is defined or imported there."""
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
    return not rest or re.search(rf"\b{re.escape(rest[0])}\b", path.read_text()) is not None


def references(doc: Path) -> list[tuple[str, list[Path]]]:
    """(reference as written, the paths any one of which must exist) for every reference in one doc."""
    text = doc.read_text()
    found = []
    for m in PATH.finditer(text):
        ref = clean(m.group(1))
        if any(s in ref for s in ("*", "...")) or ref.endswith("/."):
            continue  # a glob or an elided path
        for one in expand(ref):
            top = one.split("/")[0]
            where = ROOT / one if top in ("brrr", "tests", "bench", "docs") else ROOT / "brrr" / one
            found.append((one, [where]))
    for m in BARE.finditer(text):
        name = m.group(1)
        if name in NOT_OURS:
            continue
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


def test_the_extraction_finds_what_it_should():
    """The patterns catch every spelling the docs use, and skip URLs, globs and placeholders."""
    sample = ROOT / "docs" / "engine.md"
    text = ("see `brrr/engine/scheduler.py`, engine/llm.py and [a](serving.md#x), brrr.engine.spec.verify.IDLE_ROUNDS,"
            " tp_step.py; not https://github.com/x/brrr/y.py, run/, data/, my-adapter, tests/train/test_d*.py,"
            " bench/results/summary_g{0,1}.md.")
    refs = []
    for pattern in (PATH, BARE, DOTTED, LINK):
        refs += [m.group(1) for m in pattern.finditer(text)]
    assert "brrr/engine/scheduler.py" in refs and "engine/llm.py" in refs and "serving.md#x" in refs
    assert "brrr.engine.spec.verify.IDLE_ROUNDS" in refs and "tp_step.py" in refs
    assert not any("github" in r or r in ("run/", "data/") for r in refs)
    assert expand("summary_g{0,1}.md") == ["summary_g0.md", "summary_g1.md"]
    assert clean("docs/engine.md.") == "docs/engine.md" and clean("tests/x.py::test_y") == "tests/x.py"
    assert module_exists("brrr.engine.scheduler.Scheduler") and not module_exists("brrr.engine.no_such_module.x")
    assert not module_exists("brrr.engine.scheduler.no_such_name_anywhere")
    assert sample.exists()
