"""Functions run inside launched workers by the tests (importable, so `spawn` finds them)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.core.dist import gather_rows


def toy_data(n: int, seed: int = 0, features: int = 6, classes: int = 3) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return TensorDataset(x, y % classes)


def toy_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def flat_params(model: nn.Module) -> torch.Tensor:
    """All weights in one vector; an fsdp model's shards gathered (a collective)."""
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in ddpkit.Runtime.unwrap(model).parameters()]
    return torch.cat([p.detach().reshape(-1).cpu() for p in params])


def train_steps(steps: int = 5, global_batch: int = 12, precision: str = "fp32") -> dict:
    """A few optimizer steps of DDP; returns this rank's weights before and after, and rank facts."""
    with ddpkit.Runtime(precision=precision, device="cpu", seed=1) as rt:
        model = toy_model(seed=100 + rt.rank)  # different init per rank: DDP must broadcast rank 0's
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = rt.setup(model, opt)
        start = flat_params(model)
        loader = rt.loader(toy_data(96), batch_size=global_batch)
        done = 0
        while done < steps:
            for x, y in loader:
                rt.backward(F.cross_entropy(model(x), y))
                rt.step(opt)
                done += 1
                if done == steps:
                    break
        return {
            "rank": rt.rank,
            "world": rt.world_size,
            "strategy": rt.strategy,
            "start": start,
            "end": flat_params(model),
            "batch": x.shape[0],
        }


class _Named(torch.utils.data.Dataset):
    """A dataset of (input, target) pairs given as dicts under `names`, as a custom dataset
    or collate gives them."""

    def __init__(self, pairs: torch.utils.data.Dataset, names: tuple[str, str]):
        self.pairs, self.names = pairs, names

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> dict:
        x, y = self.pairs[i]
        return {self.names[0]: x, self.names[1]: y, "index": i}


def _renamed(samples: list[dict]) -> dict:
    """A custom collate whose batches name their entries otherwise than the samples do."""
    batch = torch.utils.data.default_collate(samples)
    return {"input_ids": batch["ids"], "labels": batch["y"]}


def evaluate_collated(n: int, strategy: str = "fsdp") -> dict:
    """evaluate_odd's model and data through a DataLoader whose collate renames the entries:
    under fsdp a rank with a batch fewer runs its empty one through that collate too."""
    with ddpkit.Runtime(strategy, device="cpu") as rt:
        model = rt.setup(toy_model(seed=7))
        loader = torch.utils.data.DataLoader(
            _Named(toy_data(n, seed=3), ("ids", "y")), batch_size=8, collate_fn=_renamed
        )
        return rt.evaluate(model, loader, keys=("input_ids", "labels"))


class _MaskedInputs(torch.utils.data.Dataset):
    """toy_data as dicts of 'input_ids', an 'attention_mask' that zeroes every third feature
    of odd samples, and 'labels'; `masked()` is the same as (input * mask, target) pairs."""

    def __init__(self, n: int):
        self.pairs = toy_data(n, seed=3)

    def __len__(self) -> int:
        return len(self.pairs)

    def mask(self, i: int) -> torch.Tensor:
        m = torch.ones(6)
        if i % 2:
            m[::3] = 0
        return m

    def __getitem__(self, i: int) -> dict:
        x, y = self.pairs[i]
        return {"input_ids": x, "attention_mask": self.mask(i), "labels": y}

    def masked(self) -> TensorDataset:
        xs = torch.stack([self.pairs[i][0] * self.mask(i) for i in range(len(self))])
        return TensorDataset(xs, self.pairs.tensors[1])


class _TakesAMask(nn.Module):
    """toy_model called as a Hugging Face model is: with keyword arguments."""

    def __init__(self):
        super().__init__()
        self.net = toy_model(seed=7)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids * attention_mask)


def evaluate_masked(n: int, strategy: str = "ddp") -> dict:
    """rt.evaluate with keys=(('input_ids', 'attention_mask'), 'labels'): the model gets both
    entries as keyword arguments; and the same model on the masked pairs, for reference."""
    with ddpkit.Runtime(strategy, device="cpu") as rt:
        model = rt.setup(_TakesAMask())
        data = _MaskedInputs(n)
        named = rt.evaluate(model, data, batch_size=8, keys=(("input_ids", "attention_mask"), "labels"))
        pairs = rt.evaluate(rt.unwrap(model).net, data.masked(), batch_size=8) if strategy != "fsdp" else None
        return {"named": named, "pairs": pairs}


