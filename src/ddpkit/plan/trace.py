"""One training step of a layout, traced on fake tensors over a fake process group: what each
rank holds at its peak, the collectives it calls, and the FLOPs it computes, without a GPU and
without allocating the model.

The step is ddpkit's own: the model is built by `models`, split by the strategy's `split` (the
same tensor-parallel plan and FSDP2 units and mixed-precision policy as a run), checkpointed by
`strategy.activations`, and stepped by AdamW or SGD. torch's tools do the counting:
`FakeTensorMode` (shapes, no values), the `fake` process-group backend (collectives that return
at once), `FSDPMemTracker` / `MemTracker` (each live tensor by role) and `FlopCounterMode`.

Where they fall short, the arithmetic is ddpkit's and the result says so (`computed`):
- DDP is not traced (its C++ reducer needs real tensors): the bare model's step is, and DDP's
  gradient buckets (one more copy of the gradients, unless they are the bucket views) and its
  all-reduce (every gradient once per step) are added;
- FLOPs of tensor-parallel layers are counted on whole DTensors, so a rank's share is the
  count over the tp ranks;
- the fake process group's collectives allocate nothing of their own, as NCCL's do not. Where the
  run is on CPUs (gloo), its reduce-scatter holds a whole copy of its input while it runs
  (`GlooCopies`): the trace of such a run (`Step.backend`) holds that copy too.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..core.precision import AutocastModule, Precision
from ..core.stack import on_fresh_stack
from ..core.threads import usable_cores
from ..errors import RunError, UsageError
from ..observe.collectives import Collectives, Op, tensor_bytes
from ..strategy import REGISTRY, DDPOptions, FSDPOptions
from ..strategy import activations as checkpointing
from ..strategy.mesh import Layout as MeshLayout
from ..strategy.mesh import MeshSpec
from .work import Counting, OpKind, Ops, cpu_attention_formulas

# Imports inside functions: torch's fake-tensor, memory-tracking, FLOP-counting and DeviceMesh
# modules load when a trace runs, not when `ddpkit plan --help` imports this package.


@dataclass(frozen=True)
class Layout:
    """One way to run the job: a strategy on a mesh, activation checkpointing (off, True for
    full, or "selective"), and the samples per forward on one data rank."""

    strategy: str  # ddp, fsdp, hsdp, tp or pp
    mesh: str  # "dp=8", "replicate=2,dp=4", "dp=4,tp=2", "pp=2,dp=4"
    checkpointing: bool | str
    micro_batch: int
    schedule: str = "1f1b"  # a pipeline's: 1f1b, or gpipe (where a step has fewer micro-batches than stages)

    @property
    def checkpointing_mode(self) -> str | None:
        """None (off), "full" or "selective": as `Runtime(activation_checkpointing_mode=...)`."""
        if not self.checkpointing:
            return None
        return "selective" if self.checkpointing == "selective" else "full"

    @property
    def spec(self) -> MeshSpec:
        return MeshSpec.parse(self.mesh)

    @property
    def label(self) -> str:
        spec = self.spec
        if self.strategy == "tp" and spec.data_size == 1:
            name = f"tp {spec.size('tp')}"  # nothing sharded by FSDP2 on one data rank
        elif self.strategy == "pp" and len(spec.sizes) > 1:
            name = " x ".join(f"{dim} {size}" for dim, size in spec.sizes)  # "pp 2 x dp 4": which is the pipeline
        else:
            kind = "fsdp+tp" if self.strategy == "tp" else self.strategy
            name = f"{kind} {'x'.join(str(size) for _, size in spec.sizes)}"
        ac = {None: "", "full": " +ac", "selective": " +sac"}[self.checkpointing_mode]
        schedule = " gpipe" if self.schedule == "gpipe" else ""
        return f"{name}{schedule}{ac} mb{self.micro_batch}"


@dataclass
class Trace:
    """What one rank holds at its peak (bytes, by role), the collectives of one optimizer step
    (`Op`s), and the step's FLOPs on that rank (0 from `trace`: the plan adds them, see `flops`)."""

    memory: dict[str, float]
    peak: float
    ops: list[Op]
    flops: float
    computed: list[str] = field(default_factory=list)
    work: Ops | None = None  # every operation's FLOPs and bytes, where the step counted them (`Step.count`)
    stages: list[Trace] = field(default_factory=list)  # a pipeline's: each stage's own, first stage first


