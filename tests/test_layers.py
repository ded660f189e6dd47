"""The import rule of docs/architecture.md, read from the code: imports point one way, from the
command line down to the core, and the products never import each other."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "ddpkit"

# Lowest first. A module may import its own layer and the layers before it.
LAYERS = {
    "core": {
        "errors",
        "version",
        "allocator",
        "checks",
        "files",
        "tree",
        "device",
        "seed",
        "draws",
        "threads",
        "dist",
        "log",
        "tracking",
        "metrics",
        "timeline",
        "plots",
        "plotter",
        "optim",
        "models",
        "env",
        "precision",
        "strategy",
        "ema",
        "shards",
        "checkpoint",
        "launcher",
    },
    "data": {"data"},
    "facade": {"runtime", "accumulation", "evaluation", "gather", "early_stopping"},
    "products": {"trainer", "tune", "bench", "report"},
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
    assert "data" in _imported_tops(PACKAGE / "runtime.py")


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
