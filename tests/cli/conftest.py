"""`run1`: one `ddpkit train --nproc 2 --epochs 2 --device cpu --out DIR` run, shared by every
test in this folder that only reads its outputs (or points a bad input at them): the session's
`two_process_run` (tests/conftest.py), made once."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="package")
def run1(two_process_run):
    return two_process_run
