"""`Runtime`: the object a user's own training loop talks to, one per worker process.

    with ddpkit.Runtime(precision="bf16", seed=0) as rt:
        model, opt = rt.setup(model, opt)
        for epoch in range(epochs):
            for x, y in rt.loader(train_set, batch_size=256):   # GLOBAL batch
                rt.backward(loss_fn(model(x), y))
                rt.step(opt)
            rt.print(rt.evaluate(model, test_set))               # exact, rank 0 prints
        rt.save("ckpt.pt", model=model, optimizer=opt)

The same code runs as one process, under `ddpkit.launch`, `ddpkit run`, torchrun or srun.
"""

from __future__ import annotations

import os
import random
from typing import Any, ContextManager

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import dist, strategy as strategies
from .strategy import DDPOptions
from .data import DistributedLoader, MicroBatch, ShardSampler, eval_loader, train_loader
from .errors import UsageError
from .launcher import cpu_count
from .log import print0
from .precision import Precision, outputs_to_fp32
from .checkpoint import load_file, save_file

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str, local_rank: int = 0, bind: bool = True) -> torch.device:
    """`auto` is CUDA when a GPU is visible, else CPU. Each process binds to GPU `local_rank`
    among those CUDA_VISIBLE_DEVICES shows; `bind=False` only checks (a launching parent
    should not create a CUDA context it will never use)."""
    if name not in DEVICES:
        raise UsageError(f"--device must be one of {', '.join(DEVICES)}, got {name!r}")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA GPU is visible (torch.cuda.is_available() is False)")
    count = torch.cuda.device_count()
    if count == 1:
        index = 0  # one GPU per process (SLURM --gpus-per-task=1, CUDA_VISIBLE_DEVICES per rank)
    elif local_rank < count:
        index = local_rank
    else:
        raise UsageError(f"local rank {local_rank} has no GPU: only {count} visible; lower --nproc")
    device = torch.device("cuda", index)
    if bind:
        torch.cuda.set_device(device)
    return device


def seed_everything(seed: int) -> None:
    """Seed torch, NumPy and `random` identically on every rank, so models start identical."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def seed_rank(seed: int, rank: int, step: int = 0) -> None:
    """Give each rank its own torch / NumPy / `random` stream (dropout, augmentation) derived
    from the run's seed, the rank and the optimizer step the stream starts at."""
    seed_everything(int(np.random.SeedSequence([seed, rank, step]).generate_state(1)[0]))