def evaluate_odd(n: int, strategy: str = "ddp", names: tuple[str, str] | None = None, keys=None) -> dict:
    """Evaluate a fixed model on a dataset of odd size `n`; with `names`, its samples are dicts
    (passed `keys`, or found by their names)."""
    with ddpkit.Runtime(strategy, device="cpu") as rt:
        model = rt.setup(toy_model(seed=7))
        data = toy_data(n, seed=3) if names is None else _Named(toy_data(n, seed=3), names)
        result = rt.evaluate(model, data, batch_size=4, keys=keys)
        shard = len(rt.eval_loader(data, batch_size=4).sampler)
        return {**result, "shard": shard}


def collectives() -> dict:
    with ddpkit.Runtime(device="cpu") as rt:
        r = rt.rank
        summed = rt.all_reduce(torch.tensor([r + 1.0]))
        mean = rt.all_reduce(float(r), op="mean")
        biggest = rt.all_reduce(torch.tensor([float(r)]), op="max")
        gathered = rt.all_gather(torch.full((r + 1, 2), float(r)))
        obj = rt.broadcast_object({"from": r, "list": [1, 2]} if r == 0 else None)
        objs = rt.gather_objects(f"rank{r}")
        rows = gather_rows(torch.tensor([float(r), 0.5 * r, -1.0], dtype=torch.float64))
        return {
            "rows": rows,
            "sum": summed.item(),
            "mean": mean,
            "max": biggest.item(),
            "shapes": [tuple(t.shape) for t in gathered],
            "values": [t.unique().tolist() for t in gathered],
            "obj": obj,
            "objs": objs,
        }


def save_under_ddp(path: str) -> dict:
    with ddpkit.Runtime(device="cpu", seed=0) as rt:
        model = toy_model(seed=5)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, opt = rt.setup(model, opt)
        for x, y in rt.loader(toy_data(48), batch_size=12):
            rt.backward(F.cross_entropy(model(x), y))
            rt.step(opt)
        rt.save(path, model=model, optimizer=opt, note="ddp")
        return {"wrapped": type(model).__name__, "params": flat_params(model)}


def load_under_ddp(path: str) -> dict:
    with ddpkit.Runtime(device="cpu") as rt:
        model = rt.setup(toy_model(seed=99))
        state = rt.load(path, model=model)
        return {"wrapped": type(model).__name__, "params": flat_params(model), "note": state.get("note")}


def fail_on_rank(bad_rank: int, after_barrier: bool = True) -> int:
    with ddpkit.Runtime(device="cpu") as rt:
        if rt.rank == bad_rank:
            raise ValueError(f"deliberate failure on rank {rt.rank}")
        if after_barrier:
            rt.barrier()  # the healthy ranks wait here for the one that died
        return rt.rank


def fail_then_linger(bad_rank: int, how: str) -> int:
    """`bad_rank` raises inside its Runtime, left by `with` or closed in a `finally` (`how`),
    and lingers once its process group is gone: its peers, in a barrier, fail at once, and the
    agent stops it with SIGTERM before torch's `record` has written its error file."""
    import time

    from ddpkit.core import dist

    if int(os.environ["RANK"]) == bad_rank:
        teardown = dist.teardown

        def slow_teardown() -> None:
            teardown()
            time.sleep(30)  # on its way to torch's `record`: the agent's SIGTERM comes first

        dist.teardown = slow_teardown
    if how == "with":
        with ddpkit.Runtime(device="cpu") as rt:
            _raise_on(rt, bad_rank)
    else:
        rt = ddpkit.Runtime(device="cpu")
        try:
            _raise_on(rt, bad_rank)
        finally:
            rt.close()
    return rt.rank


