"""`ddpkit train --model gpt --data text --strategy fsdp --nproc 2` end to end on a small folder
of uneven text files: it trains, evaluates every test token exactly once (loss per token and
perplexity), writes its outputs, and model.pt loads into the bare model; with --gpt-dropout it
ends on one process where it ends on two, and a run with its activations checkpointed ends
bit-identical to one without."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch

from ddpkit import models
from ddpkit.data import text
from tests.cli.helpers import ok
from tests.conftest import PNG_MAGIC, run_cli

pytestmark = [pytest.mark.cli, pytest.mark.slow]

SHAPE = ("--gpt-width", "16", "--gpt-depth", "2", "--gpt-heads", "2", "--seq-len", "32")


def test_gpt_trains_under_fsdp_on_two_processes(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, n in enumerate((700, 130, 2000, 45)):  # documents of uneven length
        (corpus / f"doc{i}.txt").write_bytes(bytes((97 + (j * j + i) % 26) for j in range(n)))

    def train(nproc: int, dropout: str, *more: str, name: str = "") -> tuple[object, dict]:
        out = tmp_path / (name or f"out{nproc}-{dropout}")
        # (--model gpt brings --data text; named here as a user would.)
        proc = run_cli(
            "train", "--model", "gpt", "--data", "text", "--text-path", str(corpus), *SHAPE,
            "--strategy", "fsdp", "--nproc", str(nproc), "--device", "cpu", "--batch-size", "9",
            "--micro-batch-size", "2", "--epochs", "2", "--log-every", "3", "--gpt-dropout", dropout,
            "--out", str(out), *more,
        )  # fmt: skip
        ok(proc)
        return proc, json.loads((out / "results.json").read_text())

    proc, results = train(2, "0.2")
    out = tmp_path / "out2-0.2"
    # The dropout's masks do not depend on the number of processes: one process ends where two
    # do, within rounding (that dropout changes a run: tests/test_own_loop.py).
    one = train(1, "0.2")[1]
    assert one["test_loss"] == pytest.approx(results["test_loss"], rel=1e-5, abs=0)
    _, test = text.text(str(corpus), 32)
    assert results["strategy"] == "fsdp" and results["world_size"] == 2
    assert results["test_tokens"] == test.tokens() and results["test_samples"] == len(test)  # each counted once
    assert results["test_perplexity"] == pytest.approx(math.exp(results["test_loss"]), rel=1e-12)
    assert results["test_perplexity"] < 256  # it learned: a uniform guess over bytes is 256
    assert 0 <= results["test_accuracy"] <= 1 and results["tokens_per_second"] > 0
    assert f"done: test perplexity {results['test_perplexity']:.3f}" in proc.stdout
    lines = [line for line in proc.stdout.splitlines() if line.startswith("epoch ")]
    assert len(lines) == 2 and all("ppl" in line for line in lines)  # one line per epoch, from rank 0
    epochs = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["type"] == "epoch"]
    assert [r["test_perplexity"] for r in epochs][-1] == results["test_perplexity"]
    with open(out / "metrics.csv", newline="") as f:
        assert [float(r["test_perplexity"]) for r in csv.DictReader(f)] == [r["test_perplexity"] for r in epochs]
    assert (out / "curves.png").read_bytes().startswith(PNG_MAGIC)
    weights = torch.load(out / "model.pt", weights_only=True)
    model = models.build("gpt", (32,), 256, width=16, depth=2, heads=2)
    model.load_state_dict(weights, strict=True)  # bare names, whole tensors
    # (Stopped and resumed, a gpt run with dropout ends bit-identical, its masks keyed by the
    # step the checkpoint carries: tests/launcher/test_faults.py, on a mesh, after a SIGKILL.)
    # Each block's activations checkpointed (recomputed in the backward, its masks drawn again
    # alike): the same weights to the last bit, under the same names.
    train(2, "0.2", "--activation-checkpointing", name="checkpointed")
    again = torch.load(tmp_path / "checkpointed" / "model.pt", weights_only=True)
    assert weights.keys() == again.keys() and all(torch.equal(weights[k], again[k]) for k in weights)
