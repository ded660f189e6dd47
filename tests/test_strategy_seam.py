"""The strategy is the one place a parallelism lives. Nothing outside strategy/ (and bench/, the
benchmarks of each strategy) tests a strategy's name or type: what differs between them is a
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
OWN = ("strategy", "bench")  # the strategies themselves, and the benchmarks of each
TYPES = {"DistributedDataParallel", "DataParallel", "FSDPModule", "FSDP", "DDP", "Single"}


def _names_in(node: ast.AST) -> set[str]:
    """String constants in `node`, itself or in a tuple, list or set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*map(_names_in, node.elts))
    return set()


def branches(path: Path, root: Path = PACKAGE) -> list[str]:
    """Lines of `path` that test a strategy's name or type, or import one strategy's module."""
    tree = ast.parse(path.read_text())
    found = []
    names = set(strategies.REGISTRY)
    for node in ast.walk(tree):
        where = f"{path.relative_to(root)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            compared = set().union(*map(_names_in, operands)) & names
            # (a launch environment's source "single" is no strategy)
            if compared and not any("source" in ast.unparse(o) for o in operands):
                found.append(f"{where}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("isinstance", "issubclass"):
            classes = {n.rsplit(".", 1)[-1] for n in re.split(r"[(),\s]+", ast.unparse(node.args[-1])) if n}
            if TYPES & classes:
                found.append(f"{where}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            own = {f"strategy.{name}" for name in ("ddp", "dp", "fsdp", "single")}
            if any(module.endswith(m) for m in own) or (
                module.endswith("strategy") and {a.name for a in node.names} & {"ddp", "dp", "fsdp", "single"}
            ):
                found.append(f"{where}: from {module} import {', '.join(a.name for a in node.names)}")
    return found


def test_no_module_outside_the_strategies_tests_a_strategys_name_or_type():
    files = [p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] not in OWN]
    found = [line for path in sorted(files) for line in branches(path)]
    assert not found, "a strategy's name or type tested outside strategy/:\n" + "\n".join(found)


def test_the_check_finds_each_kind_of_branch(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from .strategy.fsdp import is_sharded\n"
        "from .strategy import fsdp\n"
        "if rt.strategy == 'fsdp': pass\n"
        "if cfg.strategy in ('dp', 'single'): pass\n"
        "if isinstance(m, nn.parallel.DistributedDataParallel): pass\n"
        "if env.source != 'single': pass\n"  # not a strategy: not found
    )
    found = branches(planted, tmp_path)
    assert [line.split(":")[1] for line in found] == ["1", "2", "3", "4", "5"], found


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


def test_a_new_strategy_is_one_class_and_one_registry_entry(mirror, tmp_path):
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(24, 4), torch.randint(0, 3, (24,)))
    results = {}
    for name in ("single", "mirror"):
        with ddpkit.Runtime(name, device="cpu", seed=1) as rt:
            model = rt.build(lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)))
            model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
            assert rt.strategy == name and getattr(model, "wrapped_by", "single") == name
            for x, y in rt.loader(data, batch_size=8):
                rt.backward(nn.functional.cross_entropy(model(x), y))
                rt.step(opt)
            rt.save_state(tmp_path / f"{name}.pt")
            results[name] = (rt.evaluate(model, data), torch.cat([p.detach().flatten() for p in model.parameters()]))
            rt.load_state(tmp_path / f"{name}.pt")
    assert results["mirror"][0] == results["single"][0] and torch.equal(results["mirror"][1], results["single"][1])
    assert "mirror" in strategies.names() and strategies.by_name("mirror") is Mirror
