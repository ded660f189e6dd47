"""The import rule of docs/architecture.md, read from the code: imports point one way, from the
command line down to the core, and the products never import each other."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "ddpkit"

# Lowest first: the folders of src/ddpkit (and its few top modules). A module may import its own
# layer and the layers before it.
LAYERS = {
    "core": {"core", "errors", "version", "models", "optim", "_moved"},
    "observe": {"observe"},
    "parallel": {"strategy", "checkpoint", "launcher"},
    "data": {"data"},
    "runtime": {"runtime"},
    "products": {"trainer", "tune", "bench", "plan"},
    "cli": {"cli", "__main__"},
}
RANK = {top: i for i, tops in enumerate(LAYERS.values()) for top in tops}
PRODUCTS = LAYERS["products"]


def _top(path: Path) -> str:
    """A file's room: its top-level module or package under ddpkit ('trainer' for trainer/plan.py)."""
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def _imported_tops(path: Path) -> set[str]:
    """The ddpkit rooms a file imports (relative or absolute), at any depth of the file."""
    here = path.relative_to(PACKAGE).parent.parts  # the package the file is in, below ddpkit
    tops = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: climb `level - 1` packages from the file's own
                base = here[: len(here) - (node.level - 1)]
                parts = [*base, *(node.module.split(".") if node.module else [])]
                names = [parts[0]] if parts else [alias.name for alias in node.names]
            elif node.module and node.module.split(".")[0] == "ddpkit":
                parts = node.module.split(".")[1:]
                names = [parts[0]] if parts else [alias.name for alias in node.names]
            else:
                continue
            tops.update(n for n in names if n in RANK)
        elif isinstance(node, ast.Import):
            tops.update(
                a.name.split(".")[1]
                for a in node.names
                if a.name.startswith("ddpkit.") and a.name.split(".")[1] in RANK
            )
    return tops


def _edges() -> list[tuple[str, str, str]]:
    files = [p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent != PACKAGE]
    return [(str(p.relative_to(PACKAGE)), _top(p), t) for p in files for t in _imported_tops(p) if t != _top(p)]


