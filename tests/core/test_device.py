"""The one resolver of `--device`, and the core counts the launcher and loaders share."""

from __future__ import annotations

import pytest
import torch

from ddpkit.core import device
from ddpkit.errors import UsageError

pytestmark = pytest.mark.unit


def test_cpu_and_auto_without_a_gpu():
    assert device.resolve("cpu") == torch.device("cpu")
    assert device.device_type("cpu") == "cpu"
    if not torch.cuda.is_available():
        assert device.device_type("auto") == "cpu"


def test_a_bad_name_is_one_choice_error_naming_the_flag():
    with pytest.raises(UsageError, match=r"^--device: unknown value 'tpu'; choose from auto, cpu, cuda$"):
        device.resolve("tpu")
    with pytest.raises(UsageError, match=r"^--bench-device: unknown value 'gpu'"):
        device.resolve("gpu", what="--bench-device")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible")
def test_cuda_without_a_gpu_is_refused():
    with pytest.raises(UsageError, match="--device cuda: no CUDA GPU is visible"):
        device.device_type("cuda")


def test_core_counts():
    cores = device.cpu_count()
    assert cores >= 1
    assert device.auto_nproc("cpu") == max(1, cores // 4)
    assert device.threads_per_process(1) == cores and device.threads_per_process(10 * cores) == 1
