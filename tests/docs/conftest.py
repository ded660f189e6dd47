"""The documentation site, built once for the docs tests: test_site.py reads the built files,
test_screens.py looks at every page in a headless browser."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.parallel import made_once

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class SiteBuild:
    proc: subprocess.CompletedProcess  # `mkdocs build --strict`, as it ran: the tests assert on it
    site: Path  # the built site (complete only when proc.returncode == 0)

    def failure(self) -> str:
        return f"mkdocs build --strict failed:\n{self.proc.stdout}\n{self.proc.stderr}"


@pytest.fixture(scope="session")
def site_build(tmp_path_factory, pytestconfig) -> SiteBuild:
    """`python -m mkdocs build --strict` of the repository's site, once per test session. A failed
    build is returned, not raised: each test that uses it fails with mkdocs' own output."""

    def make():
        site = tmp_path_factory.mktemp("docs") / "site"
        proc = subprocess.run(
            [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
            check=False,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=240,
        )
        return SiteBuild(proc, site)

    return made_once(pytestconfig, "site_build", make)