def noted_errors() -> list[bool]:
    """Whether this worker's `rank-R.raised` record exists after each of: a Runtime closed
    without an error inside an `except` (the error handled is not its); one left by an error,
    caught; a new Runtime (the rank went on); one left by an error raised while a Ctrl-C
    unwound (not the rank's own)."""
    from ddpkit.launcher import records

    path = os.path.join(records.attempt_dir(os.environ[records.LAUNCH_DIR], 0), f"rank-{os.environ['RANK']}.raised")
    seen = []
    try:
        raise OSError("handled before the Runtime")
    except OSError:
        with ddpkit.Runtime(device="cpu"):
            pass
    seen.append(os.path.exists(path))
    try:
        with ddpkit.Runtime(device="cpu"):
            raise ValueError("caught")
    except ValueError:
        pass
    seen.append(os.path.exists(path))
    with ddpkit.Runtime(device="cpu"):
        seen.append(os.path.exists(path))
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            with ddpkit.Runtime(device="cpu"):
                raise ValueError("in the cleanup after a Ctrl-C")  # noqa: B904 - raised as a cleanup would
    except ValueError:
        pass
    seen.append(os.path.exists(path))
    return seen


def _raise_on(rt: ddpkit.Runtime, bad_rank: int) -> None:
    rt.barrier()
    if rt.rank == bad_rank:
        raise ValueError(f"deliberate failure on rank {rt.rank}")
    rt.barrier()  # the healthy ranks wait here, and lose their peer as its group goes


def die_on_rank(bad_rank: int, how: str) -> int:
    """`bad_rank` dies while the others wait for it in a barrier: by SIGKILL (the out-of-memory
    killer), a segmentation fault, or os._exit without a Python error."""
    import ctypes
    import signal
    import time

    with ddpkit.Runtime(device="cpu") as rt:
        rt.barrier()
        if rt.rank == bad_rank:
            time.sleep(0.3)  # the others are inside the next barrier by now
            if how == "SIGKILL":
                os.kill(os.getpid(), signal.SIGKILL)
            elif how == "SIGTERM":  # from outside, as `kill PID` or a scheduler would
                os.kill(os.getpid(), signal.SIGTERM)
            elif how == "SIGSEGV":
                ctypes.string_at(0)  # reads address 0
            else:
                os._exit(3)
        rt.barrier()
        return rt.rank


def launch_folder_held() -> bool:
    """Whether this worker's launch folder is locked by its launch: a lock of the worker's own
    on its HELD file cannot be taken."""
    import fcntl

    from ddpkit.launcher import elastic, records

    fd = os.open(os.path.join(os.environ[records.LAUNCH_DIR], elastic.HELD), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def env_facts() -> dict:
    return {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "OMP_NUM_THREADS")}


