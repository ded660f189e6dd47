"""The GPU paths: CUDA autocast and the fp16 GradScaler, channels_last, torch.compile, the
resident loader and the DataLoader's pinned memory, fsdp and DCP, exact evaluation, `ddpkit
train` on digits and gpt, and NCCL with DDP and SyncBatchNorm on several GPUs.

Every test here is marked `cuda`: `python -m pytest -m cuda tests/test_cuda.py` runs them, as the
GPU check does (`python -m benchmarks gpu`). Without a CUDA GPU they skip, unless
DDPKIT_CUDA_TESTS_DEVICE=cpu asks for a rehearsal: then the same bodies run on CPU, the CUDA-only
assertions left out, so that the tests themselves are known to run before a GPU is at hand
(tests/comparisons/test_gpu_check.py rehearses the fast ones in the ordinary suite).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

import ddpkit
from ddpkit import data, models
from tests import workers, workers_cuda
from tests.conftest import run_cli

DEVICE = torch.device(os.environ.get("DDPKIT_CUDA_TESTS_DEVICE") or "cuda")
CUDA = DEVICE.type == "cuda"
GPUS = torch.cuda.device_count() if CUDA else 0

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(CUDA and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


HERE = torch.device("cuda", 0) if CUDA else torch.device("cpu")  # where one process's tensors live


@pytest.mark.unit
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_each_precision_computes_in_its_dtype_and_fp16_scales_its_loss(precision):
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    with ddpkit.Runtime("single", device=DEVICE.type, precision=precision, seed=0) as rt:
        model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
        model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.2))
        inner = []
        hook = ddpkit.Runtime.unwrap(model)[0].register_forward_hook(lambda m, i, out: inner.append(out.dtype))
        losses = []
        for _ in range(4):
            for x, y in rt.loader(workers.toy_data(256), batch_size=32):
                loss = F.cross_entropy(model(x), y)
                rt.backward(loss)
                rt.step(opt)
                losses.append(loss.item())
        hook.remove()
        assert rt.device == HERE
        assert inner[0] == dtypes[precision]  # the matrix products ran in the precision's dtype
        assert all(p.dtype == torch.float32 for p in model.parameters())  # the weights the optimizer steps
        assert (rt.precision.scaler is not None) == (precision == "fp16")
        if rt.precision.scaler is not None:
            assert rt.precision.scaler.get_scale() > 1  # scaled, and not collapsed by overflowing steps
        assert torch.isfinite(workers.flat_params(model)).all()
        assert sum(losses[-8:]) / 8 < sum(losses[:8]) / 8  # it learns


@pytest.mark.unit
def test_channels_last_lays_out_weights_and_batches_and_trains_as_contiguous():
    def run(channels_last: bool) -> tuple[torch.Tensor, bool, bool]:
        with ddpkit.Runtime(
            "single", device=DEVICE.type, seed=0, channels_last=channels_last, cudnn_benchmark=False
        ) as rt:
            model = models.build("cnn", (3, 16, 16), 10)
            model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
            conv = next(m for m in ddpkit.Runtime.unwrap(model).modules() if isinstance(m, torch.nn.Conv2d))
            weight_nhwc = conv.weight.is_contiguous(memory_format=torch.channels_last)
            images = data.synthetic((3, 16, 16), 128, 10, seed=0).train
            batch_nhwc = []
            for x, y in rt.loader(images, batch_size=32):
                batch_nhwc.append(x.is_contiguous(memory_format=torch.channels_last))
                rt.backward(F.cross_entropy(model(x), y))
                rt.step(opt)
            return workers.flat_params(model), weight_nhwc, all(batch_nhwc)

    nhwc, weight_nhwc, batches_nhwc = run(True)
    nchw, _, _ = run(False)
    assert weight_nhwc and batches_nhwc
    # Another memory layout picks other convolution kernels: equal up to rounding (TF32 on GPUs).
    assert float((nhwc - nchw).abs().max()) <= 1e-2 * float(nchw.abs().max())


@pytest.mark.distributed
@pytest.mark.slow
def test_compile_produces_graphs_once_and_trains_as_eager():
    out = ddpkit.launch(workers_cuda.compiled_steps, DEVICE.type, nproc=1, device=DEVICE.type)[0]
    after_first, after_all = out["counts"]
    assert after_first > 0  # torch.compile made graphs in the first step
    assert after_all == after_first  # and none after it: the same shapes never recompile
    assert out["max_diff"] < 1e-3  # compiled kernels round differently from eager, no more


@pytest.mark.unit
def test_the_resident_loader_hands_out_the_cpu_batches_bit_for_bit():
    ds = data.synthetic((3, 32, 32), 512, 10, seed=0).train
    ds.augment = data.Augment(crop_padding=4, flip=True)

    def batches(device: torch.device, resident: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        loader = data.train_loader(ds, 128, world_size=1, rank=0, device=device, seed=3, resident=resident)
        out = []
        for x, y in loader:
            assert x.device.type == device.type and y.device.type == device.type
            out.append((x.cpu(), y.cpu()))
        return out

    cpu = batches(torch.device("cpu"), resident=True)
    for resident in (True, False):  # on the device: resident, and through the DataLoader
        for (xa, ya), (xb, yb) in zip(batches(HERE, resident), cpu):
            assert torch.equal(ya, yb)
            assert torch.equal(xa, xb)  # the hash gives the same crops and flips on the GPU


@pytest.mark.unit
def test_the_dataloader_path_pins_memory_on_cuda_only():
    ds = data.synthetic((3, 8, 8), 64, 10, seed=0).train
    loader = data.train_loader(ds, 16, world_size=1, rank=0, device=HERE, seed=0, resident=False)
    assert loader.loader is not None and loader.loader.pin_memory == CUDA
    x, y = next(iter(loader))
    assert x.device == HERE and y.device == HERE


@pytest.mark.unit
def test_fsdp_on_one_gpu_runs_as_the_bare_model():
    def run(strategy: str) -> tuple[str, torch.Tensor]:
        with ddpkit.Runtime(strategy, device=DEVICE.type, seed=0) as rt:
            model = workers.toy_model()
            model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
            for x, y in rt.loader(workers.toy_data(64), batch_size=16):
                rt.backward(F.cross_entropy(model(x), y))
                rt.step(opt)
            return rt.strategy, workers.flat_params(model)

    name, fsdp = run("fsdp")
    _, single = run("single")
    assert name == "single"  # one process: nothing to shard over
    assert torch.equal(fsdp, single)


@pytest.mark.unit
def test_plan_verify_refuses_a_run_whose_traced_peak_exceeds_the_memory_free_here():
    # `ddpkit plan --verify`'s check before its real run: on a GPU, the first GPU's free memory
    from ddpkit.core.memory import available_mib
    from ddpkit.errors import UsageError
    from ddpkit.plan.verify import fits_here

    free = torch.cuda.mem_get_info(0)[0] if CUDA else available_mib() * 2**20
    fits_here(free / 4, 1, DEVICE.type, "a quarter of what is free")
    said = r"needs about .* on each GPU \(its traced peak\); .* GiB is free on GPU 0" if CUDA else "needs about"
    with pytest.raises(UsageError, match=r"^twice what is free " + said):
        fits_here(free * 2, 1, DEVICE.type, "twice what is free")


@pytest.mark.distributed
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fsdp2_in_a_one_rank_group_trains_and_resumes_from_dcp(tmp_path, precision):
    out = ddpkit.launch(
        workers_cuda.fsdp_one_rank, DEVICE.type, str(tmp_path / "ckpt"), precision, nproc=1, device=DEVICE.type
    )[0]
    assert out["sharded"] and out["dcp_directory"]
    assert out["backend"] == ("nccl" if CUDA else "gloo")
    assert out["param_device"].startswith(DEVICE.type)
    assert out["losses"][-1] < out["losses"][0]
    if precision == "fp32":  # over one rank, FSDP2's reduce-scatter is the identity
        assert out["max_diff_vs_bare"] < 1e-5
    assert out["restored_equal"] and out["resumed_equal"]


@pytest.mark.unit
def test_ddpkits_dropout_masks_on_the_device_are_the_cpus_bit_for_bit():
    # The hash wraps int32 multiplies: the device's kernels must wrap as the CPU's do, at every
    # length (vectorized bodies and their tails), or 1 GPU and 1 CPU would drop other elements.
    from ddpkit.core import draws

    for per_row in (1, 2, 37, 4096, 100_003):
        rows = torch.arange(5, 21)
        cpu, scale = draws.keep_mask(rows, per_row, 0x9E3779B9, 0.3)
        here, same_scale = draws.keep_mask(rows.to(HERE), per_row, 0x9E3779B9, 0.3)
        assert torch.equal(here.cpu(), cpu) and same_scale == scale, per_row


@pytest.mark.unit
def test_evaluate_on_the_device_matches_the_cpu():
    dataset = workers.toy_data(203, seed=4)  # an odd size: the last batch is short
    results = []
    for device in (DEVICE.type, "cpu"):
        with ddpkit.Runtime("single", device=device, precision="fp32") as rt:
            model = rt.setup(workers.toy_model(seed=7))
            results.append(rt.evaluate(model, dataset, batch_size=16))
    device_result, cpu_result = results
    assert device_result["samples"] == cpu_result["samples"] == 203
    assert device_result["accuracy"] == cpu_result["accuracy"]
    assert abs(device_result["loss"] - cpu_result["loss"]) < 1e-5


@pytest.mark.cli
@pytest.mark.slow
def test_train_on_digits_compiled(tmp_path):
    out = tmp_path / "out"
    proc = run_cli("train", "--device", DEVICE.type, "--epochs", "4", "--compile", "--out", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((out / "results.json").read_text())
    assert r["device"].startswith(DEVICE.type) and r["world_size"] == max(1, GPUS)
    assert r["test_accuracy"] >= 0.9 and r["step_time_ms"]["p50"] > 0
    assert r["peak_memory_kind"] == ("cuda_max_allocated" if CUDA else "rss")
    assert r["compile_seconds"] > 0 and "no compiled graph" not in proc.stderr  # the first step compiled
    state = torch.load(out / "model.pt", weights_only=True, map_location="cpu")
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in state)
    models.build("cnn", (1, 8, 8), 10).load_state_dict(state)  # the bare model, on any device


@pytest.mark.cli
@pytest.mark.slow
def test_train_the_gpt_model_in_bf16(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog {i % 7}\n" for i in range(1500)))
    out = tmp_path / "out"
    proc = run_cli(
        "train",
        *("--device", DEVICE.type, "--model", "gpt", "--text-path", str(text), "--precision", "bf16"),
        *("--seq-len", "64", "--epochs", "1", "--out", str(out)),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((out / "results.json").read_text())
    assert r["precision"] == "bf16" and r["device"].startswith(DEVICE.type)
    assert r["tokens_per_second"] > 0 and r["test_perplexity"] < 256  # better than a uniform guess
    if CUDA:
        assert r["mfu"] is None or 0 < r["mfu"] < 1  # None only on a GPU ddpkit has no peak for


@pytest.mark.cli
@pytest.mark.slow
def test_fast_cifar_trains_in_fp16_with_channels_last(tmp_path):
    out = tmp_path / "out"
    proc = run_cli(
        "train",
        *("--device", DEVICE.type, "--nproc", "1", "--model", "fast-cifar", "--data", "synthetic"),
        *("--synthetic-size", "4096" if CUDA else "512", "--batch-size", "512" if CUDA else "128"),
        *("--epochs", "3", "--out", str(out), "--precision", "fp16", "--channels-last"),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((out / "results.json").read_text())
    assert r["precision"] == "fp16" and (r["mfu"] is None or 0 < r["mfu"] < 1)
    if CUDA:  # synthetic class templates: well above chance (0.1); a CPU rehearsal's few steps are not
        assert r["test_accuracy"] > 0.3 and r["peak_memory_kind"] == "cuda_max_allocated"


@pytest.mark.distributed
@pytest.mark.skipif(GPUS < 2, reason="NCCL between processes needs at least 2 GPUs")
def test_nccl_ddp_on_all_visible_gpus():
    out = ddpkit.launch(workers_cuda.ddp_steps, "cuda", "fp16", nproc=GPUS, device="cuda")
    assert [out[r]["device"] for r in range(GPUS)] == [f"cuda:{r}" for r in range(GPUS)]
    assert {out[r]["backend"] for r in range(GPUS)} == {"nccl"}
    assert all(out[r]["finite"] for r in range(GPUS))


@pytest.mark.distributed
@pytest.mark.skipif(GPUS < 2, reason="SyncBatchNorm across processes needs at least 2 GPUs")
def test_sync_batchnorm_statistics_agree_on_every_gpu():
    out = ddpkit.launch(workers_cuda.ddp_steps, "cuda", "fp32", True, nproc=GPUS, device="cuda")
    first = out[0]["running_stats"]
    assert first is not None and all(torch.allclose(out[r]["running_stats"], first) for r in range(GPUS))