class Runtime:
    """Process group, device, strategy and precision for one worker; see the module docstring.

    Args:
        strategy: 'ddp' (DistributedDataParallel; on one process the bare model), 'dp'
            (nn.DataParallel over the visible GPUs, one process) or 'single'.
        precision: 'fp32', 'bf16' or 'fp16' (autocast; fp16 adds a GradScaler).
        device: 'auto', 'cpu' or 'cuda'.
        seed: seeds torch, NumPy and `random` on every rank before you build the model.
        timeout_s: how long a collective may wait for the slowest rank before failing.
        channels_last: model and image batches in NHWC layout (faster convolutions on tensor
            cores, with bf16/fp16).
        compile: torch.compile the wrapped model (True, or a dict of torch.compile options).
        ddp: DDP tuning (bucket size, gradient_as_bucket_view, static_graph, a compression
            comm hook): a `DDPOptions` or a dict of its fields.
        cudnn_benchmark: let cuDNN time its algorithms for each new shape and keep the
            fastest (default: on for CUDA; results may then differ in the last bits run to run).
    """

    def __init__(self, strategy: str = "ddp", precision: str = "fp32", device: str = "auto",
                 seed: int | None = None, timeout_s: float = 600.0, *, channels_last: bool = False,
                 compile: bool | dict = False, ddp: DDPOptions | dict | None = None,
                 cudnn_benchmark: bool | None = None):
        self.env = dist.detect_env()
        self.device = resolve_device(device, self.env.local_rank)
        if self.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # Without this every process starts one thread per core and they fight over them.
            torch.set_num_threads(max(1, cpu_count() // self.env.local_world_size))
        self._owns_group = dist.init(self.env, self.device, timeout_s)
        try:
            self.strategy = strategies.resolve(strategy, self.world_size, self.device)
            self.precision = Precision(precision, self.device)
            self.ddp_options = ddp if isinstance(ddp, DDPOptions) else DDPOptions(**(ddp or {}))
            if self.ddp_options.comm_hook == "bf16" and self.device.type != "cuda":
                raise ValueError("comm hook bf16 needs CUDA GPUs (torch allows it only with NCCL); use fp16 on CPU")
        except (ValueError, TypeError) as err:
            self.close()
            raise UsageError(str(err)) from None
        self.seed, self.channels_last, self.compile = seed, channels_last, compile
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True if cudnn_benchmark is None else cudnn_benchmark
        self._model: nn.Module | None = None
        self._ddp: nn.parallel.DistributedDataParallel | None = None
        self._micro: MicroBatch | None = None  # the training micro-batch last handed out
        self._no_sync: Any = None  # DDP's no_sync context while inside a global batch
        if seed is not None:
            seed_everything(seed)

    # -- where we are -------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return dist.rank()

    @property
    def world_size(self) -> int:
        return dist.world_size()

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def is_main(self) -> bool:
        return dist.is_main()

    # -- lifecycle ----------------------------------------------------------------------------
    def close(self) -> None:
        """Destroy the process group if this runtime created it. Safe to call twice."""
        self._leave_no_sync()
        self._model = self._ddp = None  # the caller may drop the model: do not keep it alive
        if self._owns_group:
            dist.teardown()
            self._owns_group = False

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- model and optimizer ------------------------------------------------------------------
    def setup(self, model: nn.Module, *optimizers: torch.optim.Optimizer) -> Any:
        """Move `model` to the device and wrap it for the strategy; returns the wrapped model,
        or (model, *optimizers) when optimizers are given.

        With a Runtime seed, each rank switches to its own random stream here (derived from the
        seed and the rank): build the model before, so its initial weights agree everywhere.
        Parameters are moved in place, so an optimizer built on the bare model before this call
        keeps pointing at the right tensors. Under bf16/fp16 the wrapped model's forward runs
        in autocast and returns fp32 outputs, so the loss is computed in full precision.
        """
        wrapped = strategies.wrap(model, self.strategy, self.device, self.precision, ddp=self.ddp_options,
                                  channels_last=self.channels_last, compile=self.compile)
        self._model = wrapped
        self._ddp = strategies.find_ddp(wrapped)  # backward() skips its all-reduce between micro-batches
        if self.seed is not None:
            # The model was built from the same seed on every rank; from here on (dropout,
            # augmentation, sampling) each rank draws from its own stream.
            seed_rank(self.seed, self.rank)
        return (wrapped, *optimizers) if optimizers else wrapped

    @property
    def ddp(self) -> nn.parallel.DistributedDataParallel | None:
        """The DistributedDataParallel wrapper setup() made (None for single / dp), e.g. to
        register a communication hook of your own (before the first forward; DDP checks the
        hook's annotations, so in a module with `from __future__ import annotations` leave
        them off)."""
        return self._ddp

    @staticmethod
    def unwrap(model: nn.Module) -> nn.Module:
        """The bare model under DDP / DataParallel / torch.compile."""
        return strategies.unwrap(model)

    def autocast(self) -> ContextManager[Any]:
        """The precision's autocast context, for code outside the model's forward."""
        return self.precision.autocast()

    def no_sync(self, model: nn.Module) -> ContextManager[None]:
        """Skip the gradient all-reduce for backward passes inside (gradient accumulation)."""
        return strategies.no_sync(model)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of a micro-batch's MEAN loss, weighted so the optimizer sees the mean over
        the whole global batch, however it was split over ranks and micro-batches.

        For batches from `loader()`: a rank's micro-batch of n samples, out of a global batch
        of B, counts n * world_size / B (DDP then averages over ranks), and DDP's gradient
        all-reduce runs only on the rank's last micro-batch of the step (`no_sync` before).
        """
        micro = self._micro
        if micro is None:  # a batch from elsewhere: plain backward
            self.precision.backward(loss)
            return
        weight = micro.size * self.world_size / micro.step_size
        if micro.size == 0:  # an empty share: zero gradients, but DDP still all-reduces them
            loss = loss.nan_to_num(0.0) * 0.0
        elif weight != 1.0:  # even shares, no accumulation: the hand-written loop's backward exactly
            loss = loss * weight
        try:
            self.precision.backward(loss)
        finally:
            self._leave_no_sync()

    @property
    def step_ready(self) -> bool:
        """True when the gradients of a whole global batch are in: the next step() steps."""
        return self._micro is None or self._micro.last

    def step(self, optimizer: torch.optim.Optimizer, max_grad_norm: float | None = None) -> bool:
        """Optimizer step (through the GradScaler under fp16), then zero the gradients; returns
        True. Between micro-batches of one global batch it does nothing and returns False, so
        `if rt.step(opt): scheduler.step()` keeps a per-step schedule right under accumulation.
        With `max_grad_norm`, gradients are unscaled and clipped first."""
        if not self.step_ready:
            return False
        if max_grad_norm is not None:
            self.precision.unscale(optimizer)
            params = [p for group in optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        self.precision.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        return True

    # -- data ---------------------------------------------------------------------------------
    def loader(self, dataset: Any, batch_size: int, shuffle: bool = True, drop_last: bool = False,
               seed: int | None = None, num_workers: int | None = None,
               micro_batch_size: int | None = None, resident: bool | None = None) -> DistributedLoader:
        """Training micro-batches for this rank. `batch_size` is the GLOBAL batch: the samples
        of one optimizer step over all ranks, whatever their number. Each rank takes its share
        (shares differ by at most one sample), in micro-batches of at most `micro_batch_size`.
        Which samples form step k depends on `seed` (default: the Runtime's, else 0) and the
        epoch only; the loader reshuffles every epoch and resumes mid-epoch from its state.

        `resident` (default: whenever the dataset is an ImageSet or TensorDataset that fits)
        keeps the dataset whole on the device and cuts batches there by index; False reads
        through a DataLoader (with `num_workers` workers). Both give the same batches."""
        seed = seed if seed is not None else (self.seed or 0)
        try:
            loader = train_loader(dataset, batch_size, world_size=self.world_size, rank=self.rank,
                                  device=self.device, shuffle=shuffle, seed=seed, drop_last=drop_last,
                                  micro_batch_size=micro_batch_size, num_workers=num_workers,
                                  local_world_size=self.env.local_world_size, resident=resident,
                                  channels_last=self.channels_last)
        except ValueError as err:
            raise UsageError(str(err)) from None
        loader.on_batch = self._on_batch
        return loader

    def _on_batch(self, loader: DistributedLoader) -> None:
        """Called as the loader hands out a training micro-batch, before the user's forward, and
        when a pass ends or is left.

        DDP arms its gradient all-reduce in the forward pass, so `no_sync()` must already be on
        then, not only around backward(): it is entered here for every micro-batch but a
        rank's last of the step, and left at the end of backward(). Ranks may so run different
        numbers of micro-batches; each still all-reduces exactly once per step.
        """
        self._leave_no_sync()
        self._micro = loader.current  # None once a pass is over: later batches are plain
        if self._micro is not None and not self._micro.last and self._ddp is not None:
            self._no_sync = self._ddp.no_sync()
            self._no_sync.__enter__()

    def _leave_no_sync(self) -> None:
        if self._no_sync is not None:
            self._no_sync.__exit__(None, None, None)
            self._no_sync = None

    def eval_loader(self, dataset: Any, batch_size: int = 512, num_workers: int | None = None,
                    resident: bool | None = None) -> DistributedLoader:
        """This rank's share of `dataset` for evaluation: every sample on exactly one rank."""
        try:
            return eval_loader(dataset, batch_size, world_size=self.world_size, rank=self.rank,
                               device=self.device, num_workers=num_workers,
                               local_world_size=self.env.local_world_size, resident=resident,
                               channels_last=self.channels_last)
        except ValueError as err:
            raise UsageError(str(err)) from None

    @torch.no_grad()
    def evaluate(self, model: nn.Module, data: Any, loss_fn: Any = None, batch_size: int = 512) -> dict[str, float]:
        """Accuracy and mean per-sample loss of a classifier over ALL of `data`, on every rank.

        `data` is a Dataset or a loader from `eval_loader()`. Each sample is seen by exactly
        one rank and the sums are all-reduced, so `samples` equals len(dataset) for any world
        size. `loss_fn(output, target)` must return a batch mean (default: cross-entropy).
        """
        loader = data if isinstance(data, DistributedLoader) else self.eval_loader(data, batch_size)
        if not isinstance(loader.sampler, ShardSampler):
            raise TypeError("evaluate() needs a Dataset or a loader from Runtime.eval_loader()")
        # Below DDP there are no collectives, so ranks may run different numbers of batches.
        # DataParallel stays: it spreads the evaluation over the GPUs.
        net = strategies.eval_view(model)
        was_training = net.training
        net.eval()
        correct = torch.zeros((), dtype=torch.float64, device=self.device)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        count = 0  # a Python int: a device tensor built per batch would stall the GPU each time
        for x, y in loader:
            with self.precision.autocast():
                out = outputs_to_fp32(net(x))
            loss = loss_fn(out, y) if loss_fn else F.cross_entropy(out, y)
            correct += (out.argmax(1) == y).sum()
            loss_sum += loss.double() * y.numel()
            count += y.numel()
        net.train(was_training)
        sums = torch.stack([correct, loss_sum, torch.tensor(float(count), dtype=torch.float64, device=self.device)])
        dist.all_reduce(sums)
        total = int(sums[2].item())
        return {"accuracy": sums[0].item() / max(1, total), "loss": sums[1].item() / max(1, total),
                "samples": total}

    # -- output and collectives -----------------------------------------------------------------
    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on rank 0 only."""
        print0(*args, **kwargs)

    def barrier(self) -> None:
        dist.barrier()

    def all_reduce(self, value: Any, op: str = "sum") -> Any:
        """Reduce a tensor (in place) or a Python number over ranks; op sum/mean/max/min."""
        if isinstance(value, torch.Tensor):
            return dist.all_reduce(value, op)
        t = torch.tensor(float(value), dtype=torch.float64, device=self.device)
        return dist.all_reduce(t, op).item()

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's tensor (sizes may differ per rank), in rank order."""
        return dist.all_gather(tensor)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return dist.broadcast_object(obj, src)

    def gather_objects(self, obj: Any) -> list[Any]:
        return dist.gather_objects(obj)

    # -- checkpoints ----------------------------------------------------------------------------
    def save(self, path: str | os.PathLike, **state: Any) -> None:
        """Write a checkpoint of `state` (modules, optimizers, anything with state_dict(), or
        plain values). Rank 0 writes a temp file and renames it; all ranks wait for it.
        Modules are unwrapped first: no `module.` prefixes in the file. The other ranks' wait
        does not count against `timeout_s` (see dist.wait_for_main)."""
        if self.is_main:
            save_file(path, {k: _state_of(v) for k, v in state.items()})
        dist.wait_for_main()  # a slow disk is not a dead rank: this wait has a long timeout

    def load(self, path: str | os.PathLike, **targets: Any) -> dict[str, Any]:
        """Load a checkpoint written by `save()` (with `weights_only=True`: no code runs).
        Each target's entry is loaded into it; returns the whole loaded dict."""
        state = load_file(path, map_location=self.device)
        for key, target in targets.items():
            if key not in state:
                raise KeyError(f"checkpoint {path} has no entry {key!r}; it has {sorted(state)}")
            target = self.unwrap(target) if isinstance(target, nn.Module) else target
            target.load_state_dict(state[key])
        return state


def _state_of(value: Any) -> Any:
    if isinstance(value, nn.Module):
        return strategies.unwrap(value).state_dict()
    if hasattr(value, "state_dict"):
        return value.state_dict()
    return value