def store_per_attempt(notes: str) -> dict:
    """Whether the workers' port is held from other programs before this worker has done
    anything (a plain bind, without SO_REUSEADDR, is refused), and a process group formed
    through it, in each attempt; rank 1 dies once after the group of attempt 0 formed. Each
    attempt's facts go to a file in `notes`: the first attempt returns nothing."""
    import socket
    import time

    import torch.distributed as dist

    rank, attempt = int(os.environ["RANK"]), os.environ["TORCHELASTIC_RESTART_COUNT"]
    port = int(os.environ["MASTER_PORT"])
    probe = socket.socket()
    try:
        probe.bind(("127.0.0.1", port))
        held = False
    except OSError:
        held = True
    finally:
        probe.close()
    dist.init_process_group("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)
    facts = {"port": port, "held": held, "sum": total.item()}
    with open(os.path.join(notes, f"rank{rank}-attempt{attempt}.txt"), "w") as f:
        f.write(repr(facts))
    dist.barrier()  # every rank's facts written before rank 1 dies
    if attempt == "0":
        if rank == 1:
            os._exit(3)
        time.sleep(60)  # stopped by the agent when rank 1 dies
    dist.destroy_process_group()
    return facts


def invariant_steps(
    steps: int,
    global_batch: int,
    micro: int | None = None,
    n: int = 90,
    max_grad_norm: float | None = None,
    strategy: str = "ddp",
    precision: str = "fp32",
    fsdp: dict | None = None,
    compile: bool = False,
) -> dict:
    """`steps` SGD steps of a fixed model on a fixed set: what 1, 2 and 3 ranks must agree on.
    Also returns the exact loss over the whole set before and after, the dtypes of the
    (sharded) parameters, the GradScaler's scale (fp16) and this process's compiled graphs."""
    from ddpkit.strategy import compiled_graphs

    with ddpkit.Runtime(strategy, precision, device="cpu", seed=5, fsdp=fsdp, compile=compile) as rt:
        model = rt.build(lambda: toy_model(seed=5))  # fsdp: on meta but on rank 0
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        model, opt = rt.setup(model, opt)
        loader = rt.loader(toy_data(n, seed=2), batch_size=global_batch, micro_batch_size=micro)
        loss_before = rt.evaluate(model, toy_data(n, seed=2), batch_size=32)["loss"]
        done = 0
        while done < steps:
            for x, y in loader:
                rt.backward(F.cross_entropy(model(x), y))
                done += rt.step(opt, max_grad_norm=max_grad_norm)
                if done == steps and rt.step_ready:
                    break
        scaler = rt.precision.scaler
        return {
            "params": flat_params(model),
            "position": (loader.epoch, loader.position),
            "strategy": rt.strategy,
            "loss": (loss_before, rt.evaluate(model, toy_data(n, seed=2), batch_size=32)["loss"]),
            "dtypes": {p.dtype for p in model.parameters()},
            "scale": scaler.get_scale() if scaler else None,
            "graphs": compiled_graphs(),
        }


def several_runs(runs: dict[str, dict]) -> dict:
    """`invariant_steps(**kwargs)` for each name -> kwargs, one after another in one job: the
    outer Runtime's process group serves them all (a Runtime uses a group that exists)."""
    with ddpkit.Runtime(device="cpu"):
        return {name: invariant_steps(**kwargs) for name, kwargs in runs.items()}


def fsdp_fp16_overflow_on_one_rank() -> dict:
    """An fp16 step under fsdp whose gradient overflows in rank 1's shard only: what each rank
    did with it (every rank must skip the step and halve the scale, or the shards diverge)."""
    from ddpkit.strategy import local  # this rank's shard, sharing its memory

    with ddpkit.Runtime("fsdp", "fp16", device="cpu", seed=5) as rt:
        model = toy_model(seed=5)
        model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.2))
        before = [local(p).clone() for p in model.parameters()]
        scale = rt.precision.scaler.get_scale()
        x, y = toy_data(8, seed=2).tensors
        rt.backward(F.cross_entropy(model(x[rt.rank :: 2]), y[rt.rank :: 2]))
        if rt.rank == 1:
            local(next(model.parameters()).grad)[0, 0] = float("inf")  # this rank's shard only
        rt.step(opt)
        unchanged = all(torch.equal(b, local(p)) for b, p in zip(before, model.parameters()))
        return {"unchanged": unchanged, "scale": (scale, rt.precision.scaler.get_scale())}


def rank_streams() -> dict:
    import random

    import numpy as np

    with ddpkit.Runtime(device="cpu", seed=11) as rt:
        init = torch.rand(3)  # drawn before setup: the same on every rank, like model init
        rt.setup(toy_model())
        return {"init": init, "torch": torch.rand(3), "numpy": float(np.random.rand()), "python": random.random()}


def plain_reference(steps: int, global_batch: int, n: int = 90, max_grad_norm: float | None = None) -> torch.Tensor:
    """The same training as `invariant_steps` written in plain PyTorch on one process: mean loss
    over each whole global batch, in the order of epoch 0, 1, ... of the sampler's permutation."""
    from ddpkit.data import GlobalBatchSampler

    torch.manual_seed(5)
    model = toy_model(seed=5)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    x_all, y_all = toy_data(n, seed=2).tensors
    sampler, done, epoch = GlobalBatchSampler(n, global_batch, 1, 0, seed=5), 0, 0
    while done < steps:
        sampler.set_epoch(epoch)
        for indices, _ in sampler.plan():
            F.cross_entropy(model(x_all[indices]), y_all[indices]).backward()
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            opt.step()
            opt.zero_grad()
            done += 1
            if done == steps:
                break
        epoch += 1
    return flat_params(model)


