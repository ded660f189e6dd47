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
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import torch
from torch import nn

from .. import checkpoint
from .. import strategy as strategies
from ..checkpoint.shards import Pending
from ..core import checks, dist, draws, threads
from ..core.device import DEVICES
from ..core.device import resolve as resolve_device
from ..core.precision import Precision
from ..core.seed import seed_everything, seed_rank
from ..data import DistributedLoader, StreamLoader
from ..errors import UsageError
from ..launcher import records
from ..observe import tracking
from ..strategy import DDPOptions, FSDPOptions, activations
from . import loaders, saves
from .accumulation import Accumulation, share
from .collectives import Collectives
from .evaluation import evaluate, evaluation_keys
from .gather import gather
from .steps import Steps

__all__ = ["DEVICES", "Runtime", "resolve_device", "seed_everything", "seed_rank"]

M = TypeVar("M", bound=nn.Module)


def options(kind: type, value: Any, argument: str) -> Any:
    """`Runtime(ddp=...)` or `(fsdp=...)` as `kind`: an instance, a dict of its fields or None;
    an unknown field is a UsageError."""
    if isinstance(value, kind):
        return value
    try:
        return kind(**(value or {}))
    except TypeError as err:
        raise UsageError(f"Runtime({argument}=...): {err}") from None