T = TypeVar("T")

# FSDPMemTracker's and MemTracker's roles, as the plan reports them.
ROLES = {
    "Sharded Param": "parameters",
    "Unsharded Param": "parameters",
    "Parameter": "parameters",
    "Buffer": "parameters",
    "Sharded Grad": "gradients",
    "Unsharded Grad": "gradients",
    "Gradient": "gradients",
    "OptState": "optimizer",
    "Optstate": "optimizer",
    "Other": "temporary",
    "Activation": "activations",
    "Inputs": "activations",
    "Temp": "temporary",
    "All Gather": "communication",
    "Reduce Scatter": "communication",
}
CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporary", "communication")


def in_fake_worlds(
    world_size: int, calls: list[tuple[Callable[..., Any], tuple[Any, ...]]], progress: Any = None
) -> list[Any]:
    """Each of `calls` ((fn, args)) run on rank 0 of a fake world of `world_size` ranks, in
    processes of their own, one per core; their results in order (`progress.update()` as each
    ends). A fake world leaves torch.distributed's bookkeeping behind (group names, meshes): a
    job launched afterwards from the same process failed to resolve its groups (torch 2.13),
    so none runs in the caller's process (which may itself run a process group: the processes
    are spawned then). What a call raises comes back in one line (`TraceFailed`; a model that
    cannot run on fake tensors is the usual cause); a signal here ends the processes at once."""
    import multiprocessing
    from concurrent.futures.process import BrokenProcessPool

    from ..launcher.workers import choose_start_method, main_hidden

    method = choose_start_method("cpu")
    if method == "forkserver":  # (a fork server is a launched job's own: `launcher.workers.own_fork_server`)
        method = "spawn"
    before = set(multiprocessing.active_children())
    pool = ProcessPoolExecutor(
        min(len(calls), workers()),
        mp_context=multiprocessing.get_context(method),
        initializer=_join_fake_world,
        initargs=(world_size, method == "fork" and gc.isenabled()),
    )
    done = False
    try:
        with main_hidden() if method == "spawn" else _no_collection():
            futures = [pool.submit(_call, fn, args) for fn, args in calls]  # (the pool's processes start here)
        for _ in as_completed(futures):
            if progress is not None:
                progress.update()
        results = [f.result() for f in futures]
        done = True
        return results
    except BrokenProcessPool:
        raise RunError(
            "a process tracing the plan ended without a result (killed, out of memory, or an exit in "
            "the model's own code)"
        ) from None
    finally:
        if not done:  # a signal or an error ends the plan: the traces still running end now
            for child in set(multiprocessing.active_children()) - before:
                child.terminate()
                child.join()
        pool.shutdown(wait=True, cancel_futures=True)  # its manager thread too: a later fork stays safe


def workers() -> int:
    """The processes `in_fake_worlds` runs at most: one per core this process may use."""
    return usable_cores()


def backend_for(device: str) -> str:
    """The process group a run on `device` has (`Step.backend`): NCCL on GPUs, gloo on CPUs."""
    return "nccl" if device == "cuda" else "gloo"


class TraceFailed(RunError):
    """What a traced call raised, as one line (its own exception may not cross processes)."""


def _call(fn: Callable[..., T], args: tuple[Any, ...]) -> T:
    try:
        return on_fresh_stack(fn, *args)  # a forked pool process starts at its parent's depth
    except UsageError:
        raise
    except BaseException as err:  # noqa: BLE001 - a model of one's own: whatever it raises (SystemExit too)
        raise TraceFailed(
            f"the plan could not trace the model on fake tensors: {type(err).__name__}: {err} (ddpkit plan "
            "builds and runs it without values: a constructor or forward that reads a tensor's values "
            "cannot be planned)"
        ) from None