def stall_on_rank(bad_rank: int, timeout_s: float) -> int:
    """`bad_rank` stops reaching collectives; the others wait in a barrier for at most timeout_s."""
    import time

    with ddpkit.Runtime(device="cpu", timeout_s=timeout_s) as rt:
        if rt.rank == bad_rank:
            time.sleep(600)
        rt.barrier()
        return rt.rank


def freeze_on_rank(bad_rank: int, timeout_s: float, how: str = "SIGSTOP", path: str | None = None) -> int:
    """`bad_rank` stops itself with `how` (SIGSTOP, as a debugger or an operator would, or
    SIGTSTP, Ctrl-Z's) and is never continued; the others wait in a barrier for at most
    timeout_s, or, with a `path`, save a checkpoint there (rank 0 writes it, then waits for the
    others in the wait that does not count a slow write)."""
    import signal

    from ddpkit.core import dist

    with ddpkit.Runtime(device="cpu", timeout_s=timeout_s) as rt:
        rt.barrier()
        if path is not None:
            if rt.rank == bad_rank:  # it stops where it would wait for rank 0's write
                dist.wait_for_main = lambda: _frozen_here(getattr(signal, how))
            rt.save(path, model=toy_model())
        elif rt.rank == bad_rank:
            _frozen_here(getattr(signal, how))
        rt.barrier()
        return rt.rank


def _frozen_here(sig: int) -> None:
    import signal

    # SIGTSTP is discarded in an orphaned process group (pytest under `timeout` in a background
    # job): a group of its own, whose parent (the launcher) is in this session, is not one.
    # (SIGSTOP always stops: nothing to change for it.)
    if sig == signal.SIGTSTP:
        os.setpgid(0, 0)
    os.kill(os.getpid(), sig)


def slow_save_on_main(path: str, timeout_s: float, seconds: float) -> str:
    """Rank 0's checkpoint write takes longer than the collective timeout; nobody may fail."""
    import time

    import ddpkit.checkpoint as checkpoint

    real = checkpoint.save_file

    def slow(*args, **kwargs):
        time.sleep(seconds)
        real(*args, **kwargs)

    checkpoint.save_file = slow
    with ddpkit.Runtime(device="cpu", timeout_s=timeout_s) as rt:
        rt.save(path, model=toy_model())
        rt.barrier()  # and the ordinary timeout still applies to ordinary collectives
        return "saved"


def ddp_options_weights(options: dict, steps: int = 6) -> torch.Tensor:
    """This rank's weights after `steps` DDP steps of a small conv net with DDP `options`."""
    from ddpkit import data

    with ddpkit.Runtime(device="cpu", seed=4, ddp=options) as rt:
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 10)
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, opt = rt.setup(model, opt)
        train = data.synthetic((3, 8, 8), 96, 10, seed=1).train
        done = 0
        while done < steps:
            for x, y in rt.loader(train, batch_size=16):
                rt.backward(F.cross_entropy(model(x), y))
                done += rt.step(opt)
                if done == steps:
                    break
        return flat_params(model)


def checkpoint_hop(path: str, strategy: str, phase: str, steps: int = 4) -> dict:
    """Half of a run that stops and continues elsewhere: AdamW (state to carry) on a fixed set,
    global batch 10. 'save' trains `steps` steps and saves; 'load' loads and trains `steps`
    more; 'straight' trains 2 * `steps` without stopping."""
    with ddpkit.Runtime(strategy, device="cpu", seed=5) as rt:
        model = toy_model(seed=5)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        model, opt = rt.setup(model, opt)
        loader = rt.loader(toy_data(90, seed=2), batch_size=10)
        if phase == "load":
            rt.load(path, model=model, optimizer=opt, loader=loader)
        done, todo = 0, 2 * steps if phase == "straight" else steps
        while done < todo:
            for x, y in loader:
                rt.backward(F.cross_entropy(model(x), y))
                done += rt.step(opt)
                if done == todo:
                    break
        if phase == "save":
            rt.save(path, model=model, optimizer=opt, loader=loader)
        return {"params": flat_params(model), "strategy": rt.strategy}


