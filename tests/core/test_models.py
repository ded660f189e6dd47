"""`models`: every built-in model builds and runs on the shapes it accepts and names the ones it
refuses; `--model package.module:function` builds a user's own network, in one process and in
the workers of `ddpkit train --nproc 2`."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from torch import nn

from ddpkit import models
from ddpkit.errors import UsageError
from ddpkit.trainer import TrainConfig, resolve
from tests.conftest import run_cli


@pytest.mark.unit
@pytest.mark.parametrize("name", [m for m in models.MODELS if m not in models.LANGUAGE_MODELS])
@pytest.mark.parametrize("shape", [(1, 8, 8), (3, 32, 32), (1, 28, 28)])
def test_models_build_and_run(name, shape):
    if min(shape[1:]) < models.MIN_SIZE.get(name, 1):
        with pytest.raises(ValueError, match="at least"):
            models.build(name, shape, 10)
        return
    net = models.build(name, shape, 10)
    assert net(torch.randn(2, *shape)).shape == (2, 10)


@pytest.mark.unit
def test_gpt_is_causal_and_a_sequence_of_shard_units():
    net = models.build("gpt", (16,), 256, width=32, depth=3, heads=4)
    assert [name for name, _ in net.named_children()] == ["embed", "block0", "block1", "block2", "head"]
    assert sum(p.numel() for p in net.parameters()) == models.gpt_parameters(16, 256, 32, 3)
    x = torch.randint(0, 256, (2, 16))
    changed = x.clone()
    changed[:, 9:] = (x[:, 9:] + 1) % 256
    out, out_changed = net(x), net(changed)
    assert out.shape == (2, 16, 256)
    torch.testing.assert_close(out[:, :9], out_changed[:, :9])  # position t sees positions <= t only
    assert (out[:, 9:] - out_changed[:, 9:]).abs().max() > 1e-3
    assert net(x[:, :5]).shape == (2, 5, 256) and net(x[:0]).shape == (0, 16, 256)  # shorter, and empty
    with pytest.raises(ValueError, match="multiple"):
        models.build("gpt", (16,), 256, width=30, heads=4)
    with pytest.raises(ValueError, match="--data text"):
        models.check("gpt", (1, 8, 8))


@pytest.mark.unit
def test_a_llama_shaped_gpt_is_causal_has_llamas_parts_and_counts_its_parameters():
    shape = {"width": 32, "depth": 2, "heads": 4, "style": "llama", "kv_heads": 2}
    net = models.build("gpt", (16,), 256, **shape)
    names = {n for n, _ in net.named_parameters()}
    assert {"block0.mlp.gate.weight", "block0.mlp.up.weight", "block0.mlp.down.weight"} <= names
    assert not any(n.endswith("bias") for n in names) and "embed.positions.weight" not in names
    assert isinstance(net.block0.norm1, nn.RMSNorm) and net.block0.attn.k.out_features == 16  # 2 heads of 8
    assert net.block0.mlp.gate.out_features == models.mlp_width(32, "llama") == 256  # 8/3 x 32, up to 256
    counted = models.gpt_parameters(16, 256, 32, 2, style="llama", heads=4, kv_heads=2)
    assert sum(p.numel() for p in net.parameters()) == counted
    # GQA, a hidden width of one's own and GPT-2's style count right too
    for options in ({"kv_heads": 1}, {"hidden": 40}, {"style": "llama", "hidden": 40, "kv_heads": 4}):
        built = models.build("gpt", (16,), 256, width=32, depth=2, heads=4, **options)
        counted = models.gpt_parameters(16, 256, 32, 2, heads=4, **options)
        assert sum(p.numel() for p in built.parameters()) == counted, options
    x = torch.randint(0, 256, (2, 16))
    changed = x.clone()
    changed[:, 9:] = (x[:, 9:] + 1) % 256
    out, out_changed = net(x), net(changed)
    torch.testing.assert_close(out[:, :9], out_changed[:, :9])
    assert (out[:, 9:] - out_changed[:, 9:]).abs().max() > 1e-3


@pytest.mark.unit
def test_rotary_positions_make_attention_scores_depend_on_the_offset_only():
    """A query at position m and a key at n score q.k as a function of m - n: the same pair
    moved 3 positions on scores the same; each vector keeps its length (a rotation)."""
    q, k = torch.randn(1, 1, 1, 8).expand(1, 12, 1, 8), torch.randn(1, 1, 1, 8).expand(1, 12, 1, 8)
    rq, rk = models._rotated(q.contiguous())[0, :, 0], models._rotated(k.contiguous())[0, :, 0]
    torch.testing.assert_close(rq.norm(dim=-1), q[0, :, 0].norm(dim=-1))
    score = rq @ rk.T  # [m, n]
    torch.testing.assert_close(score[5, 2], score[8, 5])
    torch.testing.assert_close(score[2, 2], score[11, 11])
    assert (score[5, 2] - score[5, 4]).abs() > 1e-4  # the offset does matter


@pytest.mark.unit
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"style": "bert"}, "--gpt-style must be one of gpt2, llama"),
        ({"kv_heads": 3}, "--gpt-heads 4 must be a multiple of --gpt-kv-heads 3"),
        ({"kv_heads": 0}, "--gpt-kv-heads must be positive"),
        ({"hidden": -1}, "--gpt-hidden must be positive"),
        ({"style": "llama", "width": 12, "heads": 4}, "each head's width (3) must be even"),
    ],
)
def test_a_bad_gpt_shape_is_named_by_its_flag(options, message):
    shape = {"width": 32, "heads": 4, **options}
    assert message in models.gpt_shape_error(**shape)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        models.build("gpt", (8,), 256, depth=1, **shape)


@pytest.mark.unit
def test_gpt_loads_an_older_state_dict_with_one_fused_qkv_map():
    """ddpkit 0.2's attention had one `qkv` map (rows: queries, keys, values) and split it per
    head in its forward; its state_dict loads into the separate q, k, v maps and computes the
    same function (the old forward is written out here)."""
    import torch.nn.functional as F

    net = models.build("gpt", (8,), 256, width=32, depth=2, heads=4).eval()
    old = {}
    for name, value in net.state_dict().items():
        if ".attn.q." in name:
            kind = name.rsplit(".", 1)[1]
            prefix = name.split(".attn.")[0] + ".attn."
            parts = [torch.randn_like(value) for _ in range(3)]
            old[f"{prefix}qkv.{kind}"] = torch.cat(parts)
        elif ".attn.k." not in name and ".attn.v." not in name:
            old[name] = value
    net.load_state_dict(old)  # strict: every q, k, v key came from the fused one
    x = torch.randint(0, 256, (2, 8))
    h = net.embed(x)
    for i in range(2):
        block = getattr(net, f"block{i}")
        b, t, c = h.shape
        fused = F.linear(block.norm1(h), old[f"block{i}.attn.qkv.weight"], old[f"block{i}.attn.qkv.bias"])
        q, k, v = fused.view(b, t, 3, 4, c // 4).permute(2, 0, 3, 1, 4)  # the old forward
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        h = h + block.attn.out(y)
        h = h + block.mlp(block.norm2(h))
    torch.testing.assert_close(net.head(h), net(x))


@pytest.mark.unit
@pytest.mark.parametrize("name,shape", [("lenet", (3, 2, 2)), ("cnn", (1, 1, 1)), ("cnn", (10,))])
def test_model_input_checks(name, shape):
    with pytest.raises(ValueError, match=name):
        models.check(name, shape)


USER_MODELS = """
import math
import os

