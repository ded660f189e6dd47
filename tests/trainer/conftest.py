"""`straight`, the uninterrupted 2-process `ddpkit train --epochs 2` run that the invariance and
resume tests compare with: the session's `two_process_run` (tests/conftest.py), made once."""

from __future__ import annotations

import pytest

from tests.trainer.helpers import finished


@pytest.fixture(scope="package")
def straight(two_process_run):
    """The uninterrupted 2-process run the other runs are compared with."""
    return finished(*two_process_run)