def fsdp_sync_switch() -> dict:
    """One step of 3 micro-batches under fsdp: what the gradients look like after the first
    backward (no reduce-scatter: FSDP2 keeps them unsharded inside, p.grad stays None) and
    after the last (reduced: sharded DTensor gradients)."""
    from torch.distributed.tensor import DTensor

    with ddpkit.Runtime("fsdp", device="cpu", seed=5) as rt:
        model = toy_model(seed=5)
        model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        seen = []
        for x, y in rt.loader(toy_data(12), batch_size=12, micro_batch_size=2):
            rt.backward(F.cross_entropy(model(x), y))
            seen.append({type(p.grad).__name__ for p in model.parameters()})
            if rt.step(opt):
                break
        return {"seen": seen, "dtensor_params": all(isinstance(p, DTensor) for p in model.parameters())}


def batchnorm_steps() -> dict:
    """6 SGD steps of a BatchNorm MLP under ddp and under fsdp, in one job: each rank's weights
    and buffers, and (fsdp) the running statistics its own batches alone would have given."""
    out = {}
    with ddpkit.Runtime(device="cpu"):
        for strategy in ("ddp", "fsdp"):
            with ddpkit.Runtime(strategy, device="cpu", seed=5) as rt:
                torch.manual_seed(5)
                model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
                own = nn.BatchNorm1d(16)  # fed this rank's batches, never broadcast
                model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.2))
                done = 0
                for x, y in rt.loader(toy_data(90, seed=2), batch_size=10):
                    rt.backward(F.cross_entropy(model(x), y))
                    with torch.no_grad():
                        own(ddpkit.Runtime.unwrap(model)[0](x))
                    done += rt.step(opt)
                    if done == 6:
                        break
                bn = ddpkit.Runtime.unwrap(model)[1]
                out[strategy] = {
                    "params": flat_params(model),
                    "buffers": torch.cat([bn.running_mean, bn.running_var]).clone(),
                    "own": torch.cat([own.running_mean, own.running_var]),
                }
    return out


def uneven_text(n_docs: int = 10, seq_len: int = 12, seed: int = 5):
    """A TextSet of documents of random lengths (2 to 40 bytes): sequences of 1 to `seq_len`
    tokens, cut at document ends (21 with the defaults: a global batch of 10 leaves one for the
    third step, so two of three ranks have empty shares)."""
    from ddpkit.data import TextSet
    from ddpkit.data.text import cut

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 41, (n_docs,), generator=g).tolist()
    documents = [bytes(torch.randint(97, 123, (n,), generator=g).tolist()) for n in lengths]
    return TextSet(*cut(documents, seq_len), seq_len)


def tiny_gpt(seq_len: int = 12) -> nn.Module:
    from ddpkit import models

    torch.manual_seed(7)
    return models.build("gpt", (seq_len,), 256, width=16, depth=2, heads=2)


def token_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the batch's real tokens (padding is IGNORE)."""
    from ddpkit.data import IGNORE

    return F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE)


def token_steps(rt: ddpkit.Runtime, model: nn.Module, opt: torch.optim.Optimizer, loader, steps: int) -> None:
    """`steps` optimizer steps of `model` on `loader`'s (tokens, targets), by the mean token loss."""
    done = 0
    while done < steps:
        for x, y in loader:
            rt.backward(token_loss(model, x, y))
            done += rt.step(opt)
            if done == steps and rt.step_ready:
                break


def token_weighted_steps(steps: int, global_batch: int, micro: int | None, strategy: str) -> dict:
    """`steps` SGD steps of a tiny gpt on sequences of uneven length, twice from the same
    weights: on the TextSet (its `token_counts` make the loader weigh micro-batches by
    tokens), and on the same padded samples as a TensorDataset (no token counts: weighted by
    samples, what the runtime did before token weighting)."""
    from ddpkit.strategy.fsdp import is_sharded

    text = uneven_text()
    x_all, y_all = text.batch(torch.arange(len(text)))
    out = {}
    with ddpkit.Runtime(strategy, device="cpu", seed=5) as rt:
        for name, dataset in (("tokens", text), ("samples", TensorDataset(x_all, y_all))):
            model = tiny_gpt()
            model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
            token_steps(rt, model, opt, rt.loader(dataset, batch_size=global_batch, micro_batch_size=micro), steps)
            out[name] = flat_params(model)
        out["strategy"] = rt.strategy
        out["units"] = sorted(name for name, m in model.named_modules() if is_sharded(m))  # fsdp's
    return out


