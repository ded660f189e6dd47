"""`python -m benchmarks busy`: its measurement (real `ddpkit train` commands started together,
timed until the last exits) and its report. The whole benchmark takes minutes (two commands
under the default thread setting fight for the cores for up to a minute): its committed result
is benchmarks/results/busy-cpu.json."""

from __future__ import annotations

import pytest

from benchmarks import busy
from ddpkit.bench.common import stats
from tests.conftest import PNG_MAGIC


@pytest.mark.cli
def test_two_commands_started_together_are_timed_until_both_have_exited(tmp_path):
    threads: list[int] = []
    seconds = busy._commands(str(tmp_path), busy.SETTINGS["one"], 2, epochs=1, threads=threads)
    runs = sorted(tmp_path.glob("run-*/run/results.json"))
    assert len(runs) == 2 and seconds > 0  # both trained to the end
    assert threads == [1, 1]  # what each ran, read from its results.json
    with pytest.raises(RuntimeError, match="ddpkit train exited with 2"):
        busy._commands(str(tmp_path), {"OMP_NUM_THREADS": "0"}, 1, epochs=1, threads=[])  # refused: raised


@pytest.mark.unit
def test_the_report_says_whether_the_goal_is_met(tmp_path):
    medians = {"default": (8.0, 2.5), "share": (20.0, 2.4), "one": (4.0, 3.0)}
    cases = {}
    for setting, (together, alone) in medians.items():
        cases[f"{setting} together"] = stats([together, together * 1.1])
        cases[f"{setting} alone"] = stats([alone, alone * 1.1])
    med = {k: v["median"] for k, v in cases.items()}
    alone = med["default alone"] / med["share alone"]
    result = {
        "cores": 2,
        "rounds": 2,
        "cases": cases,
        "together_goal": busy.TOGETHER_GOAL,
        "default_together_over_one_together": med["default together"] / med["one together"],
        "together_goal_met": False,
        "share_together_over_one_together": med["share together"] / med["one together"],
        "alone_default_over_share": alone,
        "alone_goal": busy.ALONE_NOISE,
        "alone_goal_met": alone <= busy.ALONE_NOISE,
        "alone_default_over_one": med["default alone"] / med["one alone"],
    }
    rows = dict(busy.summary(result))
    assert rows["default together / one together"] == "2.00x (goal <= 1.3: not met)"
    assert rows["default alone / share alone"] == "1.04x (goal <= 1.05: met)"
    busy.plot({"result": result}, str(tmp_path / "busy.png"))
    assert (tmp_path / "busy.png").read_bytes().startswith(PNG_MAGIC)
