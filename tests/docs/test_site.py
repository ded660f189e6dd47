"""The documentation site builds strictly: a broken link or anchor, a page missing from the
navigation, or a docstring the API reference cannot render fails the test run."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.cli  # a subprocess: the mkdocs command


def test_docs_build_strictly_without_warnings(tmp_path):
    # mkdocs and mkdocstrings are test dependencies: missing, they fail this test, not skip it.
    for module in ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python"):
        assert importlib.util.find_spec(module), f"{module} is not installed: pip install -e '.[test]'"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--site-dir",
            str(tmp_path / "site"),
        ],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (tmp_path / "site" / "index.html").is_file()