import torch

from torch import nn

def tiny(in_shape, num_classes):
    log = os.environ.get("DDPKIT_TEST_BUILD_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {tuple(in_shape)} {num_classes}\\n")
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(in_shape), num_classes))

def not_a_module(in_shape, num_classes):
    return "a string"

def no_parameters(in_shape, num_classes):
    return nn.Flatten()

def frozen(in_shape, num_classes):
    return tiny(in_shape, num_classes).requires_grad_(False)

def fails_when_called(in_shape, num_classes):
    raise RuntimeError("only at build time")

def exits(in_shape, num_classes):
    raise SystemExit(5)

def width(n):
    return lambda in_shape, num_classes: nn.Sequential(nn.Flatten(), nn.Linear(math.prod(in_shape), n))

three_outputs, fifty_outputs = width(3), width(50)

def from_file(in_shape, num_classes):
    # Weights loaded from a file: real CPU tensors, which a meta input cannot meet.
    import torch
    model = tiny(in_shape, num_classes)
    model.load_state_dict(torch.load(os.environ["DDPKIT_TEST_WEIGHTS"], weights_only=True))
    return model

class NeedsValues(nn.Module):
    # .item() has no meta kernel: this forward runs on real tensors only.
    def __init__(self, in_shape, num_classes):
        super().__init__()
        self.fc = nn.Linear(math.prod(in_shape), num_classes)

    def forward(self, x):
        return self.fc(x.flatten(1)) * (1.0 if x.sum().item() == x.sum().item() else 0.0)

VALUE = 3

