"""The strategy is the one place a parallelism lives. Nothing outside strategy/ (and bench/ and
plan/, which measure and plan each strategy's layouts) tests a strategy's name or type: what differs between them is a
strategy's own attribute or method. A new strategy is one module and one registry entry: a
test's own strategy below trains, evaluates and resumes through the Runtime."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit import strategy as strategies
from ddpkit.strategy import Strategy

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "ddpkit"
# the strategies themselves, the benchmarks of each, and the planner, which lists and costs each
# layout by its strategy's name as the benchmarks do (its traces split the model by the
# strategy's own `split`)
OWN = ("strategy", "bench", "plan")
TYPES = {"DistributedDataParallel", "DataParallel", "FullyShardedDataParallel", "FSDPModule", "FSDP", "DDP", "Single"}
MODULES = {"ddp", "dp", "fsdp", "single"}  # strategy/'s modules of one strategy each
SOURCE = re.compile(r"(\bsource|\[.source.\])$")  # a launch environment's source ("single") is no strategy


def _names_in(node: ast.AST) -> set[str]:
    """String constants in `node`, itself or in a tuple, list, set or dict's keys."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(set(), *map(_names_in, node.elts))
    if isinstance(node, ast.Dict):
        return set().union(set(), *(_names_in(k) for k in node.keys if k is not None))
    return set()


def _mentions_type(node: ast.AST) -> bool:
    """Whether `node` names a strategy's wrapper type (nn.parallel.DistributedDataParallel, ...)."""
    return any(
        (isinstance(n, ast.Name) and n.id in TYPES) or (isinstance(n, ast.Attribute) and n.attr in TYPES)
        for n in ast.walk(node)
    )


def branches(path: Path, root: Path = PACKAGE) -> list[str]:
    """Lines of `path` that test a strategy's name or type, or reach one strategy's module: a
    comparison, membership, `match` case, dict key or startswith against a strategy's name (or
    a name bound to a collection of them), isinstance/issubclass/type() against a wrapper
    type, and an import of (or attribute path through) strategy.ddp, .dp, .fsdp or .single."""
    tree = ast.parse(path.read_text())
    names = set(strategies.REGISTRY)
    found: list[str] = []
    collections = set()  # module names bound to collections of strategy names
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            value = node.value
            if not isinstance(value, ast.Constant) and _names_in(value) & names:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                collections |= {ast.unparse(t) for t in targets}

    def say(node: ast.AST, what: str = "") -> None:
        found.append(f"{path.relative_to(root)}:{getattr(node, 'lineno', '?')}: {what or ast.unparse(node)}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(SOURCE.search(ast.unparse(o)) for o in operands):
                continue
            named = set().union(*map(_names_in, operands)) & names
            if named or any(ast.unparse(o) in collections for o in operands):
                say(node)
            elif any(isinstance(o, ast.Call) and ast.unparse(o.func) == "type" for o in operands) and (
                any(_mentions_type(o) for o in operands) or set().union(*map(_names_in, operands)) & TYPES
            ):
                say(node)
            elif set().union(*map(_names_in, operands)) & TYPES:
                say(node)
        elif isinstance(node, ast.Call):
            func = ast.unparse(node.func)
            if func in ("isinstance", "issubclass") and len(node.args) == 2 and _mentions_type(node.args[1]):
                say(node)
            elif func.endswith((".startswith", ".endswith")) and set().union(*map(_names_in, node.args)) & names:
                say(node)
        elif isinstance(node, ast.match_case) and isinstance(node.pattern, ast.MatchValue):
            if _names_in(node.pattern.value) & names:
                say(node.pattern, f"case {ast.unparse(node.pattern)}")
        elif isinstance(node, ast.Dict) and _names_in(node) & names:
            say(node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            if not isinstance(node.value, ast.Constant) and _names_in(node.value) & names:
                say(
                    node,
                    f"{ast.unparse(node.targets[0] if isinstance(node, ast.Assign) else node.target)}: strategy names",
                )
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if (
                module.rsplit(".", 1)[-1] in MODULES
                and "strategy" in module
                or (module.endswith("strategy") and {a.name for a in node.names} & MODULES)
            ):
                say(node, f"from {module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Import):
            if any(a.name.split(".")[-1] in MODULES and ".strategy." in a.name for a in node.names):
                say(node)
        elif isinstance(node, ast.Attribute) and node.attr in MODULES:
            if ast.unparse(node.value).endswith(("strategy", "strategies")):
                say(node)
    return sorted(set(found), key=lambda line: int(line.split(":")[1]) if line.split(":")[1].isdigit() else 0)


def test_no_module_outside_the_strategies_tests_a_strategys_name_or_type():
    files = [p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] not in OWN]
    found = [line for path in sorted(files) for line in branches(path)]
    assert not found, "a strategy's name or type tested outside strategy/:\n" + "\n".join(found)


def test_the_check_finds_each_kind_of_branch(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from .strategy.fsdp import is_sharded\n"  # 1
        "from .strategy import fsdp\n"  # 2
        "if rt.strategy == 'fsdp': pass\n"  # 3
        "if cfg.strategy in ('dp', 'single'): pass\n"  # 4
        "if isinstance(m, nn.parallel.DistributedDataParallel): pass\n"  # 5
        "if env.source != 'single': pass\n"  # 6: not a strategy, not found
        "ONE = ('dp', 'single')\n"  # 7
        "if cfg.strategy in ONE: pass\n"  # 8
        "match rt.strategy:\n"  # 9
        "    case 'fsdp': pass\n"  # 10
        "x = {'fsdp': 1}[rt.strategy]\n"  # 11
        "if rt.strategy.startswith('fsdp'): pass\n"  # 12
        "if type(m) is DistributedDataParallel: pass\n"  # 13
        "if type(m).__name__ == 'FullyShardedDataParallel': pass\n"  # 14
        "import ddpkit.strategy.fsdp\n"  # 15
        "strategies.fsdp.is_sharded(m)\n"  # 16
        "if self.resources.strategy == 'fsdp': pass\n"  # 17
        "strategy: str = 'ddp'\n"  # 18: a default, not a test: not found
    )
    lines = sorted({int(line.split(":")[1]) for line in branches(planted, tmp_path)})
    assert lines == [1, 2, 3, 4, 5, 7, 8, 10, 11, 12, 13, 14, 15, 16, 17], branches(planted, tmp_path)


class Mirror(Strategy):
    """A test's own parallelism, as a contributor would add one: the bare model, with its
    wrapper marking the model; registered under its name, nothing else touched."""

    name = "mirror"

    def _wrap(self, model: nn.Module) -> nn.Module:
        model.wrapped_by = self.name
        return model


@pytest.fixture
def mirror():
    strategies.register(Mirror)
    yield Mirror
    del strategies.REGISTRY[Mirror.name]


def _run(name: str, data, path, resume: bool = False) -> tuple[dict, torch.Tensor]:
    """Two epochs (the first saved, or with `resume` loaded) under strategy `name`: the
    evaluation and the weights at the end."""
    with ddpkit.Runtime(name, device="cpu", seed=1) as rt:
        model = rt.build(lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)))
        model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        assert rt.strategy == name and getattr(model, "wrapped_by", "single") == name
        loader = rt.loader(data, batch_size=8)
        epochs = 2
        if resume:
            rt.load_state(path)
            epochs = 1
        for epoch in range(epochs):
            for x, y in loader:
                rt.backward(nn.functional.cross_entropy(model(x), y))
                rt.step(opt)
            if epoch == 0 and not resume:
                rt.save_state(path)
        return rt.evaluate(model, data), torch.cat([p.detach().flatten() for p in model.parameters()])