@contextlib.contextmanager
def _no_collection() -> Iterator[None]:
    """No garbage collection in this process while it forks the pool's processes, so that none
    runs in a child before `_join_fake_world` has frozen what the child inherited."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _join_fake_world(world_size: int, collect: bool = False) -> None:
    """A pool process's fake world, for its life. Ctrl-C reaches the whole process group: here
    it is ignored, and the planning process ends the pool; SIGTERM ends it quietly.

    A forked one (`collect`: forked from a process that collects garbage) first freezes every
    object it inherited, then collects again: its collections walk only what it makes itself.
    A trace process forked from a process with a long history (a pytest process, after tests
    that had run process groups and DTensors in it) crashed in a collection, inside DTensor's
    sharding propagation (a segmentation fault), once under a heavier load of the suite and
    once when its files ran in another order."""
    import signal

    from torch.testing._internal.distributed.fake_pg import FakeStore

    if collect:  # (forked under `_no_collection`): the parent's objects stay out of sight
        gc.freeze()
        gc.enable()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())


@dataclass(frozen=True)
class Step:
    """The model and the batch a step trains on: `build()` makes the model, `batch(n)` n samples
    of input and target; `share` samples per data rank per optimizer step."""

    build: Callable[[], nn.Module]
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    share: int
    precision: str = "fp32"
    optimizer: str = "adamw"
    foreach: bool = True  # the optimizer's multi-tensor step, as on CUDA GPUs (see `optimizer`)
    count: bool = False  # count every operation's FLOPs and bytes too (`work.Counting`: a CPU's time model)
    backend: str = "nccl"  # the run's process group: "nccl" (GPUs) or "gloo" (CPUs: see `GlooCopies`)


def trace(step: Step, layout: Layout, world_size: int) -> Trace:
    """Trace one optimizer step of `layout` on rank 0 of a fake world of `world_size` ranks
    (in a process of `in_fake_worlds`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    spec = layout.spec
    spec.check_processes(world_size)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model, on_meta = built(step.build, mode)
    if layout.checkpointing:
        checkpointing_apply(model, layout.checkpointing)
    strategy = _split(model, layout, step.precision) if layout.strategy != "ddp" else None
    if on_meta:
        with mode:
            model.to_empty(device="cpu")  # FSDP2 and DTensor take their shards from here on, as in a run
    if step.precision != "fp32" and (strategy is None or layout.spec.data_size == 1):
        # bf16/fp16 where FSDP2's policy does not carry it (ddp, tp on one data rank): the
        # forward under autocast, outputs back in fp32, as the strategies wrap it
        model = AutocastModule(model, Precision(step.precision, torch.device("cpu")))
    with mode:
        return _step(model, strategy, layout, step)


def built(build: Callable[[], nn.Module], mode: Any) -> tuple[nn.Module, bool]:
    """The model on the meta device, split there and given fake storage afterwards (`to_empty`):
    FSDP2 cuts each parameter into a shard per rank, and on fake tensors every shard is a Python
    object (a 512-rank fsdp trace spent 7.8 of its 9.4 s there); on meta it is a view in C++.
    A model of one's own that cannot be built on meta (it reads values) is built on fake
    tensors (`mode`). Whether it was built on meta is returned too."""
    try:
        with torch.device("meta"):
            return build(), True
    except Exception:  # noqa: BLE001 - a model of one's own: whatever its constructor raises on meta
        with mode:
            return build(), False


def checkpointing_apply(model: nn.Module, how: bool | str = True) -> None:
    """Activation checkpointing as `Runtime(activation_checkpointing=True)` applies it: in full
    (True), or "selective"."""
    checkpointing.apply(model, True, "selective" if how == "selective" else "full")


def _split(model: nn.Module, layout: Layout, precision: str) -> Any:
    """The strategy's own split of `model` over its mesh (outside fake mode: torch's DeviceMesh
    computes coordinates from real tensors)."""
    from torch.distributed.device_mesh import init_device_mesh

    spec = layout.spec
    strategy = REGISTRY[layout.strategy].make(torch.device("cpu"), DDPOptions(), FSDPOptions())
    shape, names = spec.grid()
    strategy.layout = MeshLayout(spec, init_device_mesh("cpu", shape, mesh_dim_names=names))
    strategy.split(model, Precision(precision, torch.device("cpu")))
    return strategy


def _step(model: nn.Module, strategy: Any, layout: Layout, step: Step) -> Trace:
    opt = optimizer(step.optimizer, model, step.foreach)
    _make_state(model, opt)  # as after a first step: every later step runs with it
    tracker = memory_tracker(model, opt)
    micro = max(1, step.share // layout.micro_batch)
    ops: list[Op] = []
    if layout.spec.size("tp") > 1:
        _warm_up(model, strategy, layout, step, micro)
    counting = Counting() if step.count else contextlib.nullcontext()
    # Under the tracker, so that it counts the copies; under the counting, which leaves them out:
    # their time is the reduce-scatter's, as gloo's was timed (`calibrate`).
    copies = GlooCopies() if step.backend == "gloo" else contextlib.nullcontext()
    with tracker, copies, counting:
        for last in _lasts(micro):
            tracker.reset_mod_stats()  # per-module figures only: the peak so far stays
            with Collectives() as collectives, _no_sync(strategy, model, last):
                x, y = step.batch(layout.micro_batch)
                out = model(x)  # alive through the backward, as in `rt.forward_backward`
                loss(out, y).backward()
                del out
            # every micro-batch but the last makes these calls: counted, not copied (a global
            # batch of 2**40 over micro-batches that fit was billions of list entries)
            ops.extend(
                collectives.ops if last else [replace(op, calls=op.calls * (micro - 1)) for op in collectives.ops]
            )
        opt.step()
        opt.zero_grad(set_to_none=True)
    traced = _result(tracker, model, layout, ops)
    if isinstance(copies, GlooCopies) and copies.made:
        traced.computed.append("gloo: each reduce-scatter's copy of its input, held while it runs")
    if isinstance(counting, Counting):
        traced.work = counting.ops
        if layout.strategy == "ddp" and layout.spec.processes > 1:
            bucket_copies(traced.work, model)
    return traced


def memory_tracker(model: nn.Module, opt: torch.optim.Optimizer, per_call: bool = False) -> Any:
    """torch's memory tracker for a step of `model` and `opt`, to enter around it: FSDP2's
    (`FSDPMemTracker`) where FSDP2 shards `model`, else the general one (`MemTracker`), following
    `model`'s and `opt`'s tensors. `per_call`: for a module called once per micro-batch (a
    pipeline's stage), which the general one refuses (`_per_call`).

    Each keeps the step's peak and its roles alone (what `roles` reads). torch's also keeps each
    module's own peak, walking every module it has met at every operation, whether or not the
    module is running (`MemTracker._update_peak_stats`): a plan never reads those, and they were
    the costliest part of a trace (a 10-block gpt's step: ddp 4 from 3.6-4.6 s of CPU to 1.4, fsdp 4
    from 2.7-3.5 to 2.1-2.4, fsdp+tp 2x2 with checkpointing from 5.2-6.2 to 4.1-4.3; the same
    figures to the byte). The peak is updated exactly as torch updates it."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker  # (loaded when a trace or a check runs)
    from torch.distributed._tools.mem_tracker import MemTracker

    if hasattr(model, "unshard"):
        return _peak_only(FSDPMemTracker)(model, opt)
    tracker = _peak_only(_per_call(MemTracker) if per_call else MemTracker)()
    tracker.track_external(model, opt)
    return tracker


def _peak_only(tracker: type) -> type:
    """`tracker` (a torch memory tracker's class), keeping the step's peak, not each module's."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY  # (loaded with the tracker)

    class PeakOnly(tracker):  # type: ignore[valid-type, misc]
        def _update_peak_stats(self, peak_state: Any) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(snap)  # (its values are byte counts)

    return PeakOnly


def _per_call(tracker: type) -> type:
    """`tracker` (torch's `MemTracker`), for a module called once per micro-batch: torch's refuses
    a top-level module's second forward in one tracked run ("multiple iterative calls"); this one
    forgets the module's own figures then (the per-module ones, not the peak, which stays)."""

    class PerCall(tracker):  # type: ignore[valid-type, misc]
        def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
            name = self._mod_tracker.get_known_fqn(module)
            again = module in self.memory_tracking and not self._mod_tracker.is_bw
            if again and set(self._mod_tracker.parents) - {name} == {"Global"}:
                self.memory_tracking.pop(module)
            super()._pre_fw_hook(module, inputs)

    return PerCall


class GlooCopies(TorchDispatchMode):
    """A gloo run's reduce-scatter, on the fake process group's. gloo has no reduce-scatter of
    its own: `ProcessGroupGloo::reduce_scatter_tensor_coalesced` (what FSDP2's
    `reduce_scatter_single` calls) clones the whole input, all-reduces the clone, and on `wait()`
    copies its rank's chunk out. The clone, as large as the input (a unit's padded gradients in
    the reduce dtype), lives beside the input and the output until then; NCCL reduces in place.
    Measured on the CNN (a 131k-parameter linear unit, 4 processes): the real peak was in that
    reduce-scatter, and the traced one 10% (fp32, hsdp 2x2) and 21% (bf16, fsdp 4) lower
    without this copy; with it, within 0.1%. `made` counts the copies made."""

    def __init__(self) -> None:
        super().__init__()
        self.made = 0
        self._reduce_scatter = torch.ops.c10d._reduce_scatter_base_.default

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not self._reduce_scatter:
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        # gloo's buffer, made once the fake collective is called: a tracker below has taken the
        # input (output, input, group, op, ...) as the reduce-scatter's by then, as in a real run,
        # where it first sees the buffer when wait() splits it, with the input and output alive
        copy = args[1].clone()
        self.made += 1
        del copy  # wait() has copied the chunk out: a synchronous reduce-scatter returns after it
        return out


def _warm_up(model: nn.Module, strategy: Any, layout: Layout, step: Step, micro: int) -> None:
    """A forward and backward before the tracked step, where tensor parallelism runs: DTensor
    works out each operation's output sharding the first time it meets it, running the operation
    on fake tensors then, and caches the answer. Those runs' tensors counted as temporaries of the
    tracked step (0.6 GiB more at the peak of fsdp+tp 2x8 with checkpointing, on a 1024-wide gpt),
    so the first trace in a process differed from every later one; a real run pays it once, off
    the GPU. Under accumulation (`micro` micro-batches) two run, as the step's first and last do:
    the first without the gradients' reduction, the second adding its gradients to the first's
    and reducing them. One alone left the accumulation's operations to the tracked step: the
    first trace of fsdp+tp 2x2 over 4 micro-batches in a process peaked 5.6% above every later
    one. The gradients it leaves are dropped."""
    for last in _lasts(micro):
        with _no_sync(strategy, model, last):
            x, y = step.batch(layout.micro_batch)
            loss(model(x), y).backward()
    for p in model.parameters():
        p.grad = None


def _lasts(micro: int) -> list[bool]:
    """Whether each micro-batch a traced step runs is its last: under accumulation one that is
    not (standing for every such one: they make the same calls), then the last."""
    return [False] * (micro > 1) + [True]


def _make_state(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """The optimizer's state, made by one step on zero gradients (no forward needed)."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)


def flops(build: Callable[[], nn.Module], batch: Callable[[int], Any], checkpointing: bool | str) -> float:
    """The FLOPs of one sample's forward and backward (with recomputation under activation
    checkpointing) on the whole model, counted on fake tensors. Kept apart from the traced
    step: FlopCounterMode around it changed what checkpointing keeps (torch 2.13)."""
    return _counted(build, batch, checkpointing)[0]


def child_flops(
    build: Callable[[], nn.Module], batch: Callable[[int], Any], checkpointing: bool | str
) -> dict[str, float]:
    """`flops` by the model's children (a pipeline's units), in their order: what each one's
    forward and backward of one sample counted (torch's counter gives each module what ran
    inside it, its backward included)."""
    return _counted(build, batch, checkpointing)[1]


def _counted(
    build: Callable[[], nn.Module], batch: Callable[[int], Any], checkpointing: bool | str
) -> tuple[float, dict[str, float]]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = build()
        if checkpointing:
            checkpointing_apply(model, checkpointing)
        x, y = batch(1)
        counter = FlopCounterMode(display=False, custom_mapping=cpu_attention_formulas())
        with counter:
            loss(model(x), y).backward()
        counts = counter.get_flop_counts()
        top = type(model).__name__
        children = {name: float(sum(counts.get(f"{top}.{name}", {}).values())) for name in model._modules}
        return float(counter.get_total_flops()), children


def _result(tracker: Any, model: nn.Module, layout: Layout, ops: list[Op]) -> Trace:
    memory, ops = roles(tracker), list(ops)
    computed = []
    if layout.strategy == "ddp" and layout.spec.processes > 1:
        ddp_counted(memory, ops, model, tuple(range(layout.spec.processes)))
        computed.append("ddp: its gradient buckets (one more copy of the gradients) and one all-reduce of them")
    return Trace(memory, float(sum(memory.values())), ops, 0.0, computed)


def ddp_counted(
    memory: dict[str, float], ops: list[Op], model: nn.Module, ranks: tuple[int, ...], work: Ops | None = None
) -> None:
    """DDP over `ranks` on `model`, added to a trace's `memory` and `ops` in place: its gradient
    buckets (out of the tracker's sight: allocated by its C++ reducer), one more copy of the
    model's fp32 gradients, and one all-reduce of them per step; and to its `work`, where it
    counted every operation, the gradients' copies into the buckets and back."""
    grads = tensor_bytes(p for p in model.parameters())  # fp32 gradients, one per parameter
    memory["communication"] += grads
    ops.append(Op("all_reduce", grads, ranks))
    if work is not None:
        bucket_copies(work, model)


def bucket_copies(work: Ops, model: nn.Module) -> None:
    """DDP's work beside a step's operations, added to `work`: `model`'s gradients copied into
    its buckets, and back."""
    grads = int(tensor_bytes(p for p in model.parameters()))
    work.counts[OpKind(0, 2 * grads, False, False, "ddp.bucket_copy")] += 2


def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss a plan's step trains on: cross-entropy over every position, in fp32."""
    return F.cross_entropy(out.flatten(0, -2).float(), y.flatten())


def roles(tracker: Any) -> dict[str, float]:
    """A memory tracker's peak snapshot (its one device's), in bytes by the plan's roles."""
    snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()), {})
    memory = dict.fromkeys(CATEGORIES, 0.0)
    for role, nbytes in snapshot.items():
        if role != "Total":
            memory[ROLES.get(str(getattr(role, "value", role)), "temporary")] += nbytes
    return memory


def optimizer(name: str, model: nn.Module, foreach: bool) -> torch.optim.Optimizer:
    """The optimizer a plan counts: AdamW, or SGD with momentum (one value per parameter);
    `foreach` as torch chooses by itself where it runs (on CUDA GPUs: the multi-tensor step,
    whose temporaries hold a whole state at once; on CPU: one tensor at a time). A model whose
    parameters mix DTensors and plain tensors (tp on one data rank leaves its norms whole)
    steps one tensor at a time: the multi-tensor kernels refuse the mix."""
    params = list(model.parameters())
    foreach = foreach and len({type(p.data) for p in params}) <= 1
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, foreach=foreach)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=foreach)
    raise UsageError(f"--optimizer {name!r}: choose adamw or sgd")


def _no_sync(strategy: Any, model: nn.Module, last: bool) -> Any:
    """Under accumulation, every micro-batch but the last skips the gradient reduction, as
    ddpkit's steps do (`Strategy.no_sync`)."""
    make = strategy.no_sync(model) if strategy is not None and not last else None
    return make() if make is not None else contextlib.nullcontext()