class Bare(nn.Module):
    # Its one parameter is its own: no child block to checkpoint.
    def __init__(self, in_shape, num_classes):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(math.prod(in_shape), num_classes))

    def forward(self, x):
        return x.flatten(1) @ self.w
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module `user_models_<n>` in a fresh directory that is the current directory."""
    name = f"user_models_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(USER_MODELS)
    monkeypatch.chdir(tmp_path)
    yield name
    sys.modules.pop(name, None)


@pytest.mark.unit
def test_build_user_model_from_current_directory(user_module):
    before = list(sys.path)
    model = models.build(f"{user_module}:tiny", (1, 8, 8), 10)
    assert isinstance(model, nn.Module) and model(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    assert sys.path == before  # the current directory was on sys.path only while importing
    models.check(f"{user_module}:tiny", (1, 8, 8))
    resolve(TrainConfig(model=f"{user_module}:tiny", data="synthetic", synthetic_shape="1,8,8"))


@pytest.mark.unit
@pytest.mark.parametrize(
    "suffix, message",
    [
        (":not_a_module", "must return a torch.nn.Module, got str"),
        (":no_parameters", "returned a module with no parameter that requires a gradient"),
        (":frozen", "returned a module with no parameter that requires a gradient"),
        (":missing", "has no attribute 'missing'"),
        (":VALUE", "is not callable"),
        (":", "expected package.module:function"),
    ],
)
def test_bad_user_model_is_a_usage_error(user_module, suffix, message):
    with pytest.raises(ValueError, match=message):
        models.build(user_module + suffix, (1, 8, 8), 10)
    with pytest.raises(UsageError, match=f"^--model {user_module}{suffix}: .*{message}"):
        resolve(TrainConfig(model=user_module + suffix))


@pytest.mark.unit
def test_unknown_module_and_unknown_name():
    with pytest.raises(UsageError, match="--model no_such_module_xyz:f: cannot import module 'no_such_module_xyz'"):
        resolve(TrainConfig(model="no_such_module_xyz:f"))
    with pytest.raises(UsageError, match="--model: unknown value 'resnet19'.*package.module:function"):
        resolve(TrainConfig(model="resnet19"))


@pytest.mark.unit
@pytest.mark.parametrize(
    "function, message",
    [
        ("fails_when_called", r"fails_when_called\(\(1, 8, 8\), 10\) raised RuntimeError: only at build time"),
        ("exits", r"exits\(\(1, 8, 8\), 10\) called sys.exit\(5\)"),
        ("three_outputs", r"its forward gives \(1, 3\) .*expected logits of shape \(1, 10\)"),
        ("fifty_outputs", r"its forward gives \(1, 50\) .*expected logits of shape \(1, 10\)"),
    ],
)
@pytest.mark.parametrize("on", ["cpu", "meta"])
def test_a_function_that_fails_or_gives_the_wrong_width_is_refused(user_module, monkeypatch, function, message, on):
    # A model above the size limit is probed on the meta device; a small one on the CPU.
    monkeypatch.setattr(models, "PROBE_ON_CPU_BYTES", 0 if on == "meta" else models.PROBE_ON_CPU_BYTES)
    with pytest.raises(UsageError, match=f"^--model {user_module}:{function}: {message}"):
        resolve(TrainConfig(model=f"{user_module}:{function}"))


@pytest.mark.unit
@pytest.mark.parametrize("on", ["cpu", "meta"])
def test_a_model_that_loads_weights_or_needs_real_tensors_passes_the_probe(user_module, monkeypatch, tmp_path, on):
    monkeypatch.setattr(models, "PROBE_ON_CPU_BYTES", 0 if on == "meta" else models.PROBE_ON_CPU_BYTES)
    torch.save(models.build(f"{user_module}:tiny", (1, 8, 8), 10).state_dict(), tmp_path / "w.pt")
    monkeypatch.setenv("DDPKIT_TEST_WEIGHTS", str(tmp_path / "w.pt"))
    models.check(f"{user_module}:from_file", (1, 8, 8), 10)
    models.check(f"{user_module}:NeedsValues", (1, 8, 8), 10)


@pytest.mark.cli
def test_user_model_in_ddpkit_train_nproc_2(tmp_path, user_module):
    log = tmp_path / "builds.txt"
    proc = run_cli(
        "train",
        "--model",
        f"{user_module}:tiny",
        "--nproc",
        "2",
        "--epochs",
        "1",
        "--data",
        "synthetic",
        "--synthetic-shape",
        "1,8,8",
        "--synthetic-size",
        "128",
        "--out",
        str(tmp_path / "run"),
        cwd=str(tmp_path),
        env={"DDPKIT_TEST_BUILD_LOG": str(log)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{user_module}:tiny" in proc.stdout
    pids = {line.split()[0] for line in log.read_text().splitlines()}
    assert len(pids) >= 2  # built in each worker (and checked in the parent)
    assert json.loads((tmp_path / "run/results.json").read_text())["world_size"] == 2


@pytest.mark.unit
def test_gpt_dropout_reaches_each_block_from_the_flag():
    from ddpkit.trainer.config import model_options

    cfg = TrainConfig(model="gpt", gpt_dropout=0.2, gpt_width=8, gpt_depth=2, gpt_heads=2)
    model = models.build("gpt", (16,), 256, **model_options(cfg))
    drops = [m for m in model.modules() if isinstance(m, nn.Dropout)]
    assert len(drops) == 4 and {m.p for m in drops} == {0.2}  # attention's and the MLP's, per block
    model.train()
    x = torch.randint(0, 256, (2, 16))
    torch.manual_seed(0)
    assert not torch.equal(model(x), model(x))  # it drops


@pytest.mark.unit
def test_activation_checkpointing_needs_a_block_to_checkpoint(user_module):
    # Refused in the plan, before any worker (a worker would only find out at setup()).
    shape = {"data": "synthetic", "synthetic_shape": "1,8,8", "activation_checkpointing": True}
    with pytest.raises(UsageError, match=rf"^--activation-checkpointing: --model {user_module}:Bare has no block"):
        resolve(TrainConfig(model=f"{user_module}:Bare", **shape))
    resolve(TrainConfig(model=f"{user_module}:tiny", **shape))  # its Linear is a block
