"""`ddpkit` itself: `--version`."""

from __future__ import annotations

import pytest

import ddpkit
from tests.cli.helpers import ok

pytestmark = pytest.mark.cli


def test_version(cli, tmp_path):
    proc = cli("--version", cwd=str(tmp_path))
    ok(proc)
    assert ddpkit.__version__ in proc.stdout
