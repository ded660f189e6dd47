"""Workers for tests/test_mesh.py (importable, so `ddpkit.launch` finds them): a tiny gpt with
dropout trained by token weighting on uneven text under each layout of a job, evaluated, and
saved or resumed across layouts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import ddpkit
from ddpkit import models, strategy
from ddpkit.data import IGNORE
from ddpkit.strategy import activations
from tests.workers import uneven_text

STEPS, GLOBAL_BATCH, MICRO = 6, 10, 2
MAX_GRAD_NORM = 0.5


# Llama-shaped: RMSNorm, SwiGLU, rotary positions, no biases, two key/value heads for the four
LLAMA = {"style": "llama", "kv_heads": 2, "hidden": 24}


def mesh_gpt(**shape: object) -> nn.Module:
    """Four heads of width 4: split whole over tp=2 or tp=4; the vocabulary (256) too. `shape`:
    more of gpt's options (LLAMA)."""
    torch.manual_seed(7)
    return models.build("gpt", (12,), 256, width=16, depth=2, heads=4, dropout=0.1, **shape)


def mean_token_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=IGNORE)


def whole_state(rt: ddpkit.Runtime, model: nn.Module) -> dict[str, torch.Tensor]:
    """model.pt's state: every parameter whole, bare names (on rank 0; {} elsewhere when sharded)."""
    return strategy.full_model_state(model) if rt.sharded else rt.unwrap(model).state_dict()


def flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([state[k].detach().float().reshape(-1).cpu() for k in sorted(state)]) if state else torch.empty(0)


def train(
    layout: tuple[str, str | None],
    steps: int = STEPS,
    max_grad_norm: float | None = MAX_GRAD_NORM,
    load: str | None = None,
    start: int = 0,
    save_at: int | None = None,
    save: str | None = None,
    checkpointing: bool | str = False,
    schedule: str = "1f1b",
    ddp: dict | None = None,
    shape: dict | None = None,
) -> dict:
    """The tiny gpt under `layout` (strategy, mesh): resumed from `load` (saved after step
    `start`) if given, trained (SGD
    with momentum, clipped to MAX_GRAD_NORM over every shard) up to `steps` optimizer steps in
    all, its state saved to `save` after step `save_at`; then evaluated exactly, with each test
    sample's predictions gathered; with `checkpointing`, each block's activations checkpointed
    (in full, or "selective");
    `ddp`: DDPOptions, where DDP runs; `shape`: the gpt's options (LLAMA). Returns rank 0's view of the weights and every rank's facts."""
    name, mesh = layout
    text = uneven_text()
    with ddpkit.Runtime(
        name,
        device="cpu",
        seed=5,
        mesh=mesh,
        activation_checkpointing=bool(checkpointing) or None,
        activation_checkpointing_mode="selective" if checkpointing == "selective" else "full",
        pp_schedule=schedule,
        ddp=ddp,
    ) as rt:
        model = mesh_gpt(**(shape or {}))
        model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
        loader = rt.loader(text, batch_size=GLOBAL_BATCH, micro_batch_size=MICRO)
        if load is not None:
            rt.load_state(load)
        seen, done = 0, start  # samples this rank's micro-batches held; optimizer steps
        while done < steps:
            for x, y in loader:
                seen += len(x)
                rt.forward_backward(model, x, y, mean_token_loss)  # (under pp: through the schedule)
                if rt.step(opt, max_grad_norm=max_grad_norm):
                    done += 1
                    if done in (save_at, steps):
                        break
            if save is not None and done == save_at:
                rt.save_state(save)
                save = None
        result = rt.evaluate(  # each sample's summed token loss: its mean does not depend on the batches
            model,
            text,
            metrics={
                "sample_loss": lambda out, y: F.cross_entropy(
                    out.transpose(1, 2), y, ignore_index=IGNORE, reduction="none"
                ).sum(1)
            },
            outputs=lambda out, y: out.argmax(-1),
            batch_size=4,
        )
        state = whole_state(rt, model)
        return {
            "strategy": rt.strategy,
            "mesh": str(rt.layout.spec),
            "where": rt.layout.where(rt.rank),
            "data_rank": rt.data_rank,
            "data_world_size": rt.data_world_size,
            "weights": flat(state),
            "names": sorted(state),
            "loss": result["sample_loss"],
            "samples": result["samples"],
            "predictions": result["outputs"],
            "trained_samples": rt.all_reduce(seen),
            "steps": done,
            "checkpointed": sorted(n for n, m in rt.unwrap(model).named_modules() if activations.is_checkpointed(m)),
        }


