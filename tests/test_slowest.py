"""tests/slowest.py: the block of docs/testing.md that a whole run of the suite writes."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest

from tests import slowest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.unit
def test_the_block_lists_the_ten_slowest_and_the_ten_dearest_and_replaces_only_itself(tmp_path):
    page = tmp_path / "testing.md"
    page.write_text(f"before\n\n{slowest.BEGIN}\nold\n{slowest.END}\n\nafter\n")
    seconds = {f"tests/test_x.py::test_{i}": float(i) for i in range(15)}
    cpu = {f"tests/test_x.py::test_{i}": float(30 - i) for i in range(15)}  # the quickest used the most
    text = slowest.block(seconds, cpu, 600.0, 1500.0, 15, datetime.date(2026, 11, 29), 2)
    slowest.write_into(str(page), text)
    text = page.read_text()
    assert text.startswith("before\n\n") and text.endswith("\n\nafter\n") and "old" not in text
    rows = slowest.read_from(str(page))
    assert [s for s, _, _ in rows] == [float(i) for i in range(14, 4, -1)]
    assert rows[0] == (14.0, 16.0, "tests/test_x.py::test_14")
    dearest = slowest.read_from(str(page), dearest=True)
    assert [c for c, _, _ in dearest] == [float(30 - i) for i in range(10)]
    assert dearest[0] == (30.0, 0.0, "tests/test_x.py::test_0")
    assert "15 tests passed in 10.0 minutes" in text and "(--processes), using 25.0 minutes of CPU." in text
    page.write_text("no block here\n")
    with pytest.raises(ValueError, match="no <!-- slowest"):
        slowest.write_into(str(page), "x")


@pytest.mark.cli  # a Python subprocess
def test_cpu_now_counts_the_processes_waited_for():
    import subprocess
    import sys

    before = slowest.cpu_now()
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], check=True)
    assert slowest.cpu_now() - before >= 0.1  # the child's CPU, once waited for


@pytest.mark.unit
def test_the_block_in_docs_testing_was_generated_and_names_real_tests():
    rows = slowest.read_from(str(ROOT / "docs" / "testing.md"))
    dearest = slowest.read_from(str(ROOT / "docs" / "testing.md"), dearest=True)
    assert len(rows) == len(dearest) == slowest.COUNT, (
        "docs/testing.md: run `python -m pytest tests --slowest-into docs/testing.md`"
    )
    for table in (rows, dearest):
        assert [first for first, _, _ in table] == sorted((first for first, _, _ in table), reverse=True)
    for _, _, nodeid in rows + dearest:
        path, _, name = nodeid.partition("::")
        function = name.split("[")[0].split("::")[-1]
        assert f"def {function}(" in (ROOT / path).read_text(), nodeid