class Runtime(Collectives):
    """Process group, device, strategy and precision for one worker.

    A `with` block (or `close()`) tears down the process group it created. The same code runs
    as one process, under `ddpkit.launch`, `ddpkit run`, torchrun or srun.

    Args:
        strategy: 'ddp' (DistributedDataParallel; on one process the bare model), 'fsdp'
            (FSDP2: parameters, gradients and optimizer state sharded over the processes; on
            one process the bare model), 'hsdp' (FSDP2 sharded over `dp`, replicated over
            `replicate`), 'tp' (tensor parallel over `tp`, FSDP2 over `dp`), 'dp'
            (nn.DataParallel over the visible GPUs, one process) or 'single'.
        mesh: the processes' layout, "dp=2,tp=2" or {"dp": 2, "tp": 2} (dimensions pp, replicate,
            dp, tp; their sizes multiply to the number of processes): a mesh with `tp`, `pp` or
            `replicate` runs that strategy when `strategy` is left at ddp. Default: the
            strategy's own (ddp, fsdp: dp=N; hsdp: replicate=machines, dp=processes on each;
            tp: dp=machines, tp=processes on each). See docs/parallelism.md.
        tp_plan: under tp, for a model without a `tp_plan(tp_size)` method of its own: a dict
            of module names (`*` wildcards) to torch's ColwiseParallel/RowwiseParallel/...
            styles, or a callable `(model, tp_mesh) -> None` that parallelizes it.
        pp_schedule: under pp, torch's pipeline schedule: '1f1b' (one forward, one backward in
            the steady state: at most as many micro-batches' activations held as stages) or
            'gpipe' (every forward, then every backward).
        precision: 'fp32', 'bf16' or 'fp16' (autocast; under fsdp FSDP2's mixed-precision
            policy, fp32 shards and fp32 gradient reduction; fp16 adds a GradScaler).
        device: 'auto', 'cpu' or 'cuda'.
        seed: seeds torch, NumPy and `random` on every rank before you build the model.
        timeout_s: how long a collective may wait for the slowest rank before failing.
        channels_last: model and image batches in NHWC layout (faster convolutions on tensor
            cores, with bf16/fp16).
        compile: torch.compile the model inside the strategy's wrapper (True, or a dict of
            torch.compile options; under fsdp each shard unit's forward); rank 0 warns when
            the first step compiled nothing.
        ddp: DDP tuning (bucket size, gradient_as_bucket_view, static_graph, a compression
            comm hook, find_unused_parameters, broadcast_buffers): a `DDPOptions` or a dict of
            its fields.
        fsdp: FSDP2's options (which submodules are shard units, reshard after forward, the
            gradients' reduce dtype, CPU offload): an `FSDPOptions` or a dict of its fields.
        cudnn_benchmark: let cuDNN time its algorithms for each new shape and keep the
            fastest (default: on for CUDA; results may then differ in the last bits run to run).
        log_dir: where `log()` writes, on rank 0: metrics.jsonl and metrics.csv (begun anew,
            or after `load_state()` kept up to the restored step), and the trackers' runs.
        log_with: trackers besides: "tensorboard", "mlflow" (a local store in log_dir unless
            MLFLOW_TRACKING_URI is set), "wandb" (offline in log_dir unless WANDB_MODE is set).
        invariant_dropout: setup() puts `ddpkit.Dropout` in place of the model's nn.Dropout
            (and Dropout1d/2d/3d) modules, whose masks do not depend on the number of
            processes (see `ddpkit.core.draws`); False keeps torch's, drawn from each rank's stream.
        activation_checkpointing: setup() makes chosen blocks keep only their inputs for the
            backward and run their forward again there (less activation memory, more compute;
            the same results): True for every direct child of the model that holds parameters
            (each block of the built-in models), module classes, or a callable
            `(name, module) -> bool` (see `ddpkit.strategy.activations`).
        activation_checkpointing_mode: what a checkpointed block keeps: "full" (its inputs
            only) or "selective" (also its attention's and every other matrix product's
            outputs: more memory than "full", less recomputation).
    """

    def __init__(
        self,
        strategy: str = "ddp",
        precision: str = "fp32",
        device: str = "auto",
        seed: int | None = None,
        timeout_s: float = 600.0,
        *,
        channels_last: bool = False,
        compile: bool | dict = False,
        ddp: DDPOptions | dict | None = None,
        fsdp: FSDPOptions | dict | None = None,
        cudnn_benchmark: bool | None = None,
        log_dir: str | os.PathLike | None = None,
        log_with: Sequence[str] = (),
        invariant_dropout: bool = True,
        activation_checkpointing: activations.Choice = None,
        activation_checkpointing_mode: str = "full",
        mesh: str | dict[str, int] | None = None,
        tp_plan: Any = None,
        pp_schedule: str = strategies.SCHEDULES[0],
    ):
        self._model: nn.Module | None = None
        # What save_state() holds without being told: every model and optimizer given to
        # setup(), every training loader made, in the order they came.
        self._models: list[nn.Module] = []
        self._optimizers: list[torch.optim.Optimizer] = []
        self._loaders: list[DistributedLoader | StreamLoader] = []
        self._steps: Steps | None = None  # backward and step, made once the strategy is known
        self._background = saves.Background()  # background saves not known complete (see close)
        self._writable: set[str] = set()  # folders a save proved it can write in
        self._log: tracking.RunLog | None = None  # log() and log_params(), made with the arguments' checks
        self._acc: Accumulation | None = None  # made once the world size is known
        # What keys ddpkit.Dropout's masks besides the step and the sample: the seed, or (without
        # one) a number rank 0 draws at the first setup() and save_state keeps.
        self.invariant_dropout, self._draw_seed = invariant_dropout, seed
        activations.check(activation_checkpointing)
        checks.choice("activation_checkpointing_mode", activation_checkpointing_mode, activations.MODES)
        self.activation_checkpointing = activation_checkpointing
        self.activation_checkpointing_mode = activation_checkpointing_mode
        self._draws: draws.Source | None = None  # made at the first setup(), left at close()
        checks.thread_count_variable()
        self.env = dist.detect_env()
        self.device = resolve_device(device, self.env.local_rank)
        """The device this rank computes on: `cuda:LOCAL_RANK`, or `cpu`."""
        self.threads = None
        """Why this process runs the torch threads it does, on CPU (see `ddpkit.core.threads`)."""
        if self.device.type == "cpu":
            # Not one thread per core in every process, nor on cores other programs keep busy.
            self.threads = threads.apply(self.env.local_world_size, say=self.env.rank == 0)
        fsdp_options = options(FSDPOptions, fsdp, "fsdp")
        # (an unknown name is refused by resolve() below, after the other arguments' checks)
        asked = strategies.REGISTRY.get(strategy) if isinstance(strategy, str) else None
        cpu_collectives = asked is not None and asked.cpu_collectives(fsdp_options)
        self._owns_group = dist.init(self.env, self.device, timeout_s, cpu_collectives)
        try:
            self.ddp_options = options(DDPOptions, ddp, "ddp")
            self.ddp_options.check_device(self.device.type)
            self.ddp_options.check_compile(compile)
            self.precision = Precision(precision, self.device)
            """The precision in use: its `dtype`, `autocast()` and the fp16 scaler."""
            spec = None if mesh is None else strategies.MeshSpec.parse(mesh, "Runtime(mesh=...)")
            if tp_plan is not None:
                if not strategies.applies_tp_plan(strategy, spec):
                    raise UsageError("Runtime(tp_plan=...) applies under tp only: pass strategy='tp' or a mesh with tp")
                strategies.check_plan(tp_plan)
            self._strategy = strategies.resolve(
                strategy, self.world_size, self.device, self.ddp_options, fsdp_options, spec, self.env.local_world_size
            )
            self._strategy.tp_plan = tp_plan
            checks.choice("pp_schedule", pp_schedule, strategies.SCHEDULES)
            self._strategy.schedule = pp_schedule
            self._log = tracking.RunLog(log_dir, log_with, self.is_main)
        except BaseException:
            self.close()
            raise
        self.strategy = self._strategy.name
        """The strategy that runs: 'ddp', 'fsdp', 'dp', or 'single' ('ddp' on one process)."""
        self._strategy.prepare_process()  # before the model exists (fsdp on CPU: the allocator)
        self.seed, self.channels_last, self.compile = seed, channels_last, compile
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True if cudnn_benchmark is None else cudnn_benchmark
        self.layout: strategies.Layout = self._strategy.layout
        """Where this rank sits: `layout.spec` the mesh, `layout.device_mesh` torch's DeviceMesh
        (None on a plain dp layout), `layout.data_group` the group of ranks reading other samples."""
        records.note_place(self.layout.where(self.rank))  # a failure report names the coordinates
        records.forget_raised()  # an error an earlier Runtime closed on was caught: the rank went on
        self._acc = Accumulation(self.data_world_size, self.layout.data_group)
        self._steps = Steps(self._strategy, self.precision, self._acc, self._models, self._optimizers)
        self._place = loaders.Place(
            self.data_world_size,
            self.data_rank,
            self.device,
            self.env.local_world_size,
            channels_last,
            self._strategy.lockstep,
            self.layout.data_group,
        )
        if seed is not None:
            seed_everything(seed)

    # -- where we are (and the collectives: see Collectives) ---------------------------------------
    @property
    def sharded(self) -> bool:
        """True when the strategy shards the parameters over the ranks (fsdp): its checkpoints
        are directories every rank writes, and a forward on one rank alone waits for the others."""
        return self._strategy.sharded

    @property
    def pipelined(self) -> bool:
        """True when training steps run through a pipeline schedule (pp): train with
        `forward_backward`, not `model(x)` and `backward`."""
        return self._strategy.pipelined

    @property
    def devices(self) -> int:
        """How many devices the job's model runs on: the world size, or under dp every visible
        GPU of its one process."""
        return self._strategy.devices(self.world_size)

    # -- lifecycle ----------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for checkpoints still being written in the background, then destroy the process
        group if this runtime created it. Safe to call twice. Called while an error unwinds (in
        a `finally`), it first records that error for the launcher, before the group goes."""
        records.note_raised()  # (the peers' errors come as soon as the group goes)
        self._close()

    def _close(self) -> None:
        self._background.finish()
        if self._acc is not None:
            self._acc.leave()
            self._acc.no_sync = None
        self._model = None  # the caller may drop the model: do not keep it alive
        if hasattr(self, "_strategy"):
            self._strategy.disarm()
        if self._draws is not None:
            draws.leave(self._draws)
        del self._models[:], self._optimizers[:], self._loaders[:]  # (Steps holds the same lists)
        if self._owns_group:
            dist.teardown()
            self._owns_group = False
        self._close_tracking(None)

    def _close_tracking(self, exc: BaseException | None) -> None:
        if self._log is not None:
            self._log.close(exc)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[1] is not None:  # (not the error an `except` around the `with` may be handling)
            records.note_raised(exc[1])  # before the tracking closes too: it may take a while
        try:
            self._close_tracking(exc[1])
        finally:
            self._close()

    # -- model and optimizer ------------------------------------------------------------------
    def build(self, make: Callable[[], M]) -> M:
        """`make()`, the model built for this rank: in full (as one process would build it), except
        under fsdp on more than one process, where ranks other than 0 build it on the meta device
        (shapes, no memory) and setup() fills their shards from rank 0's model. Call it where you
        would call `make()`, after the Runtime (its seed) and before setup():

            model = rt.build(lambda: Net(width=4096))
            model, opt = rt.setup(model, torch.optim.AdamW(model.parameters()))

        On those ranks the constructor draws no random numbers, and tensors it keeps must be
        parameters or buffers (a plain tensor attribute would stay on meta). A constructor that
        cannot run on meta is run in full there instead, with a warning: still correct (setup()
        gives every rank rank 0's values), only without the memory saved."""
        return self._strategy.build(make, self.rank)

    def setup(self, model: nn.Module, *optimizers: torch.optim.Optimizer) -> Any:
        """Move `model` to the device and wrap it for the strategy; returns the wrapped model,
        or (model, *optimizers) when optimizers are given.

        With a Runtime seed, each rank switches to its own random stream here (derived from the
        seed and the rank): build the model before, so its initial weights agree everywhere.
        Under fsdp every rank starts from rank 0's values (as DDP broadcasts them): a model built
        on meta by `build()` on the other ranks is allocated and filled here.
        Parameters are moved in place, so an optimizer built on the bare model before this call
        keeps pointing at the right tensors (fsdp replaces them with sharded ones: pass such an
        optimizer here, and it is pointed at those). Under bf16/fp16 the wrapped model's forward runs
        in autocast (fsdp: in FSDP2's mixed-precision policy) and returns fp32 outputs, so the
        loss is computed in full precision.
        """
        if self.invariant_dropout:
            self._follow_draws(model)
        activations.apply(model, self.activation_checkpointing, self.activation_checkpointing_mode)
        wrapped = self._strategy.wrap(model, self.precision, self.channels_last, self.compile)
        self._strategy.adopt(optimizers)
        self._model = wrapped
        self._models.append(wrapped)
        self._optimizers.extend(optimizers)
        self._steps.adopt(wrapped, self.world_size, bool(self.compile))
        if self.seed is not None:
            # The model was built from the same seed on every rank; from here on (dropout,
            # augmentation, sampling) each data rank draws from its own stream: the ranks of a
            # tensor-parallel group, which read the same samples, draw the same numbers.
            seed_rank(self.seed, self.data_rank)
        return (wrapped, *optimizers) if optimizers else wrapped

    def _follow_draws(self, model: nn.Module) -> None:
        """Put ddpkit's dropout in the model, keyed by this run (see ddpkit.core.draws). Not under
        dp, whose replicas run in threads over pieces of the batch, nor under torch.compile's
        fullgraph, which the draw's graph break would fail: torch's dropout stays, said so."""
        if self._strategy.keeps_torch_dropout:
            return draws.say_kept(model, f"under {self.strategy}")
        if isinstance(self.compile, dict) and self.compile.get("fullgraph"):
            return draws.say_kept(model, "under compile's fullgraph")
        if self._draw_seed is None:
            self._draw_seed = self.broadcast_object(random.SystemRandom().getrandbits(63) if self.is_main else None)
        if self._draws is None:
            steps, acc, made = self._steps, self._acc, self._loaders
            self._draws = draws.Source(
                lambda: self._draw_seed,
                lambda: steps.count,
                lambda: acc.micro,
                self.data_rank,
                lambda: (id(acc.micro), *[(loader.epoch, loader.position) for loader in made]),
            )
        draws.key_dropout(model, self._draws)

    @property
    def ddp(self) -> nn.parallel.DistributedDataParallel | None:
        """The DistributedDataParallel wrapper setup() made (None for single / dp), e.g. to
        register a communication hook of your own (before the first forward; DDP checks the
        hook's annotations, so in a module with `from __future__ import annotations` leave
        them off)."""
        return strategies.find_ddp(self._model) if self._model is not None else None

    @staticmethod
    def unwrap(model: nn.Module) -> nn.Module:
        """The bare model under DDP / DataParallel / the autocast wrapper / torch.compile."""
        return strategies.unwrap(model)

    def autocast(self) -> AbstractContextManager[Any]:
        """The precision's autocast context, for code outside the model's forward."""
        return self.precision.autocast()

    def no_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        """Skip the gradient reduction for backward passes inside (gradient accumulation)."""
        make = self._strategy.no_sync(model)
        return make() if make is not None else strategies.no_sync(model)

    def backward(self, loss: torch.Tensor, weight: float | torch.Tensor | None = None) -> None:
        """Backward of a micro-batch's MEAN loss, weighted so the optimizer sees the mean over
        the whole global batch, however it was split over ranks and micro-batches.

        For batches from `loader()`: a rank's micro-batch of n samples, out of a global batch
        of B, counts n * world_size / B (DDP then averages over ranks), and DDP's gradient
        all-reduce runs only on the rank's last micro-batch of the step (`no_sync` before).

        When the loss is a mean over something else, say over the micro-batch's real tokens
        (sequences of varying length, padding ignored), give `weight`: the number of what it
        is a mean over (a number, or a tensor on the device, which costs no sync). The step is
        then the mean over all of the global batch's tokens on all ranks, as on one process:
        `step()` divides the gradients by the step's total weight, found by one scalar
        all-reduce. Once one backward is weighted, give a weight in every backward on every rank
        (0 for an empty share). A dataset with a `token_counts` attribute (each sample's tokens,
        as `ddpkit.data.TextSet` has) gets the same weighting from `loader()` without `weight`.

        Under ddp on 3 or more processes the first backward that all-reduces runs twice (what
        the first pass changed is put back), so that it is reduced in the bucket layout DDP uses
        from then on: a resumed run's first step then sums as the uninterrupted run's did (see
        strategy.settled_backward).
        """
        self._steps.backward(loss, weight)

    def forward_backward(
        self,
        model: nn.Module,
        x: Any,
        y: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        measure: Callable[[Any, Any], tuple[Any, ...]] | None = None,
    ) -> list[tuple[Any, ...]]:
        """A training micro-batch from `loader()`, forward and backward, on any strategy:
        `loss_fn(model(x), y)` (the micro-batch's MEAN loss) back-propagated as `backward` does.
        Returns `[(loss, *measure(output, y))]`, detached (just `[(loss,)]` without `measure`).

        Under pp the micro-batches of a step are held until its last one; then the pipeline's
        schedule runs them all, forward and backward, and the last stage returns one such tuple
        per micro-batch that holds samples ([] before that, and on the other stages)."""
        pipeline = self._pipeline(model)
        if pipeline is None:
            out = model(x)
            loss = loss_fn(out, y)
            self.backward(loss)
            return [(loss.detach(), *(measure(out.detach(), y) if measure else ()))]
        acc = self._acc
        micro = acc.micro
        if micro is None:
            raise UsageError("rt.forward_backward under pp takes the micro-batches of a loader from rt.loader()")
        pipeline.add(x, y, micro)
        if not micro.last:
            return []
        weights = [share(m, self.data_world_size) for m in pipeline.queued]
        sampler = getattr(acc.loader, "sampler", None)
        if not hasattr(sampler, "most_micro_batches"):
            raise UsageError("rt.forward_backward under pp: a stream (an IterableDataset) is not supported yet")
        chunks, rows = sampler.most_micro_batches()
        try:
            return pipeline.run(chunks, rows, weights, loss_fn, measure)
        finally:
            acc.micro = micro  # the step's last, as the loader left it (rt.step reads it)
            self._steps.ran_backward()

    def _pipeline(self, model: nn.Module) -> Any:
        """`model`'s pipeline under pp (its micro-batches keying dropout), else None."""
        if not self._strategy.pipelined:
            return None
        stage = strategies.stage_of(model)
        if stage is None or stage.pipeline is None:
            raise UsageError("rt.forward_backward under pp takes the model setup() returned")
        if stage.pipeline.on_chunk is None:
            acc = self._acc

            def on_chunk(micro: Any) -> None:
                acc.micro = micro

            stage.pipeline.on_chunk = on_chunk
        return stage.pipeline

    @property
    def step_ready(self) -> bool:
        """True when the gradients of a whole global batch are in: the next step() steps."""
        return self._acc.step_ready

    def step(self, optimizer: torch.optim.Optimizer, max_grad_norm: float | None = None) -> bool:
        """Optimizer step (through the GradScaler under fp16), then zero the gradients; returns
        True. Between micro-batches of one global batch it does nothing and returns False, so
        `if rt.step(opt): scheduler.step()` keeps a per-step schedule right under accumulation.
        With `max_grad_norm`, gradients are unscaled and clipped first."""
        return self._steps.step(optimizer, max_grad_norm)

    # -- data ---------------------------------------------------------------------------------
    def loader(
        self,
        data: Any,
        batch_size: int | None = None,
        shuffle: bool | None = None,
        drop_last: bool | None = None,
        seed: int | None = None,
        num_workers: int | None = None,
        micro_batch_size: int | None = None,
        resident: bool | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> DistributedLoader | StreamLoader:
        """Training micro-batches for this rank, from a Dataset or from a DataLoader you built.
        `batch_size` is the GLOBAL batch: the samples of one optimizer step over all ranks,
        whatever their number (a DataLoader's own batch_size is read so: see
        `ddpkit.data.adopt`). Each rank takes its share (shares differ by at most one sample),
        in micro-batches of at most `micro_batch_size`. Which samples form step k depends on
        `seed` (default: the Runtime's, else 0) and the epoch only; the loader reshuffles every
        epoch (`shuffle`, default True; a DataLoader's: its sampler's) and resumes mid-epoch
        from its state. `collate_fn` makes a batch of a list of samples (default_collate).

        `resident` (default: whenever the dataset is an ImageSet, TextSet or TensorDataset
        that fits, with no collate_fn and no workers) keeps the dataset whole on the device and
        cuts batches there by index; False reads through a DataLoader (with `num_workers`
        workers). Both give the same batches. A dataset with `token_counts` gets its
        micro-batches weighted by tokens (see backward).

        A `torch.utils.data.IterableDataset` is read as one stream (`ddpkit.data.StreamLoader`):
        step k is its samples [k*B, (k+1)*B) on any world size, batched by `collate_fn` (default:
        default_collate); `shuffle` must not be True for it, nor `seed`, `num_workers > 0` or
        `resident=True`."""
        loader = loaders.training(
            self._place, data, batch_size, shuffle, drop_last, seed, num_workers, micro_batch_size, resident,
            collate_fn, default_seed=self.seed or 0,
        )  # fmt: skip
        loader.on_batch = self._acc.on_batch  # weighting and the gradient-sync switch follow it
        if not isinstance(loader, StreamLoader):
            loader.accumulation = self._acc
        self._loaders.append(loader)
        return loader

    def eval_loader(
        self,
        data: Any,
        batch_size: int | None = None,
        num_workers: int | None = None,
        resident: bool | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> DistributedLoader:
        """This rank's share of `data` (a Dataset, or a DataLoader you built: its batch_size,
        collate_fn and workers are kept) for evaluation: every sample on exactly one rank.
        `batch_size` is the global evaluation batch (default: a DataLoader's, else 512)."""
        return loaders.evaluation(self._place, data, batch_size, num_workers, resident, collate_fn)

    def evaluate(
        self,
        model: nn.Module,
        data: Any,
        loss_fn: Any = None,
        batch_size: int | None = None,
        metrics: dict[str, Callable[[Any, Any], torch.Tensor]] | None = None,
        outputs: Callable[[Any, Any], Any] | None = None,
        keys: tuple[Any, str] | None = None,
    ) -> dict[str, Any]:
        """`model` over ALL of `data` (a Dataset, a DataLoader, or a loader from `eval_loader()`),
        on every rank. Its batches are (input, target) pairs, or mappings (a custom collate's
        dicts): `keys` names their input and target entries, such as ('input_ids', 'labels');
        by default the first present of 'input', 'inputs', 'x', 'input_ids', 'pixel_values',
        'image', 'images' and of 'target', 'targets', 'y', 'labels', 'label'. The model is
        called with the input alone; a tuple of names as the input, such as
        `keys=(('input_ids', 'attention_mask'), 'labels')`, calls it with those entries as
        keyword arguments.

        Each sample is seen by exactly one rank and the sums are all-reduced, so `samples`
        equals len(dataset) for any world size. Returns `accuracy` (only for classification:
        integer targets, outputs with a class dimension), `loss` (the mean of `loss_fn(output,
        target)`, a batch mean; default cross-entropy, for classification only) and `samples`;
        each of `metrics` (name -> fn(output, target) giving one value per sample, shape (n,)):
        its mean over all samples; with `outputs` (fn(output, target) -> per-sample values, as
        `gather` takes them), `outputs`: those values of every sample once, in dataset order.
        """
        loader = data if isinstance(data, DistributedLoader) else self.eval_loader(data, batch_size)
        return evaluate(model, loader, self.precision, loss_fn, metrics, outputs, evaluation_keys(keys))

    def gather(self, values: Any) -> Any:
        """Per-sample values of every rank's `eval_loader()` share, each sample once and in
        dataset order, on every rank. `values` are this rank's over its whole share, in the
        loader's order: a tensor (first dimension: samples), a list of one picklable object per
        sample, a dict or tuple of these, or a `ddpkit.runtime.gather.Collector` that collected them
        batch by batch; None for an empty share. Returns the same structure. Counts that do not
        fit the ranks' shares (a partial pass on some rank) are a UsageError on every rank."""
        return gather(values, self.device, self.layout.data_group)

    # -- output -----------------------------------------------------------------------------------
    def log(self, step: int, **metrics: Any) -> None:
        """Rank 0 writes the record {"step": step, **metrics} to metrics.jsonl, metrics.csv and
        the `log_with` trackers (against `step`); the other ranks write nothing. Collective-free:
        log values every rank agrees on (from `evaluate` or `all_reduce`), as rank 0's are the
        ones written. Values are numbers, text or one-element tensors; a tensor is read with
        `.item()`, which waits for the device (on a GPU: log every N steps, not every step)."""
        self._log.log(step, metrics)

    def log_params(self, **params: Any) -> None:
        """Hyperparameters of the run: MLflow params, the W&B config, and log_dir/params.json
        (merged over calls), written by rank 0. MLflow keeps a param's first value in a run."""
        self._log.log_params(params)

    def progress(self, iterable: Iterable[Any], **tqdm_kwargs: Any) -> Iterable[Any]:
        """`iterable` in rank 0's tqdm progress bar (`len()` passes through), shown when stderr
        is a terminal unless `disable=False`; the other ranks get `iterable` itself."""
        return tracking.progress(iterable, self.is_main, **tqdm_kwargs)

    # -- checkpoints ----------------------------------------------------------------------------
    def save(
        self,
        path: str | os.PathLike,
        background: bool = False,
        on_complete: Callable[[], None] | None = None,
        **state: Any,
    ) -> Pending | None:
        """Write a checkpoint of `state` (modules, optimizers, anything with state_dict(), or
        plain values). Modules are unwrapped first: no `module.` prefixes. Collective.

        Replicated models (single, ddp, dp): rank 0 writes one file (temp file, then rename);
        all ranks wait for it, and the wait does not count against `timeout_s` (see
        dist.wait_for_main). A model sharded by fsdp: `path` becomes a directory in which every
        rank writes its own shards through torch's Distributed Checkpoint, renamed into place
        once complete; with `background=True` the shards are copied to memory and written from
        a thread while training goes on, and the returned handle's `wait()` blocks until the
        checkpoint is complete (call it before the next save). `on_complete` is called on rank 0
        once the checkpoint is in place (from the writing thread for a background save), e.g.
        to remove older ones. Either form loads with `load()` into any strategy on any number of
        processes."""
        saves.check_writable_beside("rt.save", path, self._writable)
        return self._background.track(checkpoint.save(path, state, background=background, on_complete=on_complete))

    def load(self, path: str | os.PathLike, **targets: Any) -> dict[str, Any]:
        """Load a checkpoint written by `save()`, a file or an fsdp checkpoint directory, into
        this run's strategy and world size; no code in it runs (files load with
        `weights_only=True`; a directory's metadata admits only DCP's own classes). Each target's
        entry is loaded into it; returns the loaded dict (of a directory: its entries other than
        modules and optimizers). Collective for a directory or an fsdp target."""
        return checkpoint.load_into(path, targets, map_location=self.device)

    def save_state(
        self,
        path: str | os.PathLike,
        background: bool = False,
        on_complete: Callable[[], None] | None = None,
        **extra: Any,
    ) -> Pending | None:
        """`save()` of everything a custom loop needs to continue exactly where it stopped: every
        model and optimizer given to `setup()`, every loader made by `loader()` (its position),
        the fp16 GradScaler, every rank's random streams and the step count, plus `extra`
        (schedulers, your own counters: anything with state_dict(), or plain values).
        Collective. Continue with `load_state(path, **extra)` after the same setup() and
        loader() calls, on any number of processes (see `load_state`). `background` and
        `on_complete` are save()'s. `ddpkit train` saves its checkpoints through it."""
        automatic = self._entries()
        saves.check_names("save_state", extra, automatic)
        saves.check_writable_beside("rt.save_state", path, self._writable)
        run = saves.runtime_entry(self._steps.count, self.device, self._loaders, self._draw_seed)
        state = {**automatic, "runtime": run, **extra}
        return self._background.track(checkpoint.save(path, state, background=background, on_complete=on_complete))

    def load_state(self, path: str | os.PathLike, **extra: Any) -> dict[str, Any]:
        """Load what `save_state()` wrote into this run's models, optimizers, loaders, scaler and
        random streams, and each of `extra` into its entry; returns the loaded dict (plain values
        you saved, such as counters, are in it). Call it where the stopped run called
        save_state: after the same setup() and loader() calls, in the same order, and before
        the first `log()` (the log then goes on from the restored step).

        On the same number of processes every rank gets its own random streams back, so the
        run goes on bit-identical. Saved by another number of processes, each rank starts a
        fresh stream derived from the seed, its rank and the step: sampling, the global batches
        and the weights carry on as before (equal within float rounding), ddpkit's dropout
        included (its masks are keyed by the step, not drawn); random draws of your own in the
        loop differ, as they do between process counts anyway."""
        automatic = self._entries()
        saves.check_names("load_state", extra, automatic)
        if not self._models or self._log.logged:
            raise UsageError(
                "rt.load_state: call it after rt.setup() and rt.loader(), which make what it loads into, "
                "and before the first rt.log()"
            )
        state = saves.load_state(path, automatic, extra, self.device)
        self._resume(state["runtime"])
        return state

    def _resume(self, run: dict[str, Any]) -> None:
        """Carry on from save_state's 'runtime' entry: the step count, the dropout masks' seed,
        and every rank's random streams (see load_state)."""
        self._steps.count, draw_seed = saves.restore(run, self.device, self._loaders, self.seed or 0)
        self._draw_seed = self._draw_seed if draw_seed is None else draw_seed
        self._log.resume_at(self._steps.count)  # its records up to this step are kept, and it goes on

    def _entries(self) -> dict[str, Any]:
        """save_state's entries but 'runtime' (see saves.entries): what load_state loads into."""
        return saves.entries(self._models, self._optimizers, self._loaders, self.precision)
