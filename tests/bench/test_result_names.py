"""Two benchmarks of one name (`ddpkit bench startup`, ddpkit's own phases, and
`python -m benchmarks startup`, the comparison with other launchers) write their default files
apart: a module's RESULT_NAME, when it has one, names them."""

from __future__ import annotations

import importlib
import os
import sys
import types

import pytest

from ddpkit.bench import BENCHES, runner

pytestmark = pytest.mark.unit


def _module(name: str, **attrs: object) -> str:
    mod = types.ModuleType(name)
    mod.run = lambda opts, device: {"ran": True}  # type: ignore[attr-defined]
    for key, value in attrs.items():
        setattr(mod, key, value)
    sys.modules[name] = mod
    return name


def test_result_name_names_the_default_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plain = {"startup": _module("bench_plain_stub")}
    named = {"startup": _module("bench_named_stub", RESULT_NAME="startup-phases")}
    first = runner.run(runner.BenchOptions(name="startup", device="cpu"), plain)
    second = runner.run(runner.BenchOptions(name="startup", device="cpu"), named)
    assert first["json"] == os.path.join("benchmarks", "results", "startup-cpu.json")
    assert second["json"] == os.path.join("benchmarks", "results", "startup-phases-cpu.json")
    assert (tmp_path / first["json"]).exists() and (tmp_path / second["json"]).exists()
    given = runner.run(runner.BenchOptions(name="startup", device="cpu", json_path="x.json"), named)
    assert given["json"] == "x.json"  # --json wins


def test_the_two_startups_are_named_apart():
    assert importlib.import_module(BENCHES["startup"]).RESULT_NAME == "startup-phases"
    assert not hasattr(importlib.import_module("benchmarks.startup"), "RESULT_NAME")