class Noisy(torch.utils.data.Dataset):
    """Each sample with noise drawn as it is read, from the process's random stream (as a
    random augmentation does): the ranks of a tp group must draw the same."""

    def __init__(self, x: torch.Tensor):
        self.x = x

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor]:
        return (self.x[i] + 0.1 * torch.randn(self.x.shape[1:]),)


def user_plan(mesh: str | None) -> torch.Tensor:
    """docs/parallelism.md's model of one's own with its plan given to the Runtime (under a tp
    mesh), trained 3 clipped AdamW steps on noisy samples; its whole weights (on rank 0)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    torch.manual_seed(3)
    model = nn.Sequential()
    model.add_module("up", nn.Linear(8, 16))
    model.add_module("act", nn.GELU())
    model.add_module("down", nn.Linear(16, 8))
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    data = Noisy(torch.randn(24, 8, generator=torch.Generator().manual_seed(4)))
    with ddpkit.Runtime("tp", device="cpu", seed=3, mesh=mesh, tp_plan=plan) as rt:
        model, opt = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=0.05))
        for (x,) in rt.loader(data, batch_size=8):
            rt.backward(model(x).pow(2).mean())
            rt.step(opt, max_grad_norm=0.1)
        return flat(whole_state(rt, model))


def user_plan_pp(mesh: str | None) -> torch.Tensor:
    """A Sequential of one's own whose plan splits only its first stage's layers, under `mesh`
    (pp x tp: the second stage runs whole on its tp ranks), 3 clipped AdamW steps through the
    pipeline; its whole weights (on rank 0)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    torch.manual_seed(3)
    model = nn.Sequential()
    for name, layer in (("up", nn.Linear(8, 16)), ("act", nn.GELU()), ("down", nn.Linear(16, 8))):
        model.add_module(name, layer)
    model.add_module("tail", nn.Linear(8, 8))
    model.add_module("out", nn.Linear(8, 8))
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    data = Noisy(torch.randn(24, 8, generator=torch.Generator().manual_seed(4)))
    with ddpkit.Runtime(device="cpu", seed=3, mesh=mesh, tp_plan=plan if mesh else None) as rt:
        model, opt = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=0.05))
        for (x,) in rt.loader(data, batch_size=8, micro_batch_size=4):
            rt.forward_backward(model, x, x, lambda out, y: out.pow(2).mean())
            rt.step(opt, max_grad_norm=0.1)
        return flat(whole_state(rt, model))


def old_qkv(mesh: str) -> dict:
    """A state_dict of ddpkit 0.2's gpt (one fused `qkv` map per block) loaded whole into the
    tiny gpt split under `mesh` (tp, FSDP over dp), and into the bare model: both whole states."""
    bare = mesh_gpt()
    old = {}
    for name, value in bare.state_dict().items():
        prefix, _, rest = name.partition(".attn.")
        if rest in ("q.weight", "q.bias"):
            kind = rest.split(".")[1]
            parts = [bare.state_dict()[f"{prefix}.attn.{m}.{kind}"] + i for i, m in enumerate("qkv")]
            old[f"{prefix}.attn.qkv.{kind}"] = torch.cat(parts)
        elif rest[:2] not in ("k.", "v.", "q."):
            old[name] = value + 0.5
    bare.load_state_dict(old)
    with ddpkit.Runtime("tp", device="cpu", seed=5, mesh=mesh) as rt:
        model, _ = rt.setup(mesh_gpt(), torch.optim.SGD(mesh_gpt().parameters(), lr=0.1))
        strategy.load_full_model_state(model, old)
        return {"split": flat(whole_state(rt, model)), "bare": flat(bare.state_dict())}


class Counter(nn.Module):
    """Counts its training forwards in a buffer (as a module with running statistics does)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("forwards", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.forwards += 1
        return x


def compute_dtype(mesh: str) -> str:
    """The dtype a block's first MLP layer computes in, in training, under tp on `mesh` at bf16."""
    seen = []
    with ddpkit.Runtime("tp", device="cpu", seed=0, mesh=mesh, precision="bf16") as rt:
        model = rt.setup(mesh_gpt())
        rt.unwrap(model).block0.mlp[0].register_forward_hook(lambda m, i, out: seen.append(str(out.dtype)))
        model.train()
        model(torch.randint(0, 256, (2, 12)))
    return seen[0]