def test_every_room_has_a_layer():
    rooms = {_top(p) for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert rooms - {"__init__"} == set(RANK), "a module was added or removed: give it its layer here and in docs"


def test_imports_point_down_and_products_stay_apart():
    up = [f"{f} imports {t}" for f, top, t in _edges() if RANK[t] > RANK[top]]
    across = [f"{f} imports {t}" for f, top, t in _edges() if top in PRODUCTS and t in PRODUCTS]
    assert not up, "imports against the layers:\n" + "\n".join(up)
    assert not across, "products importing each other:\n" + "\n".join(across)


def test_the_rule_can_fail():
    # The reader sees relative imports at any depth: trainer/loop.py's `from ..runtime import`.
    assert "runtime" in _imported_tops(PACKAGE / "trainer" / "loop.py")
    assert "data" in _imported_tops(PACKAGE / "runtime" / "facade.py")


def _cycles(edges: list[tuple[str, str, str]]) -> list[list[str]]:
    """The rooms that import each other round a cycle (strongly connected, more than one)."""
    graph: dict[str, set[str]] = {}
    for _, top, to in edges:
        graph.setdefault(top, set()).add(to)
    order, low, stack, found, counter = {}, {}, [], [], [0]

    def visit(v: str) -> None:
        order[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            cycle = []
            while True:
                w = stack.pop()
                cycle.append(w)
                if w == v:
                    break
            if len(cycle) > 1:
                found.append(sorted(cycle))

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return found


def test_no_rooms_import_each_other_round_a_cycle():
    # Imports inside functions count: checkpoint <-> shards was a cycle hidden so.
    assert not _cycles(_edges()), _cycles(_edges())
    planted = [("a.py", "checkpoint", "shards"), ("b.py", "shards", "files"), ("c.py", "files", "checkpoint")]
    assert _cycles(planted) == [["checkpoint", "files", "shards"]]  # the check can fail


def _module(parts: list[str]) -> str | None:
    """The ddpkit module file that dotted `parts` (below ddpkit) name, or None."""
    path = PACKAGE.joinpath(*parts)
    if path.with_suffix(".py").is_file():
        return "/".join(parts) + ".py"
    if (path / "__init__.py").is_file():
        return "/".join([*parts, "__init__.py"])
    return None


def _module_edges() -> list[tuple[str, str, str]]:
    """(file, file, file it imports) for every import of a ddpkit module, at any depth of the
    file: `from .x import y` imports x (or x/y.py where y is a module)."""
    edges = []
    for path in PACKAGE.rglob("*.py"):
        here = path.relative_to(PACKAGE)
        package = list(here.parent.parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = [*package[: len(package) - (node.level - 1)], *(node.module.split(".") if node.module else [])]
            elif node.module and node.module.split(".")[0] == "ddpkit":
                base = node.module.split(".")[1:]
            else:
                continue
            for alias in node.names:
                target = _module([*base, alias.name]) or _module(base)
                if target and target != str(here):
                    edges.append((str(here), str(here), target))
    return edges


def test_no_modules_import_each_other_round_a_cycle():
    # Within a folder too: a cycle hidden by an import inside a function is still a cycle.
    edges = _module_edges()
    assert ("checkpoint/state.py", "checkpoint/state.py", "checkpoint/shards.py") in edges  # the reader sees them
    assert not _cycles(edges), _cycles(edges)


MARKER = "# Imports inside functions:"  # a module-level comment that says why, for all of its own


def _unexplained_late_imports(path: Path) -> list[str]:
    """The imports inside functions of `path` that say nothing of why they are there: a comment
    on the import's line, or on the line above the run of imports it is in, or the module's
    MARKER comment."""
    text = path.read_text()
    lines = text.splitlines()
    if any(line.startswith(MARKER) for line in lines):
        return []
    found = []
    for fn in ast.walk(ast.parse(text)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or "#" in lines[node.end_lineno - 1]:
                continue
            above = node.lineno - 2  # up over the imports (and their continuation lines) before it
            while above >= 0 and (
                lines[above].strip().startswith(("import ", "from ", ")"))
                or lines[above].startswith(" " * (node.col_offset + 4))
            ):
                above -= 1
            if above < 0 or not lines[above].strip().startswith("#"):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return found


def test_imports_inside_functions_say_why():
    late = [line for path in sorted(PACKAGE.rglob("*.py")) for line in _unexplained_late_imports(path)]
    assert not late, "an import inside a function, with no comment saying why it is not at the top:\n" + "\n".join(late)


OLD_PATHS = """
import importlib, warnings
import ddpkit
from ddpkit._moved import MOVED

def said(do):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        found = do()
    return found, [str(w.message) for w in seen if issubclass(w.category, DeprecationWarning) and "ddpkit." in str(w.message)]

found, messages = said(lambda: __import__("ddpkit", fromlist=["gather"]).gather)  # from ddpkit import gather
assert found is importlib.import_module("ddpkit.runtime.gather") and len(messages) == 1, messages
for old, new in MOVED.items():
    module, messages = said(lambda: importlib.import_module(f"ddpkit.{old}"))
    assert module is importlib.import_module(f"ddpkit.{new}"), old
    assert module.__spec__.name == module.__name__ == f"ddpkit.{new}", old
    if old != "gather":
        assert messages == [f"ddpkit.{old} is now ddpkit.{new}; the old path goes in the next release"], messages
runtime = importlib.import_module("ddpkit.runtime")
_, messages = said(lambda: (importlib.import_module("ddpkit.checkpoint").load_file, [getattr(runtime, n) for n in
    ("Runtime", "DEVICES", "resolve_device", "seed_everything", "seed_rank")]))
assert messages == [], messages  # the packages keep what their modules exported
wait, messages = said(lambda: runtime.PENDING_WAIT_S)  # a constant now beside, said so
assert wait == 600.0 and messages == ["ddpkit.runtime.PENDING_WAIT_S is now ddpkit.runtime.saves.PENDING_WAIT_S"], messages
reader, messages = said(lambda: importlib.import_module("ddpkit.metrics").peak_rss_mib)  # the memory readers too
assert reader is importlib.import_module("ddpkit.core.memory").peak_rss_mib, reader
assert messages == ["ddpkit.observe.metrics.peak_rss_mib is now ddpkit.core.memory.peak_rss_mib"], messages
print(len(MOVED))
"""


def test_the_paths_of_ddpkit_0_1_still_import_each_with_a_deprecation_warning():
    import subprocess
    import sys

    from ddpkit._moved import MOVED

    proc = subprocess.run([sys.executable, "-c", OLD_PATHS], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == str(len(MOVED)), proc.stderr[-2000:]
    assert {f"ddpkit.{new}".rsplit(".", 1)[0] for new in MOVED.values()} == {
        "ddpkit.core", "ddpkit.observe", "ddpkit.checkpoint", "ddpkit.runtime"
    }  # fmt: skip


def test_no_module_of_the_package_imports_an_old_path():
    # An old path works (with a warning) through _moved: inside the package it would go unnoticed.
    from ddpkit._moved import MOVED

    old = []
    for path in PACKAGE.rglob("*.py"):
        package = list(path.relative_to(PACKAGE).parent.parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - (node.level - 1)] if node.level else None
                parts = [*base, *(node.module.split(".") if node.module else [])] if node.level else None
                if not node.level and node.module and node.module.split(".")[0] == "ddpkit":
                    parts = node.module.split(".")[1:]
                if parts is None:
                    continue
                names = parts[:1] if parts else [a.name for a in node.names]
                old += [f"{path.relative_to(PACKAGE)}:{node.lineno}" for n in names if n in MOVED]
            elif isinstance(node, ast.Import):
                old += [
                    f"{path.relative_to(PACKAGE)}:{node.lineno}"
                    for a in node.names
                    if a.name.split(".")[1:2] and a.name.split(".")[0] == "ddpkit" and a.name.split(".")[1] in MOVED
                ]
    assert not old, old
