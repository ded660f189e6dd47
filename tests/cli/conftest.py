"""`run1`: one `ddpkit train --nproc 2 --epochs 2 --device cpu --out DIR` run, shared by every
test in this folder that only reads its outputs (or points a bad input at them): made once."""

from __future__ import annotations

import pytest

from tests.conftest import run_cli


@pytest.fixture(scope="package")
def run1(tmp_path_factory):
    root = tmp_path_factory.mktemp("run1")
    out = root / "out"
    proc = run_cli("train", "--nproc", "2", "--epochs", "2", "--device", "cpu", "--out", str(out), cwd=str(root))
    return out, proc