def token_reference(steps: int, global_batch: int) -> torch.Tensor:
    """The same training in plain PyTorch on one process: each step the mean over every real
    token of the whole global batch, in the sampler's order."""
    from ddpkit.data import GlobalBatchSampler

    text = uneven_text()
    model = tiny_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    sampler, done, epoch = GlobalBatchSampler(len(text), global_batch, 1, 0, seed=5), 0, 0
    while done < steps:
        sampler.set_epoch(epoch)
        for indices, _ in sampler.plan():
            token_loss(model, *text.batch(torch.tensor(indices))).backward()
            opt.step()
            opt.zero_grad()
            done += 1
            if done == steps:
                break
        epoch += 1
    return flat_params(model)


class Buffered(nn.Module):
    """A small model with both kinds of buffers, each drawn at random: a persistent one (in the
    state dict) and a non-persistent one (in none, so only rank 0 can give its values)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 13), nn.ReLU(), nn.Linear(13, 3))  # 13 rows: uneven shards
        self.register_buffer("scale", torch.rand(3) + 0.5)
        self.register_buffer("shift", torch.randn(3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale + self.shift


def fsdp_built_from_rank0(steps: int = 3) -> dict:
    """fsdp with the model from `rt.build`: where each rank built it, the whole initial state
    (gathered) and buffers, then a few AdamW steps with the optimizer built before setup."""
    from ddpkit.strategy.fsdp import full_model_state

    with ddpkit.Runtime("fsdp", device="cpu", seed=3) as rt:
        model = rt.build(Buffered)
        built_on = sorted({t.device.type for t in [*model.parameters(), *model.buffers()]})
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        model, opt = rt.setup(model, opt)
        whole = full_model_state(model) if rt.strategy == "fsdp" else model.state_dict()  # gathered on rank 0
        state = {key: value.clone() for key, value in whole.items()}  # before training changes it
        shift = model.shift.clone()
        loader = rt.loader(toy_data(40, seed=2), batch_size=10)
        done = 0
        for x, y in loader:
            rt.backward(F.cross_entropy(model(x), y))
            done += rt.step(opt)
            if done == steps:
                break
        return {
            "built_on": built_on,
            "state": state,
            "shift": shift,
            "params": flat_params(model),
            "strategy": rt.strategy,
        }


class SizedByATensor(nn.Module):
    """A constructor that reads a tensor's value (`.item()`), which the meta device cannot give."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(int(torch.tensor(6).item()), 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def fsdp_meta_edge_cases() -> dict:
    """fsdp on several processes: a constructor meta cannot run (built in full instead, still
    rank 0's values after setup), then a model on meta on every rank (refused everywhere)."""
    from ddpkit.errors import UsageError

    with ddpkit.Runtime("fsdp", device="cpu", seed=3) as rt:
        model = rt.build(SizedByATensor)
        built_on = sorted({p.device.type for p in model.parameters()})
        model = rt.setup(model)
        params = flat_params(model)
        with torch.device("meta"):
            everywhere = toy_model()
        try:
            rt.setup(everywhere)
            refused = ""
        except UsageError as err:
            refused = str(err)
        return {"built_on": built_on, "params": params, "refused": refused}


def fsdp_training_memory(steps: int = 3) -> dict:
    """fsdp on 16 MiB layers (AdamW): how far this rank's RSS rose above its level after setup
    while training, and what the allocator ran with."""
    from ddpkit.core import allocator
    from ddpkit.core.memory import peak_rss_mib, reset_peak_rss, rss_mib

    with ddpkit.Runtime("fsdp", device="cpu", seed=0) as rt:
        model = rt.build(lambda: nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)]))
        model, opt = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        x = torch.randn(8, 2048)
        reset_peak_rss()
        before = rss_mib()
        for _ in range(steps):
            model(x).square().mean().backward()
            rt.step(opt)
        return {"allocator": allocator.state(), "growth_mib": peak_rss_mib() - before}


