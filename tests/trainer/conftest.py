"""`straight`, the uninterrupted 2-process `ddpkit train --epochs 2` run that the invariance and
resume tests compare with: made once for the whole folder."""

from __future__ import annotations

import pytest

from tests.trainer.helpers import train


@pytest.fixture(scope="package")
def straight(tmp_path_factory):
    """The uninterrupted 2-process run the other runs are compared with."""
    return train(tmp_path_factory.mktemp("straight") / "out", "--nproc", "2")