def test_a_new_strategy_is_one_class_and_one_registry_entry(mirror, tmp_path):
    # Trained, evaluated, saved and resumed through the Runtime, it ends as single does (the
    # same bare model: the defaults of a Strategy carry it), and its resume ends bit-identical.
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(24, 4), torch.randint(0, 3, (24,)))
    single = _run("single", data, tmp_path / "single.pt")
    straight = _run("mirror", data, tmp_path / "mirror.pt")
    resumed = _run("mirror", data, tmp_path / "mirror.pt", resume=True)
    assert straight[0] == single[0] and torch.equal(straight[1], single[1])
    assert resumed[0] == straight[0] and torch.equal(resumed[1], straight[1])
    assert "mirror" in strategies.names() and strategies.by_name("mirror") is Mirror
    with pytest.raises(ddpkit.UsageError, match="--strategy mirror on 2 processes would train 2 unsynchronized"):
        Mirror.runs_as(2, torch.device("cpu"))  # a strategy that keeps no copies in step: one process


def test_a_strategy_names_itself_and_takes_no_others_name():
    class Unnamed(Strategy):
        pass

    class Impostor(Strategy):
        name = "ddp"

    class Careless(Strategy):  # sharded, but which models are its own it does not say
        name = "careless"
        sharded = True

    for cls, says in ((Unnamed, "names itself"), (Impostor, "'ddp' is taken"), (Careless, "says which models")):
        with pytest.raises(ValueError, match=says):
            strategies.register(cls)
    assert strategies.REGISTRY["single"].__name__ == "Single" and strategies.REGISTRY["ddp"].__name__ == "DDP"
    assert "careless" not in strategies.REGISTRY and strategies.sharded_by(torch.nn.Linear(1, 1)) is None