def wide_model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 3))


def background_save_left(path: str, raise_after: bool) -> dict:
    """Under fsdp, a checkpoint saved in the background, and the `with Runtime` block left at
    once, without waiting for it: by returning, or by raising."""
    with ddpkit.Runtime("fsdp", device="cpu", seed=0) as rt:
        model = wide_model()
        model, opt = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01))
        for x, y in rt.loader(toy_data(40), batch_size=20):
            rt.backward(F.cross_entropy(model(x), y))
            rt.step(opt)
        params = flat_params(model)
        rt.save(path, background=True, model=model, optimizer=opt)
        if raise_after:
            raise RuntimeError("left with the save under way")
        return {"params": params}


class _RankStream(torch.utils.data.IterableDataset):
    """A stream of `n` samples on every rank but `short_rank`, where it has `short` fewer:
    a dataset that reads a file of the rank's own, one of them cut short."""

    def __init__(self, n: int, short_rank: int, short: int, lag_s: float = 0.0):
        self.n, self.short_rank, self.short, self.lag_s = n, short_rank, short, lag_s

    def __iter__(self):
        import time

        rank = int(os.environ.get("RANK", "0"))
        n = self.n - (self.short if rank == self.short_rank else 0)
        for i in range(n):
            yield torch.full((4,), float(i)), torch.tensor(i % 2)
        if rank == 0:  # late to the end of every epoch; after the last one, the first to leave
            time.sleep(self.lag_s)


def short_stream_on_rank(short_rank: int, short: int, timeout_s: float = 600.0, lag_s: float = 0.0) -> int:
    """Two epochs over a stream that ends `short` samples sooner on `short_rank`; rank 0 comes
    to the end of each `lag_s` seconds after the others."""
    with ddpkit.Runtime(device="cpu", timeout_s=timeout_s, seed=0) as rt:
        model = rt.setup(torch.nn.Linear(4, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = rt.loader(_RankStream(64, short_rank, short, lag_s), batch_size=8)
        steps = 0
        for _ in range(2):
            for x, y in loader:
                rt.backward(torch.nn.functional.cross_entropy(model(x), y))
                rt.step(opt)
                steps += 1
        return steps


def thread_facts() -> dict:
    """This worker's torch threads and why the Runtime says it runs that many."""
    with ddpkit.Runtime(device="cpu") as rt:
        return {"threads": torch.get_num_threads(), "why": rt.threads, "OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"]}


def checkpointed_steps(strategy: str, steps: int = 4, dropout: float = 0.2) -> dict:
    """A tiny gpt with dropout, trained `steps` SGD steps on the same text twice in one
    Runtime's worth of settings: with its blocks' activations checkpointed and without. Returns
    both weights, and the names of the blocks checkpointed."""
    from ddpkit import models
    from ddpkit.strategy import activations

    text = uneven_text(n_docs=16)
    out = {}
    for choice in (None, True):  # (two Runtimes one after the other: each makes its own group)
        with ddpkit.Runtime(strategy, device="cpu", seed=3, activation_checkpointing=choice) as rt:
            torch.manual_seed(7)
            model = models.build("gpt", (12,), 256, width=16, depth=2, heads=2, dropout=dropout)
            model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
            token_steps(rt, model, opt, rt.loader(text, batch_size=8, micro_batch_size=2), steps)
            out["checkpointed" if choice else "plain"] = flat_params(model)
            if choice:
                bare = rt.unwrap(model)
                out["blocks"] = [n for n, m in bare.named_modules() if activations.is_checkpointed(m)]
                out["strategy"] = rt.strategy
    return out


def sequential_runtimes(count: int = 3) -> list[float]:
    """`count` Runtimes one after the other in this worker, each making (and at its end
    destroying) the job's process group: a DDP step and a sum over the ranks in each."""
    sums = []
    for i in range(count):
        with ddpkit.Runtime("ddp", device="cpu", seed=i) as rt:
            model = rt.setup(toy_model(seed=i))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            x, y = toy_data(8, seed=i).tensors
            rt.backward(F.cross_entropy(model(x), y))
            rt.step(opt)
            sums.append(rt.all_reduce(float(rt.rank + 1)))
    return sums
