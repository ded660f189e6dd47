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

import contextlib
import functools
import os
import random
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from .. import checkpoint
from .. import strategy as strategies
from ..checkpoint.shards import Pending
from ..core import checks, dist, draws, threads
from ..core.device import DEVICES
from ..core.device import resolve as resolve_device
from ..core.files import check_writable
from ..core.log import print0
from ..core.precision import Precision
from ..core.seed import gather_rng_states, restore_rng_states, seed_everything, seed_rank
from ..data import DistributedLoader, StreamLoader, eval_loader, stream_loader, train_loader
from ..data.adopt import Adopted, source
from ..errors import NotSaveState, UsageError, usage_errors
from ..observe import tracking
from ..strategy import DDPOptions, FSDPOptions
from .accumulation import Accumulation
from .evaluation import evaluate, evaluation_keys
from .gather import gather

__all__ = ["DEVICES", "Runtime", "resolve_device", "seed_everything", "seed_rank"]

M = TypeVar("M", bound=nn.Module)

# The entries save_state writes without being told (see Runtime._state), as load_state finds them.
AUTOMATIC = re.compile(r"(model|optimizer|loader)(_\d+)?|precision")


def ddp_options(ddp: DDPOptions | dict | None) -> DDPOptions:
    """`Runtime(ddp=...)` as DDPOptions; an unknown field is a UsageError."""
    if isinstance(ddp, DDPOptions):
        return ddp
    try:
        return DDPOptions(**(ddp or {}))
    except TypeError as err:
        raise UsageError(f"Runtime(ddp=...): {err}") from None


# How long close() waits for a checkpoint still being written in the background (a large
# checkpoint on a slow disk), before it removes the partial write instead.
PENDING_WAIT_S = 600.0


