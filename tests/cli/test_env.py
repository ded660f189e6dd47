"""`ddpkit env`: the environment as text and as JSON."""

from __future__ import annotations

import json

import pytest
import torch

from tests.cli.helpers import ok

pytestmark = pytest.mark.cli


def test_env_text(cli, tmp_path):
    proc = cli("env", cwd=str(tmp_path))
    ok(proc)
    assert "PyTorch" in proc.stdout
    assert torch.__version__ in proc.stdout


def test_env_json(cli, tmp_path):
    proc = cli("env", "--json", cwd=str(tmp_path))
    ok(proc)
    r = json.loads(proc.stdout)
    for key in ("torch", "cuda", "gpus", "cpu", "distributed_backends", "train_defaults"):
        assert key in r, key
    assert r["distributed_backends"]["gloo"] is True
    assert r["torch"]["version"] == torch.__version__
    assert r["cuda"]["available"] == torch.cuda.is_available()
    assert isinstance(r["gpus"], list) and len(r["gpus"]) == torch.cuda.device_count()
