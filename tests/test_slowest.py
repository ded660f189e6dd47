"""tests/slowest.py: the block of docs/testing.md that a whole run of the suite writes."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest

from tests import slowest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def test_the_block_lists_the_ten_slowest_and_replaces_only_itself(tmp_path):
    page = tmp_path / "testing.md"
    page.write_text(f"before\n\n{slowest.BEGIN}\nold\n{slowest.END}\n\nafter\n")
    seconds = {f"tests/test_x.py::test_{i}": float(i) for i in range(15)}
    slowest.write_into(str(page), slowest.block(seconds, 600.0, 15, datetime.date(2026, 11, 29)))
    text = page.read_text()
    assert text.startswith("before\n\n") and text.endswith("\n\nafter\n") and "old" not in text
    rows = slowest.read_from(str(page))
    assert [s for s, _ in rows] == [float(i) for i in range(14, 4, -1)]
    assert rows[0][1] == "tests/test_x.py::test_14" and "15 tests passed in 10.0 minutes" in text
    page.write_text("no block here\n")
    with pytest.raises(ValueError, match="no <!-- slowest"):
        slowest.write_into(str(page), "x")


def test_the_block_in_docs_testing_was_generated_and_names_real_tests():
    rows = slowest.read_from(str(ROOT / "docs" / "testing.md"))
    assert len(rows) == slowest.COUNT, "docs/testing.md: run `python -m pytest tests --slowest-into docs/testing.md`"
    assert [s for s, _ in rows] == sorted((s for s, _ in rows), reverse=True)
    for _, nodeid in rows:
        path, _, name = nodeid.partition("::")
        function = name.split("[")[0].split("::")[-1]
        assert f"def {function}(" in (ROOT / path).read_text(), nodeid