def counted_forwards(mesh: str | None) -> int:
    """Two steps of 2 micro-batches through Linear, Counter, Linear (under pp=2 the Counter sits
    on the second stage, where torch's shape inference runs it once on uninitialized tensors),
    then an evaluation: the Counter's count, gathered whole."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Counter(), nn.Linear(4, 2))
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    with ddpkit.Runtime("ddp", device="cpu", seed=0, mesh=mesh) as rt:
        model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for x, y in rt.loader(data, batch_size=8, micro_batch_size=4):
            rt.forward_backward(model, x, y, F.cross_entropy)
            rt.step(opt)
        rt.evaluate(model, data)
        return int(whole_state(rt, model).get("1.forwards", -1))


def grouped(
    mesh: str | None, steps: int = 4, load: str | None = None, start: int = 0, save: str | None = None, save_at: int = 0
) -> dict:
    """A small MLP (Linear, Tanh, Linear, Tanh, Linear) stepped by two optimizers, AdamW over two
    parameter groups of their own settings (one of them under a LambdaLR) and SGD over the rest,
    with an EMA: under pp=2 some groups, and all of one optimizer's, have no parameter on a stage.
    Resumed from `load` (saved after step `start`) if given; saved to `save` after `save_at`.
    Returns every rank's weights and EMA merged (rank order), and AdamW's learning rates."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    p = dict(model.named_parameters())
    adamw = torch.optim.AdamW(
        [
            {"params": [p["0.weight"]], "lr": 0.01},
            {"params": [p["2.weight"], p["2.bias"]], "lr": 0.02, "weight_decay": 0},
        ]
    )
    sgd = torch.optim.SGD([p["0.bias"], p["4.weight"], p["4.bias"]], lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(22, 6, generator=g), torch.randint(0, 3, (22,), generator=g))
    with ddpkit.Runtime("ddp", device="cpu", seed=3, mesh=mesh) as rt:
        model, adamw, sgd = rt.setup(model, adamw, sgd)
        schedule = torch.optim.lr_scheduler.LambdaLR(adamw, lambda step: 1.0 / (1 + step))
        ema = ddpkit.EMA(model, 0.9)
        loader = rt.loader(data, batch_size=8, micro_batch_size=2)
        if load is not None:
            rt.load_state(load, schedule=schedule, ema=ema)
        done = start
        while done < steps:
            for x, y in loader:
                rt.forward_backward(model, x, y, F.cross_entropy)
                if rt.step(adamw) and rt.step(sgd):
                    schedule.step()
                    ema.update()
                    done += 1
                    if done == save_at and save is not None:
                        rt.save_state(save, schedule=schedule, ema=ema)
                    if done == steps:
                        break
        own = {**rt.unwrap(model).state_dict(), **{f"ema.{k}": v for k, v in ema.state_dict().items()}}
        merged = {k: v for part in rt.gather_objects(own) for k, v in part.items()}
        return {"weights": flat(merged), "lr": [group["lr"] for group in adamw.param_groups]}


def layouts(runs: dict[str, dict]) -> dict:
    """`train(**kwargs)` (or `user_plan(**kwargs)`, for kwargs with a "user_plan" mesh) for each
    name -> kwargs, one after another in one job: the outer Runtime's process group serves them
    all."""
    with ddpkit.Runtime(device="cpu"):
        return {
            name: user_plan(kwargs["user_plan"])
            if "user_plan" in kwargs
            else user_plan_pp(kwargs["user_plan_pp"])
            if "user_plan_pp" in kwargs
            else old_qkv(kwargs["old_qkv"])
            if "old_qkv" in kwargs
            else counted_forwards(kwargs["counted"])
            if "counted" in kwargs
            else compute_dtype(kwargs["dtype"])
            if "dtype" in kwargs
            else grouped(**kwargs["grouped"])
            if "grouped" in kwargs
            else train(**kwargs)
            for name, kwargs in runs.items()
        }


def fail_on_rank(bad_rank: int, mesh: str) -> None:
    """Raise on `bad_rank` once the Runtime has placed every rank on `mesh`."""
    with ddpkit.Runtime("ddp", device="cpu", mesh=mesh) as rt:
        rt.barrier()
        if rt.rank == bad_rank:
            raise ValueError(f"boom on {rt.layout.where(rt.rank)}")
        rt.barrier()