class Runtime:
    """Process group, device, strategy and precision for one worker.

    A `with` block (or `close()`) tears down the process group it created. The same code runs
    as one process, under `ddpkit.launch`, `ddpkit run`, torchrun or srun.

    Args:
        strategy: 'ddp' (DistributedDataParallel; on one process the bare model), 'fsdp'
            (FSDP2: parameters, gradients and optimizer state sharded over the processes; on
            one process the bare model), 'dp' (nn.DataParallel over
            the visible GPUs, one process) or 'single'.
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
    ):
        self._model: nn.Module | None = None
        # What save_state() holds without being told: every model and optimizer given to
        # setup(), every training loader made, in the order they came.
        self._models: list[nn.Module] = []
        self._optimizers: list[torch.optim.Optimizer] = []
        self._loaders: list[DistributedLoader] = []
        # Steps taken: step() calls that stepped after a backward (a second optimizer stepped on
        # the same gradients is not another step). Seeds fresh random streams on a resume onto
        # another N, and says which log records a resumed run keeps.
        self._steps, self._counted = 0, False
        self._pending: list[Pending] = []  # background saves not known complete (see close)
        # Rank 0's sinks, opened at the first log call: after a load_state(), the log goes on
        # from the restored step instead of beginning anew.
        self._log_dir, self._tracking, self._log_resume = log_dir, None, None
        self._params: dict[str, Any] = {}  # log_params's, until the sinks open
        self._logged = False  # rt.log was called: too late for load_state to say where the log goes on
        self._acc: Accumulation | None = None  # made once the world size is known
        self._check_compiled = False  # from setup() with compile until the first step (see step)
        # What keys ddpkit.Dropout's masks besides the step and the sample: the seed, or (without
        # one) a number rank 0 draws at the first setup() and save_state keeps.
        self.invariant_dropout, self._draw_seed = invariant_dropout, seed
        self._draws: draws.Source | None = None  # made at the first setup(), left at close()
        self._plain = False  # step() is opt.step() and zero_grad alone, unless told otherwise (see _replan)
        checks.thread_count_variable()
        self.env = dist.detect_env()
        self.device = resolve_device(device, self.env.local_rank)
        """The device this rank computes on: `cuda:LOCAL_RANK`, or `cpu`."""
        self.threads = None
        """Why this process runs the torch threads it does, on CPU (see `ddpkit.core.threads`)."""
        if self.device.type == "cpu":
            # Not one thread per core in every process, nor on cores other programs keep busy.
            self.threads = threads.apply(self.env.local_world_size, say=self.env.rank == 0)
        try:
            fsdp_options = fsdp if isinstance(fsdp, FSDPOptions) else FSDPOptions(**(fsdp or {}))
        except TypeError as err:  # an unknown field
            raise UsageError(f"Runtime(fsdp=...): {err}") from None
        # (an unknown name is refused by resolve() below, after the other arguments' checks)
        asked = strategies.REGISTRY.get(strategy) if isinstance(strategy, str) else None
        cpu_collectives = asked is not None and asked.cpu_collectives(fsdp_options)
        self._owns_group = dist.init(self.env, self.device, timeout_s, cpu_collectives)
        try:
            self.ddp_options = ddp_options(ddp)
            self.ddp_options.check_device(self.device.type)
            self.ddp_options.check_compile(compile)
            self.precision = Precision(precision, self.device)
            """The precision in use: its `dtype`, `autocast()` and the fp16 scaler."""
            self._strategy = strategies.resolve(strategy, self.world_size, self.device, self.ddp_options, fsdp_options)
            self._log_with = tracking.check_log_with(log_dir, log_with)  # every rank: all fail alike
            if log_dir is not None and self.is_main:
                check_writable("Runtime(log_dir=...)", log_dir)
        except BaseException:
            self.close()
            raise
        self.strategy = self._strategy.name
        """The strategy that runs: 'ddp', 'fsdp', 'dp', or 'single' ('ddp' on one process)."""
        self._strategy.prepare_process()  # before the model exists (fsdp on CPU: the allocator)
        self.seed, self.channels_last, self.compile = seed, channels_last, compile
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True if cudnn_benchmark is None else cudnn_benchmark
        self._acc = Accumulation(self.world_size)
        self._replan()
        if seed is not None:
            seed_everything(seed)

    # -- where we are -------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's global rank (0 without a process group)."""
        return dist.rank()

    @property
    def world_size(self) -> int:
        """The number of processes in the job (1 without a process group)."""
        return dist.world_size()

    @property
    def local_rank(self) -> int:
        """This process's rank on its machine: the GPU it binds to."""
        return self.env.local_rank

    @property
    def sharded(self) -> bool:
        """True when the strategy shards the parameters over the ranks (fsdp): its checkpoints
        are directories every rank writes, and a forward on one rank alone waits for the others."""
        return self._strategy.sharded

    @property
    def devices(self) -> int:
        """How many devices the job's model runs on: the world size, or under dp every visible
        GPU of its one process."""
        return self._strategy.devices(self.world_size)

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the process that prints and writes files."""
        return dist.is_main()

    # -- lifecycle ----------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for checkpoints still being written in the background, then destroy the process
        group if this runtime created it. Safe to call twice."""
        self._finish_pending()
        if self._acc is not None:
            self._acc.leave()
            self._acc.no_sync = None
        self._model = None  # the caller may drop the model: do not keep it alive
        if hasattr(self, "_strategy"):
            self._strategy.disarm()
        if self._draws is not None:
            draws.leave(self._draws)
        self._models, self._optimizers, self._loaders = [], [], []
        if self._owns_group:
            dist.teardown()
            self._owns_group = False
        self._close_tracking(None)

    def _finish_pending(self) -> None:
        """A background save must finish or vanish before the process groups its write uses are
        torn down: torn down under it, each rank would write alone over the others' files and
        rank 0 rename a directory of half-written tensors into place. So close() waits for it,
        saying so, for at most PENDING_WAIT_S; then the partial directory is removed."""
        pending, self._pending = [p for p in self._pending if not p.done()], []
        for p in pending:
            self.print(
                f"ddpkit: checkpoint {p.path} is still being written in the background: waiting for it "
                "before closing (wait() on what save(background=True) returned says when it is complete)",
                file=sys.stderr,
            )
            try:
                p.wait(PENDING_WAIT_S)
            except TimeoutError:
                p.abandon()
                self.print(
                    f"ddpkit: checkpoint {p.path}: not complete after {PENDING_WAIT_S:g} s; its partial write removed",
                    file=sys.stderr,
                )
            except OSError as err:  # the write failed: nothing was put in place
                self.print(f"ddpkit: {err}", file=sys.stderr)

    def _close_tracking(self, exc: BaseException | None) -> None:
        sinks, self._tracking = self._tracking, None
        if sinks is not None:
            sinks.close(exc)  # the trackers' runs end as finished, or failed after `exc`

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._close_tracking(exc[1])
        finally:
            self.close()

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
        if not self._strategy.builds_on_meta or self.rank == 0:
            return make()
        try:
            with torch.device("meta"):
                return make()
        except Exception as err:  # noqa: BLE001 - a user's constructor: whatever fails on meta
            print(
                f"ddpkit: rank {self.rank}: the model cannot be built on the meta device ({type(err).__name__}: "
                f"{err}); building it in full on this rank",
                file=sys.stderr,
            )
            return make()

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
        self._check_compiled = bool(self.compile)
        self._replan()
        if self.invariant_dropout:
            self._follow_draws(model)
        wrapped = self._strategy.wrap(model, self.precision, self.channels_last, self.compile)
        self._strategy.adopt(optimizers)
        self._model = wrapped
        self._models.append(wrapped)
        self._optimizers.extend(optimizers)
        self._acc.no_sync = self._strategy.no_sync(wrapped)  # used between micro-batches of a step
        # With several models, which one's buckets a backward reduces is not known: none is
        # settled; nor under torch.compile, whose compiled backward may refuse a retained graph.
        one = len(self._models) == 1 and not self.compile
        if one:
            self._acc.set_hold(self._strategy.arm(wrapped, self.world_size))
        else:
            self._strategy.disarm()
            self._acc.set_hold(False)
        if self.seed is not None:
            # The model was built from the same seed on every rank; from here on (dropout,
            # augmentation, sampling) each rank draws from its own stream.
            seed_rank(self.seed, self.rank)
        return (wrapped, *optimizers) if optimizers else wrapped

    def _follow_draws(self, model: nn.Module) -> None:
        """Put ddpkit's dropout in the model, keyed by this run (see ddpkit.core.draws), and say on
        rank 0 what still draws from the rank's own stream. Not under dp, whose replicas run in
        threads over pieces of the batch, nor under torch.compile's fullgraph, which the draw's
        graph break would fail: torch's dropout stays, and that is said."""
        fullgraph = isinstance(self.compile, dict) and self.compile.get("fullgraph")
        if self._strategy.keeps_torch_dropout or fullgraph:
            why = f"under {self.strategy}" if self._strategy.keeps_torch_dropout else "under compile's fullgraph"
            if any(type(m) in draws.REPLACED and m.p > 0 for m in model.modules()):
                print0(
                    f"ddpkit: {why} the model keeps torch's dropout, whose masks depend on the number of processes",
                    file=sys.stderr,
                )
            return
        if self._draw_seed is None:
            self._draw_seed = self.broadcast_object(random.SystemRandom().getrandbits(63) if self.is_main else None)
        if self._draws is None:
            acc, loaders = self._acc, self._loaders
            self._draws = draws.Source(
                lambda: self._draw_seed,
                lambda: self._steps,
                lambda: acc.micro,
                self.rank,
                lambda: (id(acc.micro), *[(loader.epoch, loader.position) for loader in loaders]),
            )
        left = draws.replace_dropout(model, self._draws)
        if left:
            print0(
                f"ddpkit: {', '.join(left)}: still drawn from each rank's own stream, so it depends on the "
                "number of processes (ddpkit.dropout in your forward is the invariant form)",
                file=sys.stderr,
            )
        draws.follow(self._draws)

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
        if weight is None and self._acc.as_given and self.precision.scaler is None:
            loss.backward()  # the hand-written loop's backward exactly: nothing to weigh, scale or leave
        else:
            try:
                weighted = self._acc.weigh(loss) if weight is None else self._acc.weigh_by(loss, weight)
                if self._acc.hold:  # the strategy has a backward of its own to run (ddp: settling)
                    if not self._strategy.backward(weighted, functools.partial(self.precision.backward, weighted)):
                        self._acc.set_hold(False)
                else:
                    self.precision.backward(weighted)
            finally:
                self._acc.leave()
        self._counted = False

    @property
    def step_ready(self) -> bool:
        """True when the gradients of a whole global batch are in: the next step() steps."""
        return self._acc.step_ready

    def step(self, optimizer: torch.optim.Optimizer, max_grad_norm: float | None = None) -> bool:
        """Optimizer step (through the GradScaler under fp16), then zero the gradients; returns
        True. Between micro-batches of one global batch it does nothing and returns False, so
        `if rt.step(opt): scheduler.step()` keeps a per-step schedule right under accumulation.
        With `max_grad_norm`, gradients are unscaled and clipped first."""
        acc = self._acc
        micro = acc.micro
        if micro is not None and not micro.last:  # not step_ready (read here: step() runs every step)
            return False
        if self._plain and max_grad_norm is None and not acc.weighted:
            optimizer.step()  # the hand-written loop's step exactly
            optimizer.zero_grad(set_to_none=True)
        else:
            self._step(optimizer, max_grad_norm)
        if not self._counted:  # a second optimizer stepped on the same backward is the same step
            self._steps, self._counted = self._steps + 1, True
        return True

    def _replan(self) -> None:
        """Whether step() may be the optimizer's step and zero_grad alone, when no weighted
        backward and no clipping asks for more: worked out once from what changes only here
        (the strategy, the scaler, setup()'s compile check), so step() reads one flag."""
        checks = self._strategy.checks_optimizers or self.precision.scaler is not None
        self._plain = not (checks or self._check_compiled)

    def _step(self, optimizer: torch.optim.Optimizer, max_grad_norm: float | None) -> None:
        """step()'s work when it is more than the optimizer's step and zero_grad."""
        if self._strategy.checks_optimizers:
            self._strategy.check_optimizer(optimizer)
        if self._acc.weighted:  # only then: listing the parameters costs time on every step
            self._acc.rescale(self._parameters(optimizer))
        if max_grad_norm is not None:
            self.precision.unscale(optimizer)
            self._strategy.clip_grad_norm(optimizer, max_grad_norm)
        self.precision.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        if self._check_compiled:
            self._warn_if_nothing_compiled()

    def _parameters(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """Every parameter a step may update: of every model and optimizer given to setup() and
        of `optimizer`, each once (what a weighted step's gradients are rescaled over)."""
        groups = [m.parameters() for m in self._models]
        groups += [(p for g in opt.param_groups for p in g["params"]) for opt in (*self._optimizers, optimizer)]
        return list({id(p): p for group in groups for p in group}.values())

    def _warn_if_nothing_compiled(self) -> None:
        """After the first step with compile: one line on rank 0 if this process has no compiled
        graph at all (the model then runs as it would uncompiled, plus dynamo's overhead). Not
        a count of this model's graphs: a model like one compiled before reuses its graph."""
        self._check_compiled = False
        self._replan()
        if strategies.compiled_graphs() == 0:
            print0(
                "ddpkit: warning: torch.compile produced no graph in the first step: the model runs "
                "uncompiled (TORCH_LOGS=graph_breaks shows why)",
                file=sys.stderr,
            )

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
        src = source(data, batch_size, shuffle, drop_last, collate_fn)
        if isinstance(src.dataset, IterableDataset):  # one stream, read whole by every rank
            workers = num_workers if num_workers is not None else src.options.get("num_workers")
            return self._stream(src, micro_batch_size, seed=seed, num_workers=workers or None, resident=resident)
        seed = seed if seed is not None else (self.seed or 0)
        with usage_errors():  # torch's own refusals (num_workers=-1, ...) are bad input too
            loader = train_loader(
                src.dataset,
                src.batch_size,
                world_size=self.world_size,
                rank=self.rank,
                device=self.device,
                shuffle=True if src.shuffle is None else src.shuffle,
                seed=seed,
                drop_last=src.drop_last,
                micro_batch_size=micro_batch_size,
                num_workers=num_workers,
                local_world_size=self.env.local_world_size,
                resident=resident,
                channels_last=self.channels_last,
                lockstep=self._strategy.lockstep,  # fsdp: as many micro-batches on every rank
                collate_fn=src.collate_fn,
                dataloader=src.options,
            )
        loader.on_batch = self._acc.on_batch  # weighting and the gradient-sync switch follow it
        loader.accumulation = self._acc
        self._loaders.append(loader)
        return loader

    def _stream(self, src: Adopted, micro: int | None, **refused: Any) -> StreamLoader:
        """The loader of a stream; `refused`: options that do not apply to one (stream_loader
        says so if they are set)."""
        with usage_errors():
            loader = stream_loader(
                src.dataset,
                src.batch_size,
                world_size=self.world_size,
                rank=self.rank,
                device=self.device,
                drop_last=src.drop_last,
                micro_batch_size=micro,
                lockstep=self._strategy.lockstep,
                collate_fn=src.collate_fn,
                channels_last=self.channels_last,
                shuffle=src.shuffle,
                **refused,
            )
        loader.on_batch = self._acc.on_batch
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
        default = None if isinstance(data, DataLoader) else 512
        src = source(data, default if batch_size is None else batch_size, False, False, collate_fn)
        if isinstance(src.dataset, IterableDataset):
            raise UsageError(
                "evaluation reads a map-style test set (each sample once, split over the ranks by index); "
                "a stream has no length to split: evaluate a map-style Dataset"
            )
        with usage_errors():
            return eval_loader(
                src.dataset,
                src.batch_size,
                world_size=self.world_size,
                rank=self.rank,
                device=self.device,
                num_workers=num_workers,
                local_world_size=self.env.local_world_size,
                resident=resident,
                channels_last=self.channels_last,
                collate_fn=src.collate_fn,
                dataloader=src.options,
            )

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
        return gather(values, self.device)

    # -- output and collectives -----------------------------------------------------------------
    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on rank 0 only."""
        print0(*args, **kwargs)

    def log(self, step: int, **metrics: Any) -> None:
        """Rank 0 writes the record {"step": step, **metrics} to metrics.jsonl, metrics.csv and
        the `log_with` trackers (against `step`); the other ranks write nothing. Collective-free:
        log values every rank agrees on (from `evaluate` or `all_reduce`), as rank 0's are the
        ones written. Values are numbers, text or one-element tensors; a tensor is read with
        `.item()`, which waits for the device (on a GPU: log every N steps, not every step)."""
        tracking.need_dir(self._log_dir, "rt.log")
        record = tracking.metrics_record(step, metrics, self._log_with)  # every rank: all fail alike
        self._logged = True
        if self.is_main:
            self._sinks().log(tracking.plain(record))

    def log_params(self, **params: Any) -> None:
        """Hyperparameters of the run: MLflow params, the W&B config, and log_dir/params.json
        (merged over calls), written by rank 0. MLflow keeps a param's first value in a run."""
        tracking.need_dir(self._log_dir, "rt.log_params")
        tracking.check_names(params, self._log_with, "rt.log_params")
        self._params.update(params)  # written when the sinks open (the first rt.log), or now if they are
        if self.is_main and self._tracking is not None:
            self._tracking.log_params(params)

    def _sinks(self) -> tracking.Tracking:
        """Rank 0's sinks, opened at the first rt.log: fresh, or (after load_state) going on
        from the restored step."""
        if self._tracking is None:
            self._tracking = tracking.open_for_runtime(self._log_dir, self._log_with, self._log_resume)
            if self._params:
                self._tracking.log_params(self._params)
        return self._tracking

    def progress(self, iterable: Iterable[Any], **tqdm_kwargs: Any) -> Iterable[Any]:
        """`iterable` in rank 0's tqdm progress bar (`len()` passes through), shown when stderr
        is a terminal unless `disable=False`; the other ranks get `iterable` itself."""
        return tracking.progress(iterable, self.is_main, **tqdm_kwargs)

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        dist.barrier()

    @contextlib.contextmanager
    def main_first(self, local: bool = False) -> Iterator[None]:
        """Run the block on rank 0 first (with `local`, on each machine's local rank 0), then
        on the other ranks: download or preprocess once, then read what it left.

            with rt.main_first():
                data = load_or_download(path)

        The others wait in the long-timeout group used for checkpoint writes, so a slow
        download does not trip `timeout_s`. If the block fails on rank 0, the others still run
        it (rank 0's error is what the launch reports)."""
        first = self.local_rank == 0 if local else self.is_main
        if not first:
            dist.wait_for_main()
        try:
            yield
        finally:
            if first:
                dist.wait_for_main()

    def all_reduce(self, value: Any, op: str = "sum") -> Any:
        """Reduce a tensor (in place) or a Python number over ranks; op sum/mean/max/min."""
        if isinstance(value, torch.Tensor):
            return dist.all_reduce(value, op)
        t = torch.tensor(float(value), dtype=torch.float64, device=self.device)
        return dist.all_reduce(t, op).item()

    def any_rank(self, flag: bool) -> bool:
        """True on every rank if `flag` is True on any rank: a decision all ranks act on
        together (stop, skip), so none leaves a loop the others stay in and waits forever.
        One all-reduce; every rank must call it."""
        return self.all_reduce(float(bool(flag)), op="max") > 0

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's tensor (sizes may differ per rank), in rank order."""
        return dist.all_gather(tensor)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank `src`'s picklable object, on every rank."""
        return dist.broadcast_object(obj, src)

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's picklable object, in rank order, on every rank."""
        return dist.gather_objects(obj)

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
        self._check_writable("rt.save", path)
        return self._tracked(checkpoint.save(path, state, background=background, on_complete=on_complete))

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
        self._check_extra("save_state", extra)
        self._check_writable("rt.save_state", path)
        state = {**self._state(), **extra}
        return self._tracked(checkpoint.save(path, state, background=background, on_complete=on_complete))

    def _tracked(self, pending: Pending | None) -> Pending | None:
        """Keep a background save's handle until close(), which waits for it (`_finish_pending`)."""
        if pending is not None:
            self._pending = [p for p in self._pending if not p.done()] + [pending]
        return pending

    def _check_writable(self, call: str, path: str | os.PathLike) -> None:
        """Rank 0 proves it can write beside `path`, and every rank raises its UsageError alike
        (rather than rank 0 alone, the others left waiting for the file)."""
        problem = None
        if self.is_main:
            try:
                check_writable(f"{call}({os.fspath(path)!r})", os.path.dirname(os.path.abspath(path)))
            except UsageError as err:
                problem = str(err)
        problem = self.broadcast_object(problem)
        if problem:
            raise UsageError(problem)

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
        self._check_extra("load_state", extra)
        if not self._models or self._logged:
            raise UsageError(
                "rt.load_state: call it after rt.setup() and rt.loader(), which make what it loads into, "
                "and before the first rt.log()"
            )
        automatic = self._state(gather=False)
        targets = {**automatic, **extra}
        check = functools.partial(self._check_entries, os.fspath(path), set(automatic))
        try:
            state = checkpoint.load_into(path, targets, map_location=self.device, check=check)
        except KeyError as err:  # an entry of `extra` the checkpoint lacks
            raise UsageError(f"rt.load_state: {err.args[0]}") from None
        self._resume(state["runtime"])
        return state

    def _resume(self, run: dict[str, Any]) -> None:
        """Carry on from save_state's 'runtime' entry: the step count, the dropout masks' seed,
        and every rank's random streams (see load_state)."""
        self._steps = int(run["steps"])
        if run.get("draw_seed") is not None:  # (none: a checkpoint older than it, or no dropout of ddpkit's)
            self._draw_seed = int(run["draw_seed"])
        generators = [loader.generator for loader in self._loaders]
        restore_rng_states(run["rng"], self.device, generators, self.seed or 0, self._steps)
        if self._log_dir is not None:  # the log will keep its records up to this step, and go on
            self._log_resume = self._steps

    def _check_extra(self, call: str, extra: dict[str, Any]) -> None:
        taken = sorted(set(extra) & (set(self._state(gather=False)) | {"runtime"}))
        if taken:
            raise UsageError(
                f"rt.{call}: {', '.join(taken)} is saved without being named; give your entries other names"
            )

    @staticmethod
    def _check_entries(path: str, ours: set[str], saved: set[str]) -> None:
        """Refuse, before anything is loaded, a checkpoint that is not save_state's, or whose
        models, optimizers and loaders (`ours`: this run's automatic entries) are not this run's."""
        if "runtime" not in saved:
            raise NotSaveState(f"rt.load_state: {path} was not written by rt.save_state (rt.load reads it)")
        theirs = {k for k in saved if AUTOMATIC.fullmatch(k)}
        if ours != theirs:
            raise UsageError(
                f"rt.load_state: {path} holds {', '.join(sorted(theirs))}; this run has {', '.join(sorted(ours))} "
                "(make the same setup() and loader() calls, in the same order, before load_state)"
            )

    def _state(self, gather: bool = True) -> dict[str, Any]:
        """The entries save_state writes: 'model', 'model_1', ..., 'optimizer', ..., 'loader',
        ..., 'precision' and 'runtime' (the step count and every rank's random streams, in rank
        order: gathered, a collective; left out with `gather` False, for loading into)."""
        state: dict[str, Any] = {}
        for kind, items in (("model", self._models), ("optimizer", self._optimizers), ("loader", self._loaders)):
            state.update({kind if i == 0 else f"{kind}_{i}": item for i, item in enumerate(items)})
        state["precision"] = self.precision
        if gather:
            generators = [loader.generator for loader in self._loaders]
            state["runtime"] = {
                "steps": self._steps,
                "rng": gather_rng_states(self.device, generators),
                "draw_seed": self._draw_seed,
            }
        return state
